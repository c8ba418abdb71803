"""A task's attempts: each a fresh child; a cut one re-dispatched only when provably safe (I6).

The loop waits for an attempt to end, asks the pure decision (``_core.redispatch``) with facts
from the journal, and re-checks the task's cancel generation before the settle delay, after it,
and after the new child is forked. The re-dispatch event fires right before the new child is
dispatched, never for one that did not happen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tether._core.errors import (
    AlreadyFinished,
    ControlRefused,
    DelegationError,
    InvalidTransition,
    RedispatchCancelled,
)
from tether._core.model import ControlKind, DelegationState
from tether._core.redispatch import (
    AttemptFacts,
    CeilingReached,
    Code,
    Ending,
    Partial,
    RedispatchDecision,
    StreamCut,
    cancelled,
    decide_redispatch,
)
from tether._journal.ops import FenceRefused
from tether._journal.rows import NewDelegation
from tether._runtime.clock import first_of
from tether._runtime.state import ChildRuntime, TaskRun, new_id
from tether._runtime.telemetry import ERROR_OUTCOMES, HookEvent
from tether._runtime.tools import Agent, Tool, surface_name

if TYPE_CHECKING:
    from tether._runtime import ports


async def end_children(sup: ports.Handles, rt: ChildRuntime, state: DelegationState) -> None:
    """A delegation never ends while a child it started still runs, as a nursery's scope
    (Trio): once it returned, it waits for them; once it failed (or ended any other way), it
    terminates them first. Otherwise a child outlived its parent's end, and a terminate of
    the task, finding its root ended, returned while that child went on paying."""
    for child in list(rt.children):
        run = child.run
        if run is None or run.done.done():
            continue
        if state is not DelegationState.SUCCEEDED:
            # (it may end, or be stopped by someone else, meanwhile)
            with contextlib.suppress(AlreadyFinished, ControlRefused, InvalidTransition):
                await sup.issue_control(run.current.id, ControlKind.TERMINATE, None,
                                        f"its parent {rt.id} ended {state.value}")
        await asyncio.wait([run.done])
        if run.current.draining is not None:
            await asyncio.gather(run.current.draining, return_exceptions=True)


def ending_of(value: object) -> tuple[Ending, str]:
    """Classify how an attempt ended, with the failure code kept in the journal. A Partial is
    what a cut stream salvaged."""
    if isinstance(value, Partial):
        return Ending.STREAM_CUT, "stream_cut:partial"
    if isinstance(value, StreamCut):
        return Ending.STREAM_CUT, f"stream_cut:{value.reason.value}"
    if isinstance(value, CeilingReached):
        return Ending.CEILING, f"ceiling:{value.kind}"
    return Ending.ERROR, f"error:{type(value).__name__}"


def surface_facts(rt: ChildRuntime) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]],
                                              frozenset[str]]:
    """The surface by name, each reachable agent's surface, and which names are declared."""
    agents: dict[str, tuple[str, ...]] = {}
    known: set[str] = set()

    def visit(items: Sequence[Tool | Agent | str]) -> tuple[str, ...]:
        names = []
        for item in items:
            if isinstance(item, str):
                names.append(item)
                continue
            names.append(surface_name(item))
            if isinstance(item, Tool):
                known.add(item.name)
            elif item.name not in agents:
                agents[item.name] = ()  # placeholder first, so a cycle terminates
                agents[item.name] = visit(item.tools)
        return tuple(names)

    surface = visit(list(rt.surface.values()))
    return surface, agents, frozenset(known)


async def record(sup: ports.Attempts, rt: ChildRuntime, decision: RedispatchDecision,
                 check: str) -> None:
    sup.journal.event(sup.clock.wall(), "redispatch_decision", rt.id, None,
                      code=decision.code.value, detail=decision.detail, check=check,
                      attempt=rt.row.attempt)
    sup.telemetry.decisions.add(1, {"code": decision.code.value, "check": check})


async def first_decision(sup: ports.Attempts, run: TaskRun, rt: ChildRuntime,
                         value: object) -> RedispatchDecision:
    ending, _ = ending_of(value)
    await sup.journal.flush()
    surface, agents, known = surface_facts(rt)
    # The next attempt replays by key what every attempt and epoch of the task recorded.
    kin = await sup.journal.kin([rt.id])
    tampered = tuple(f"{v.delegation_id}: {p.record}" for v in await sup.journal.chain_verdicts(
        kin, sup.keys.trusted) for p in v.problems)
    facts = AttemptFacts(
        ending=ending,
        partial_usable=isinstance(value, Partial),
        attempt=rt.row.attempt,
        side_effects_started=(await sup.journal.facts(rt.id)).side_effecting,
        tools_ran=await sup.journal.tools_ran(rt.id),
        surface=surface, agents=agents, known_tools=known,
        generation_at_start=rt.generation,
        generation_now=await sup.journal.cancel_generation(run.task_id),
        tampered=tampered,
    )
    decision = decide_redispatch(facts, run.policy)
    await record(sup, rt, decision, "attempt_ended")
    return decision


