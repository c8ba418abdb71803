"""Reconciliation: ask the outside world what became of actions whose outcome is in doubt,
settle each delegation's final state, and build the reports."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tether._core.model import ActionState, DelegationState, ProbeOutcome
from tether._core.outcome import ActionFacts, judge_probe, settle
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
    """Probe each action and record the answer. A "not applied" before the call's dispatch
    deadline keeps it IN_DOUBT with the probe's evidence: it may still land."""

    async def one(action: ActionRecord) -> None:
        answer = await probe_one(action, tools.get(action.tool), clock, limit)
        now = clock.wall()
        deadline = action.deadline_at if action.deadline_at is not None else now
        state = judge_probe(answer.outcome, voided=answer.voided, deadline_at=deadline,
                            now=now)
        evidence = {**answer.evidence, "probe": answer.outcome.value, "probed_at": now}
        if state is ActionState.IN_DOUBT:
            evidence["not_final"] = (f"not applied yet: the call may still apply until its "
                                     f"dispatch deadline ({deadline - now:.3g} s from now)")
        await journal.settle_action(action.id, state, now, evidence, answer.result)

    await asyncio.gather(*(one(a) for a in actions))


async def settle_subtree(journal: Journal, root_id: str, clock: Clock,
                         fallback: DelegationState) -> None:
    """Move every node (deepest first) to its settled state (``_core.outcome.settle``). A node
    with a call that may still apply keeps its state until that call is settled."""
    rows = await journal.subtree(root_id)
    acts = await journal.actions([r.id for r in rows])
    for row in reversed(rows):
        mine = [ActionFacts(a.state, bool(a.evidence)) for a in acts
                if a.delegation_id == row.id]
        new = settle(row.state, mine, fallback)
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
