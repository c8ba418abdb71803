"""What runs inside a Temporal activity that tether's plugin mediates: the activities a
``@tether.tool`` becomes, the idempotency key the gateway hands each, the arguments journaled
for it (by the tool's parameter names, or as the worker's payload converter encodes them), its
result as the journal keeps it, and the probe of an activity registered by someone else.
Outside the workflow sandbox, as all of tether on Temporal."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import temporalio.activity
import temporalio.common
import temporalio.converter
import temporalio.worker
from temporalio.exceptions import ApplicationError

from tether._core.errors import UserError
from tether._core.model import check_positive
from tether._runtime.tools import ProbeFn, Tool

# What a refused activity fails with: never retried by Temporal, since a retry would be
# refused the same way (a fence does not reopen).
REFUSED = "tether.Refused"
BUSY = "tether.Busy"  # retryable: the run's delegation moves on, or its host opens it


@dataclass
class Pending:
    """The activity call a proxy tool forwards, with its key once the gateway gave one."""

    next: temporalio.worker.ActivityInboundInterceptor
    input: temporalio.worker.ExecuteActivityInput


PENDING: ContextVar[Pending | None] = ContextVar("tether_temporal_pending", default=None)
_KEY: ContextVar[str | None] = ContextVar("tether_temporal_key", default=None)


def idempotency_key() -> str:
    """The key tether gave the activity running now: for an activity that is not a
    ``@tether.tool`` (it is EXTERNAL) and still wants to hand its provider the key."""
    key = _KEY.get()
    if key is None:
        raise UserError("no tether idempotency key here: it exists only inside an activity "
                        "tether's Temporal plugin runs")
    return key


async def forward(**kwargs: Any) -> Any:
    """A proxy tool's function: the gateway calls it (in the action's own task, with the key)
    and it runs the rest of Temporal's interceptor chain, down to the activity's code."""
    pending = PENDING.get()
    assert pending is not None, "a tether proxy tool runs only under the activity interceptor"
    _KEY.set(kwargs.get("idempotency_key"))  # the action task's own context
    result = await pending.next.execute_activity(pending.input)
    return as_json(result, temporalio.activity.payload_converter())


def as_json(value: Any, converter: temporalio.converter.PayloadConverter) -> Any:
    """An activity's result as the worker's payload converter encodes it (a framework's
    dataclass or model as its JSON): what the journal keeps, and what a replay by key hands
    Temporal, which encodes it again to the same payload and decodes it in the workflow to
    the type the workflow expects. A result the converter does not encode as JSON is kept as
    it is."""
    if value is None or type(value) in (str, int, bool):  # its own JSON: nothing to encode
        return value
    try:
        (payload,) = converter.to_payloads([value])
    except Exception:  # Temporal then fails the activity with the same error, as its own
        return value
    if payload.metadata.get("encoding") != b"json/plain":
        return value
    kept = json.loads(payload.data)
    try:  # only where the JSON alone encodes to the same payload (no type in the metadata)
        same = converter.to_payloads([kept]) == [payload]
    except Exception:  # the value itself goes to Temporal then, as before
        same = False
    return kept if same else value


def _parameters(tool: Tool) -> inspect.Signature:
    """The tool's signature as Temporal calls it: its arguments in order, without the key."""
    sig = inspect.signature(tool.fn)
    return sig.replace(parameters=[p for p in sig.parameters.values()
                                   if p.name != "idempotency_key"
                                   and p.kind is not inspect.Parameter.VAR_KEYWORD])


def tool_arguments(tool: Tool, args: Sequence[Any]) -> dict[str, Any]:
    """The activity's positional arguments by the tool's parameter names (defaults filled in,
    so that one call journals the same arguments however it was written)."""
    try:
        bound = _parameters(tool).bind(*args)
    except TypeError as exc:
        raise UserError(f"activity {tool.name}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def activity(tool: Tool) -> Callable[..., Awaitable[Any]]:
    """A Temporal activity (``@activity.defn(name=tool.name)``) that calls ``tool`` with its
    positional arguments and, for a journaled effect, the key tether's plugin hands it. Run
    without the plugin it refuses, rather than run a payment with no intent written."""

    async def run(*args: Any) -> Any:
        kwargs = tool_arguments(tool, args)
        if not tool.effect.journaled:
            return await tool.fn(**kwargs)
        key = _KEY.get()
        if key is None:
            raise ApplicationError(
                f"tether: activity {tool.name} runs only on a worker with tether's Temporal "
                "plugin (tether.temporal.Plugin)", type=REFUSED, non_retryable=True)
        return await tool.fn(**kwargs, idempotency_key=key)

    run.__name__ = run.__qualname__ = tool.name
    return temporalio.activity.defn(name=tool.name)(run)


def json_args(args: Sequence[Any]) -> list[Any]:
    """An undeclared activity's arguments as the worker's payload converter encodes them:
    what the journal compares (the Stripe rule) and shows."""
    out: list[Any] = []
    if len(args) == 1 and isinstance(args[0], Sequence) and args[0] and all(
            isinstance(a, temporalio.common.RawValue) for a in args[0]):
        args = args[0]  # a dynamic activity's: its arguments as Temporal sent them
    for payload in temporalio.activity.payload_converter().to_payloads(args):
        try:
            out.append(json.loads(payload.data))
        except ValueError:
            out.append({"encoding": payload.metadata.get("encoding", b"").decode(),
                        "bytes": len(payload.data)})
    return out


def refused(why: str, kind: str = REFUSED) -> ApplicationError:
    return ApplicationError(f"tether: {why}", type=kind, non_retryable=kind == REFUSED)


@dataclass(frozen=True)
class ActivityProbe:
    """How to ask the provider whether a call of an activity that is not a tether tool (a
    framework's) applied: ``probe(args=[...], idempotency_key=...)`` gets the call's arguments
    as journaled (JSON where the worker's payload converter encodes them as JSON, else their
    encoding and size) and returns a ``tether.ProbeResult``, whose ``result`` a COMPLETED call
    replays as the activity's return value. ``dispatch_deadline``: seconds after the call's
    intent past which nothing it sent can still apply at the provider (the activity's own
    work included); until then a "not applied" answer is "not applied yet"."""

    probe: ProbeFn
    dispatch_deadline: float

    def __post_init__(self) -> None:
        if not inspect.iscoroutinefunction(self.probe):
            raise UserError(f"tether.temporal.ActivityProbe: the probe must be an async "
                            f"function, not {self.probe!r}")
        try:
            inspect.signature(self.probe).bind(args=[], idempotency_key="")
        except TypeError as exc:
            raise UserError(f"tether.temporal.ActivityProbe: the probe is called as "
                            f"probe(args=[...], idempotency_key=...): {exc}") from None
        check_positive(self.dispatch_deadline, "tether.temporal.ActivityProbe: "
                       "dispatch_deadline")
