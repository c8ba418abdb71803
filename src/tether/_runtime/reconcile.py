"""Reconciliation: ask the outside world what became of actions whose outcome is in doubt,
settle each delegation's final state, and build the reports."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tether._core.model import ActionState, DelegationState, ProbeOutcome
from tether._core.report import ActionRecord, Report
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow
from tether._runtime.clock import Clock
from tether._runtime.tools import Agent, ProbeResult, Tool

if TYPE_CHECKING:
    from tether._runtime.gateway import Context
    from tether._runtime.supervisor import Supervisor


async def probe_one(action: ActionRecord, tool: Tool | None, clock: Clock,
                    limit: float) -> ProbeResult:
    """Never guesses: no probe, a probe error or a timeout is UNKNOWN, with the reason."""
    if tool is None:
        return ProbeResult(ProbeOutcome.UNKNOWN,
                           {"reason": f"no tool named {action.tool!r} is known to reconcile with"})
    if tool.probe is None:
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": f"tool {tool.name} has no probe"})
    try:
        call = asyncio.ensure_future(
            tool.probe(**action.args, idempotency_key=action.idempotency_key))
    except Exception as exc:  # e.g. a probe whose signature does not fit the tool's arguments
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": f"probe could not be called: {exc!r}"})
    timer = asyncio.ensure_future(clock.sleep(limit))
    try:
        await asyncio.wait({call, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    if not call.done():
        call.cancel()
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": f"probe timed out after {limit:g}s"})
    if call.cancelled():
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": "probe was cancelled"})
    failure = call.exception()
    if failure is not None:
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": f"probe raised {failure!r}"})
    answer = call.result()
    if not isinstance(answer, ProbeResult) or not isinstance(answer.outcome, ProbeOutcome):
        return ProbeResult(ProbeOutcome.UNKNOWN,
                           {"reason": f"probe returned {answer!r}, not a ProbeResult"})
    return answer


async def probe_all(journal: Journal, actions: list[ActionRecord],
                    tools: Mapping[str, Tool], clock: Clock, limit: float) -> None:
    async def one(action: ActionRecord) -> None:
        answer = await probe_one(action, tools.get(action.tool), clock, limit)
        evidence = {**answer.evidence, "probe": answer.outcome.value, "probed_at": clock.wall()}
        await journal.settle_action(action.id, answer.outcome.action_state, clock.wall(),
                                    evidence, answer.result)

    await asyncio.gather(*(one(a) for a in actions))


def final_state(actions: list[ActionRecord], fallback: DelegationState) -> DelegationState:
    """A node's state once nothing of it is in flight: any UNKNOWN needs a person; anything
    that had to be probed is RECONCILED; otherwise ``fallback`` (RECALLED, TERMINATED, ...)."""
    if any(a.state in (ActionState.UNKNOWN, ActionState.IN_DOUBT) for a in actions):
        return DelegationState.NEEDS_ATTENTION
    if any(a.evidence for a in actions):
        return DelegationState.RECONCILED
    return fallback


def natural_end(state: DelegationState, fallback: DelegationState) -> DelegationState:
    """Where a stopped delegation ends when nothing had to be probed: a recall that was under
    way ends RECALLED (even if its owner died in the grace window), a terminate TERMINATED."""
    if state is DelegationState.RECALLING:
        return DelegationState.RECALLED
    if state is DelegationState.TERMINATING:
        return DelegationState.TERMINATED
    return fallback


async def settle_subtree(journal: Journal, root_id: str, clock: Clock,
                         fallback: DelegationState) -> None:
    """Move every non-terminal node (deepest first) to its final state. Finished nodes whose
    actions were reconciled afterwards move to RECONCILED or NEEDS_ATTENTION."""
    rows = await journal.subtree(root_id)
    acts = await journal.actions([r.id for r in rows])
    for row in reversed(rows):
        mine = [a for a in acts if a.delegation_id == row.id]
        if row.state.terminal:
            if row.state in (DelegationState.RECONCILED,):
                continue
            new = final_state(mine, row.state)
        else:
            new = final_state(mine, natural_end(row.state, fallback))
        if new is not row.state:
            await journal.set_state(row.id, new, clock.wall())


async def build_report(journal: Journal, root_id: str) -> Report:
    rows = await journal.subtree(root_id)
    acts = await journal.actions([r.id for r in rows])
    last = await journal.last_verdict(root_id)
    verdict = None if last is None else last.get("verdict")
    reason = "" if last is None else str(last.get("reason", ""))

    def build(row: DelegationRow) -> Report:
        return Report(
            delegation_id=row.id, task_id=row.task_id, epoch=row.epoch, attempt=row.attempt,
            agent=row.agent, outcome=row.state,
            verdict=verdict if row.id == root_id else None,
            reason=reason if row.id == root_id else "",
            actions=tuple(a for a in acts if a.delegation_id == row.id),
            children=tuple(build(c) for c in rows if c.parent_id == row.id),
            result=row.result, error=row.error,
        )

    return build(rows[0])


async def compensate(sup: Supervisor, report: Report, tools: Mapping[str, Tool]) -> Report | None:
    """The compensating delegation for a report's COMPLETED actions (``Supervisor.compensate``)."""
    plan = []
    for action in report.all_actions():
        tool = tools.get(action.tool)
        if action.state is ActionState.COMPLETED and tool and tool.compensate:
            plan.append((Tool(f"{tool.name}.compensate", tool.effect, tool.compensate), action))
    if not plan:
        return None
    granted = {t.name: t for t, _ in plan}

    async def compensator(ctx: Context) -> int:
        for t, action in plan:
            await ctx.call(t, idempotency_key=f"{action.idempotency_key}:compensate",
                           **action.args)
        return len(plan)

    handle = await sup.delegate(
        Agent("compensate", compensator, tuple(granted.values())),
        task_id=f"compensate:{report.task_id}:{report.epoch}",
    )
    await handle.wait()
    return await handle.report()
