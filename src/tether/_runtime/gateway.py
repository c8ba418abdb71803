"""The gateway: the one place every tool call of a child passes.

It checks the surface, stops a recalled child, writes the action's intent ahead of the call
(I1) behind the journal's fence (I2), hands the tool its idempotency key (I7), shields the
call from the child's cancellation and records the receipt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from tether._core import values
from tether._core.errors import Fenced, ToolRejected, UserError
from tether._core.model import CallEnd, receipt_of
from tether._core.redispatch import UNRESTRICTED
from tether._journal.rows import Begin, NewAction
from tether._runtime.handle import Handle
from tether._runtime.logs import logger
from tether._runtime.state import ChildRuntime, new_id
from tether._runtime.telemetry import current
from tether._runtime.tools import Agent, Tool, surface_name

if TYPE_CHECKING:
    from tether._runtime import ports

UNSERIALIZABLE = values.UNSERIALIZABLE

# ``interceptor(tool, key, kwargs, journaled)`` wraps one journaled call; ``journaled(tool)``
# runs the write-ahead path with the tool given. Installed only by code (the chaos harness
# plants its deliberate bugs here); nothing reads this from the environment or a file, so no
# deployment setting can switch write-ahead (I1) off.
Journaled = Callable[[Tool], Awaitable[Any]]
Interceptor = Callable[[Tool, str, dict[str, Any], Journaled], Awaitable[Any]]
INTERCEPTORS: list[Interceptor] = []
# The journaled action a tool function runs for (set in its own task, around the call): what
# a tool that journals facts of its own about the call (the MCP proxy's task ids) names them by,
# since one idempotency key may be used again once an earlier call with it did not apply.
ACTION: ContextVar[str | None] = ContextVar("tether_action", default=None)
# The model's id for the tool call an adapter passes to ``Context.call`` (``model_call``):
# read by that call and cleared for what it runs, so no call its tool makes inherits it.
_MODEL_CALL: ContextVar[str | None] = ContextVar("tether_model_call", default=None)


@contextmanager
def model_call(call_id: str | None) -> Iterator[None]:
    """Inside: a ``Context.call`` is the model's tool call ``call_id`` (its framework's id for
    it), which its span carries as ``gen_ai.tool.call.id``."""
    token = _MODEL_CALL.set(call_id if isinstance(call_id, str) and call_id else None)
    try:
        yield
    finally:
        _MODEL_CALL.reset(token)


log = logger("supervisor")


def args_json(kwargs: dict[str, Any]) -> str:
    """Deterministic JSON for a call's arguments (``_core.values``: the one encoding of stored
    values), hashed for the Stripe rule: these bytes are compared, never signed."""
    return values.dumps(kwargs)


class Context:
    """What a child sees: ``call`` its tools, ``delegate`` to agents it was granted."""

    def __init__(self, supervisor: ports.Calls, runtime: ChildRuntime) -> None:
        self._sup = supervisor
        self._rt = runtime
        self._believed: set[str] = set()  # delegations whose records a replay verified

    @property
    def delegation_id(self) -> str:
        return self._rt.row.id

    @property
    def task_id(self) -> str:
        return self._rt.row.task_id

    @property
    def epoch(self) -> int:
        return self._rt.row.epoch

    @property
    def attempt(self) -> int:
        return self._rt.row.attempt

    def check(self) -> None:
        """Raise the recall or terminate signal if one was accepted. Call it between long
        steps that do not pass the gateway (a model call, say)."""
        if self._rt.stop is not None:
            raise self._rt.stop

    def _resolve(self, item: Tool | Agent | str) -> Tool | Agent:
        if not isinstance(item, str | Tool | Agent):
            raise UserError(f"{item!r} is not a tether tool; wrap it with @tether.tool")
        name = item if isinstance(item, str) else surface_name(item)
        surface = self._rt.surface
        found = surface.get(name)
        if found is None and UNRESTRICTED in surface and isinstance(item, Tool | Agent):
            return item  # an unrestricted surface admits any declared tool
        if isinstance(found, str):
            raise UserError(f"tool {name!r} is granted but not declared with @tether.tool, "
                            "so tether cannot mediate it")
        if found is None or (not isinstance(item, str) and found is not item):
            raise UserError(
                f"tool {name!r} is not in the surface of delegation {self.delegation_id}"
            )
        return found

    async def call(self, tool: Tool | str, /, *, idempotency_key: str | None = None,
                   **kwargs: Any) -> Any:
        found = self._resolve(tool)
        if isinstance(found, Agent):
            raise UserError(f"{found.grant} is an agent: use ctx.delegate to start it")
        self.check()
        call_id = _MODEL_CALL.get()
        token = _MODEL_CALL.set(None)
        try:
            return await self._call(found, call_id, idempotency_key, kwargs)
        finally:
            _MODEL_CALL.reset(token)

    async def _call(self, found: Tool, call_id: str | None, idempotency_key: str | None,
                    kwargs: dict[str, Any]) -> Any:
        sup, rt = self._sup, self._rt
        if not found.effect.journaled:
            # Not journaled as an action, but recorded: the journal can then prove that no
            # tool at all ran in an attempt (I6).
            sup.journal.event(sup.clock.wall(), "read", rt.id, None, tool=found.name)
            span = sup.telemetry.action_span(rt.span, found.name, found.effect.value,
                                             rt.row.task_id, rt.row.attempt, call_id=call_id)
            try:
                with current(span):
                    value = await found.fn(**kwargs)
            except asyncio.CancelledError:
                sup.telemetry.finish(span, "CANCELLED")
                raise
            except BaseException as exc:
                sup.telemetry.finish(span, "FAILED", exc)
                raise
            sup.telemetry.finish(span, "COMPLETED")
            return value
        try:
            encoded = args_json(kwargs)
        except UserError as exc:
            raise UserError(f"arguments to {found.name} cannot be serialized: {exc}") from None
        if idempotency_key is not None and (not isinstance(idempotency_key, str)
                                            or not idempotency_key):
            raise UserError("idempotency_key must be a non-empty string")
        # Reserved before any await, so concurrent calls of one child get distinct keys.
        ordinal, order = rt.ordinals[found.name], rt.calls
        rt.ordinals[found.name] += 1
        rt.calls += 1
        key = idempotency_key or f"{rt.row.task_id}:{found.name}:{ordinal}"
        args_hash = hashlib.sha256(encoded.encode()).hexdigest()

        async def journaled(tool: Tool) -> Any:
            return await self._journaled(tool, key, encoded, args_hash, order, kwargs, call_id)

        call: Journaled = journaled
        for outer in INTERCEPTORS:
            call = _wrap(outer, found, key, kwargs, call)
        return await call(found)

    async def _journaled(self, found: Tool, key: str, encoded: str, args_hash: str, order: int,
                         kwargs: dict[str, Any], call_id: str | None) -> Any:
        sup, rt = self._sup, self._rt
        clock, journal = sup.clock, sup.journal
        while True:
            now = clock.wall()
            begun = await journal.begin_action(NewAction(
                id=new_id("a"), delegation_id=rt.id, epoch=rt.row.epoch, ordinal=order,
                tool=found.name, effect=found.effect, args_json=encoded, args_hash=args_hash,
                idem_key=key, now=now, deadline_at=now + found.dispatch_deadline,
            ))
            if begun.status is not Begin.WAIT:
                break
            # An earlier call with this key (a recalled or crashed attempt's) may still apply:
            # wait for its outcome, then replay it or run again if it finally did not apply.
            await self._sup.await_call(begun.action_id, key)
        if begun.status in (Begin.FENCED, Begin.STALE_EPOCH, Begin.LEASE_EXPIRED):
            # The journal's fence is the authority; our in-memory flag may not know yet.
            log.info("call to %s refused: %s", found.name, begun.status.value,
                     extra={"delegation": rt.id, "tool": found.name,
                            "refusal": begun.status.value})
            raise rt.stop or Fenced(rt.id, f"journal refused {found.name}: {begun.status.value}")
        if begun.status is Begin.REPLAY:
            # A replay believes another record's result: only if its delegation's records
            # verify (an intruder's COMPLETED row under a coming key would otherwise be paid
            # for by nobody, and believed). Once per delegation and child.
            owner = (await journal.action(begun.action_id)).delegation_id
            if owner not in self._believed:
                await journal.untampered([owner], sup.keys.trusted,
                                         f"replay action {begun.action_id} for key {key!r}")
                self._believed.add(owner)
            journal.event(clock.wall(), "replay", rt.id, begun.action_id, key=key)
            if isinstance(begun.result, dict) and UNSERIALIZABLE in begun.result:
                raise UserError(
                    f"action {begun.action_id} with key {key!r} completed, but its result "
                    "could not be recorded, so it cannot be replayed"
                )
            return begun.result
        if found.effect.side_effecting:
            rt.effects_started += 1
        sup.telemetry.actions.add(1, {"effect": found.effect.value, "tool": found.name})
        task = asyncio.create_task(self._run(found, begun.action_id, key, kwargs,
                                             now + found.dispatch_deadline, call_id))
        rt.inflight[begun.action_id] = task
        self._sup.track_call(begun.action_id, task, now + found.dispatch_deadline)
        task.add_done_callback(_forget(rt, begun.action_id))
        # Shielded: cancelling the child does not cancel an action already on its way.
        return await asyncio.shield(task)

    async def _run(self, tool: Tool, action_id: str, key: str, kwargs: dict[str, Any],
                   deadline_at: float, call_id: str | None) -> Any:
        journal, clock, rt = self._sup.journal, self._sup.clock, self._rt
        telemetry = self._sup.telemetry
        span = telemetry.action_span(rt.span, tool.name, tool.effect.value, rt.row.task_id,
                                     rt.row.attempt, action_id=action_id, call_id=call_id)
        if clock.wall() >= deadline_at:
            # Paused between the intent and the send: past its deadline the call would break
            # the tool's promise that nothing applies later, so it is never sent.
            state = receipt_of(CallEnd.PAST_DEADLINE)
            journal.finish_action(action_id, state, clock.wall(),
                                  error="dispatch deadline passed before the call was sent")
            telemetry.finish(span, state.value, "dispatch_deadline")
            raise ToolRejected(f"{tool.name}: dispatch deadline passed before the call was sent")
        ACTION.set(action_id)  # this task's own context: the action's, to its end
        try:
            with current(span):  # this task's own context, as ACTION's
                result = await tool.fn(**kwargs, idempotency_key=key)
        except ToolRejected as exc:
            state = receipt_of(CallEnd.REJECTED)
            journal.finish_action(action_id, state, clock.wall(), error=str(exc))
            telemetry.finish(span, state.value, exc)
            raise
        except Exception as exc:  # it may have applied: reconciliation decides
            state = receipt_of(CallEnd.RAISED)
            journal.finish_action(action_id, state, clock.wall(), error=repr(exc))
            telemetry.finish(span, state.value, exc)
            raise
        except asyncio.CancelledError:
            # Cut while on its way: the journal holds it in doubt until a probe says.
            telemetry.finish(span, receipt_of(CallEnd.CUT).value, "cancelled")
            raise
        state = receipt_of(CallEnd.RETURNED)
        telemetry.finish(span, state.value)
        journal.finish_action(action_id, state, clock.wall(), result=values.storable(result))
        return result

    async def delegate(self, agent: Agent, /, *args: Any, **kwargs: Any) -> Handle:
        """Start a grandchild. The surface must grant ``agent``; the journal refuses it if this
        delegation is fenced (I10)."""
        return await self.delegate_at(None, agent, *args, **kwargs)

    async def delegate_at(self, place: str | None, agent: Agent, /, *args: Any,
                          **kwargs: Any) -> Handle:
        """``delegate``, the grandchild's task named by ``place`` (the same in every attempt
        that starts it: a graph step's place in its thread, say) rather than by how many
        delegations of ``agent`` this attempt made before it. A resumed run starts at a later
        step, so a count would give its first grandchild the task, and the keys, of an earlier
        step's."""
        found = self._resolve(agent)
        if not isinstance(found, Agent):
            raise UserError(f"{found.name} is a tool: use ctx.call")
        if place is not None and (not isinstance(place, str) or not place.isalnum()):
            raise UserError(f"a delegation's place must be letters and digits, not {place!r}")
        self.check()
        run = await self._sup.start_child(self._rt, found, args, kwargs, place)
        return Handle.for_run(self._sup, run)


def _wrap(outer: Interceptor, tool: Tool, key: str, kwargs: dict[str, Any],
          inner: Journaled) -> Journaled:
    async def call(t: Tool) -> Any:
        return await outer(t, key, kwargs, inner)

    return call


def replaced(tool: Tool, fn: Callable[..., Awaitable[Any]]) -> Tool:
    """The tool with another function: for interceptors."""
    return dataclasses.replace(tool, fn=fn)


def _forget(rt: ChildRuntime, action_id: str) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        rt.inflight.pop(action_id, None)
        if not task.cancelled():
            task.exception()  # retrieved here; the child sees it through the shield

    return done