async def stop_hook(sup: ports.Attempts, rt: ChildRuntime, reason: str | None) -> None:
    row = rt.final if rt.final is not None and rt.stop is None else await sup.journal.get(rt.id)
    rt.outcome = row.state.value
    sup.telemetry.finish(rt.span, row.state.value,
                         row.failure if row.state.value in ERROR_OUTCOMES else None,
                         failure=row.failure)
    if row.failure is not None:
        sup.telemetry.failed.add(1, {"attempt": rt.row.attempt, "reason": row.failure})
    await sup.run_hook("on_child_stop", HookEvent(
        rt.row.task_id, rt.id, rt.row.attempt, rt.agent.name, row.state.value,
        reason or row.failure))


async def drive(sup: ports.Attempts, run: TaskRun, args: Sequence[Any],
                kwargs: dict[str, Any]) -> None:
    """Own a task until its last attempt ends; settle ``run.done`` exactly once."""
    rt = run.current
    try:
        while True:
            assert rt.task is not None
            try:
                ok, value = await rt.task
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if rt.stop is None or (me is not None and me.cancelling()):
                    raise  # the supervisor is closing
                # A cut reached the child where it stood outside its handlers: stopped, and
                # its drain settles it; the task's caller gets its failure, not a cancel.
                ok, value = False, rt.stop
            if rt.draining is not None:
                await asyncio.gather(rt.draining, return_exceptions=True)
            stopped = rt.stop is not None
            await stop_hook(sup, rt, None)
            if stopped or (ok and not isinstance(value, Partial)):
                break
            decision = await first_decision(sup, run, rt, value)
            if not decision.redispatch:
                break
            await first_of(sup.clock, run.policy.settle_delay, run.cut_short.wait())
            moved = cancelled(rt.generation, await sup.journal.cancel_generation(run.task_id),
                              Code.CANCELLED_DURING_DELAY)
            if moved is not None:
                await record(sup, rt, moved, "after_delay")
                break
            fresh = await fork(sup, run, rt, args, kwargs)
            if fresh is None:
                ok, value = False, RedispatchCancelled("cancelled while re-dispatching")
                break
            rt = fresh
    except asyncio.CancelledError:  # the supervisor is closing
        run.done.cancel()
        raise
    except BaseException as exc:
        if not run.done.done():
            run.done.set_exception(exc)
        raise
    finally:
        # The last attempt's state (a recalled one's as its drain settled it, so not its
        # ``final``); none if the supervisor closed first: what the journal holds is in doubt.
        last = run.attempts[-1].outcome if run.attempts else None
        sup.telemetry.finish(run.span, last or "IN_DOUBT", None if last else "in_doubt")
        # Accounted for: the supervisor forgets it (handles keep their own reference), so a
        # long-lived supervisor's memory does not grow with every delegation it ever ran.
        for attempt in run.attempts:
            sup.forget(attempt)
    if not run.done.done():
        run.done.set_result((ok, value))


async def fork(sup: ports.Attempts, run: TaskRun, failed: ChildRuntime, args: Sequence[Any],
               kwargs: dict[str, Any]) -> ChildRuntime | None:
    """A genuinely fresh child: its own delegation row (attempt n + 1), id and trace. None if
    the journal refuses it (its parent was fenced, the task moved on, a successor exists)."""
    try:
        row = await sup.journal.create_delegation(NewDelegation(
            id=new_id("d"), task_id=failed.row.task_id, parent_id=failed.row.parent_id,
            attempt=failed.row.attempt + 1, agent=failed.agent.name, surface=failed.row.surface,
            args=failed.row.args, owner_id=sup.owner_id, now=sup.clock.wall(),
            retry_of=failed.id, model=failed.row.model,
        ))
    except (FenceRefused, InvalidTransition):
        return None
    rt = ChildRuntime(row, failed.agent, failed.surface, parent=failed.parent, run=run,
                      generation=failed.generation)
    if failed.parent is not None:
        failed.parent.children.append(rt)
    started = await sup.start_attempt(rt, args, kwargs, retry=True, after=failed)
    return rt if started else None


def result_of(ok: bool, value: Any, rt: ChildRuntime) -> Any:
    """What ``Handle.result`` returns or raises for a finished task."""
    if ok:
        return value
    reason = type(value).__name__ if isinstance(value, BaseException) else str(value)
    err = DelegationError(rt.id, rt.row.task_id, rt.row.attempt, f"{reason}: {value}")
    if isinstance(value, BaseException):
        raise err from value
    raise err
