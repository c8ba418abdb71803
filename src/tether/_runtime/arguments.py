"""Checks of what a user hands the supervisor: its constructor's arguments, a child's
arguments and a child's result. A mistake is a ``UserError`` naming what is wrong, raised
where the user made it, not an ``AttributeError`` from deep inside later."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tether._core import values
from tether._core.errors import UserError
from tether._core.model import DelegationState, Policy, code_ended
from tether._core.redispatch import RedispatchPolicy
from tether._core.waiting import Interrupted
from tether._journal.journal import Journal
from tether._runtime.keys import KeyRing
from tether._runtime.tools import Agent


def child_payload(args: Sequence[Any], kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    """A child's arguments as the journal keeps them."""
    data = {"args": list(args), "kwargs": kwargs}
    try:
        values.check(data)
    except UserError as exc:
        raise UserError(f"arguments to {what} cannot be serialized: {exc}") from None
    return data


def unstorable(value: Any, agent: str) -> UserError | None:
    """A result is kept only if the journal gives it back unchanged, so a task's result is
    the same wherever it ran (here, or in a worker whose result is read from the journal);
    otherwise the child fails with this UserError (its actions are accounted for as always)."""
    try:
        values.check(value)
    except UserError as exc:
        return UserError(f"the result of {agent} cannot be stored: {exc}")
    return None


def stored_result(value: Any, agent: Agent) -> tuple[Any, Any]:
    """What the journal keeps of a child's result, and what ``Handle.result`` gives for it:
    the value itself when it is plain JSON, else (a framework's structured output) the JSON
    of the agent's output codec and the value rebuilt from that JSON, as any process reading
    the journal rebuilds it."""
    if agent.output is None:
        stored = shown = value
    else:
        try:
            stored = agent.output.dump(value)
            shown = agent.output.load(stored)
        except UserError as exc:
            raise UserError(f"the result of {agent.name} cannot be stored: {exc}") from None
    bad = unstorable(stored, agent.name)
    if bad is not None:
        raise bad
    return stored, shown


# What the journal records of a child's end: its state, result, error and failure code.
EndRecord = tuple[DelegationState, Any, str | None, str | None]


def ending_for(value: Any, agent: Agent) -> tuple[EndRecord, Any]:
    """How a child that returned ``value`` ends (``code_ended``), and what ``Handle.result``
    gives: its result, or the questions it waits on."""
    if isinstance(value, Interrupted):
        bad = unstorable(value.to_json(), agent.name)
        if bad is not None:
            raise UserError(f"the questions of {agent.name} cannot be stored: {bad}")
        return (code_ended(returned=True, waiting=True), value.to_json(), None, None), value
    stored, shown = stored_result(value, agent)
    return (code_ended(returned=True), stored, None, None), shown


def check_supervisor(journal: object, clock: object, keys: object, policy: object,
                     redispatch: object, tools: object) -> None:
    """The supervisor's constructor arguments."""
    if not isinstance(journal, str | Journal):
        raise UserError(f"journal must be a URL or a tether.Journal, not {type(journal).__name__}")
    if clock is not None and not all(callable(getattr(clock, name, None))
                                     for name in ("now", "wall", "sleep")):
        raise UserError("clock must have now(), wall() and sleep() (tether.testing.VirtualClock, "
                        f"say), not {type(clock).__name__}")
    for name, value, kind in (("keys", keys, KeyRing), ("policy", policy, Policy),
                              ("redispatch", redispatch, RedispatchPolicy)):
        if value is not None and not isinstance(value, kind):
            raise UserError(f"{name} must be a tether.{kind.__name__}, not {type(value).__name__}")
    if tools is not None and (isinstance(tools, str | bytes) or not isinstance(tools, Iterable)):
        raise UserError(f"tools must be a list of tools, not {type(tools).__name__}")
