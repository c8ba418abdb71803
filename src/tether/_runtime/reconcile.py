"""Reconciliation: ask the outside world what became of actions whose outcome is in doubt,
settle each delegation's final state, and build the reports."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tether._core import values
from tether._core.model import DEFAULT_CLOCK_TOLERANCE, ActionState, DelegationState, ProbeOutcome
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE, final_at, judge_probe
from tether._core.report import ActionRecord, Report
from tether._core.verdict import Verdict
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow
from tether._runtime.clock import Clock
from tether._runtime.declared import HOW
from tether._runtime.tools import ProbeResult, Tool


async def probe_one(action: ActionRecord, tool: Tool | None, clock: Clock,
                    limit: float) -> ProbeResult:
    """Never guesses: no probe, a probe error or a timeout is UNKNOWN, with the reason."""
    if tool is None:
        return ProbeResult(ProbeOutcome.UNKNOWN,
                           {"reason": f"no tool named {action.tool!r} is declared to this "
                                      f"process: {HOW}"})
    if tool.probe is None:
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": f"tool {tool.name} has no probe"})
    try:
        call = asyncio.ensure_future(
            tool.probe(**action.args, idempotency_key=action.idempotency_key))
    except Exception as exc:  # e.g. a probe whose signature does not fit the tool's arguments
        return ProbeResult(ProbeOutcome.UNKNOWN, {"reason": f"probe could not be called: {exc!r}"})
    # However it ends (a probe cut at its timeout may raise its own error on the way out),
    # its end is looked at: never "Task exception was never retrieved" on the user's stderr.
    call.add_done_callback(_looked_at)
    timer = asyncio.ensure_future(clock.sleep(limit))
    try:
        await asyncio.wait({call, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        timed_out = not call.done()
        if timed_out:  # or this prober was cancelled: the probe never runs on unwatched
            call.cancel()
    if timed_out:
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
    evidence = answer.evidence
    if not isinstance(evidence, dict):
        evidence = {"evidence": evidence}
    kept = values.storable(evidence)
    if kept is not evidence:  # the answer stands; what it was based on is kept as text
        evidence = {"reason": "the probe's evidence cannot be stored", **kept}
    result = values.storable(answer.result)
    if evidence is answer.evidence and result is answer.result:
        return answer
    return dataclasses.replace(answer, evidence=evidence, result=result)


def _looked_at(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def deadline_of(action: ActionRecord, tools: Mapping[str, Tool]) -> float:
    """When the call can no longer apply: journaled with its intent, or for a row older than
    schema v3, its start plus the known tool's own deadline (else the default)."""
    if action.deadline_at is not None:
        return action.deadline_at
    tool = tools.get(action.tool)
    return action.started_at + (tool.dispatch_deadline if tool else DEFAULT_DISPATCH_DEADLINE)


async def probe_all(journal: Journal, actions: list[ActionRecord],
                    tools: Mapping[str, Tool], clock: Clock, limit: float,
                    on_answer: Callable[[str], None] | None = None, *,
                    tolerance: float = DEFAULT_CLOCK_TOLERANCE) -> None:
    """Probe each action and record the answer. A "not applied" before the call's dispatch
    deadline plus ``tolerance`` (the most this clock and the executor's, which wrote the
    deadline, may differ) keeps it IN_DOUBT with the probe's evidence: it may still land."""

    async def one(action: ActionRecord) -> None:
        tool = tools.get(action.tool)
        if action.state is ActionState.UNKNOWN and (tool is None or tool.probe is None):
            return  # nothing can be asked here: what the journal holds (and why) stands
        # Judged at the time the probe was sent: an answer that comes back after the deadline
        # says nothing of a request that landed between the look and the deadline.
        sent = clock.wall()
        answer = await probe_one(action, tool, clock, limit)
        now = clock.wall()
        deadline = deadline_of(action, tools)
        state = judge_probe(answer.outcome, voided=answer.voided, deadline_at=deadline,
                            now=sent, tolerance=tolerance)
        evidence = {**answer.evidence, "probe": answer.outcome.value, "asked_at": sent,
                    "probed_at": now}
        if state is ActionState.IN_DOUBT:
            left = max(0.0, final_at(deadline, tolerance) - now)
            evidence["not_final"] = (f"not applied yet: the call may still apply until its "
                                     f"dispatch deadline, plus {tolerance:g} s of clock "
                                     f"tolerance ({left:.3g} s from now)")
        await journal.settle_action(action.id, state, now, evidence, answer.result)
        if on_answer is not None:  # telemetry: probes and unknowns counted
            on_answer(state.value)

    await asyncio.gather(*(one(a) for a in actions))


async def settle_subtree(journal: Journal, root_id: str, clock: Clock,
                         fallback: DelegationState, verdict: Verdict | None = None,
                         reason: str = "", seq: int | None = None) -> None:
    """Move every node (deepest first) to its settled state (``_core.outcome.settle``). A node
    with a call that may still apply keeps its state until that call is settled. Judged in the
    journal, under each row's lock, on the facts as they are when it moves: another process's
    probe or receipt may land between any read here and a write. (``fallback`` is where a
    running node would end; ``settle`` never ends a RUNNING node, so it decides nothing.)
    ``verdict``: the drain's or recovery's, journaled in the same transaction; a drain's
    names the newest intent it answers (``seq``, read by ``ops.drained``)."""
    del fallback
    await journal.settle_tree(root_id, clock.wall(), None if verdict is None else {
        "verdict": verdict.value, "reason": reason} | ({} if seq is None else {"seq": seq}))


async def build_report(journal: Journal, root_id: str) -> Report:
    rows, acts, last = await journal.report_rows(root_id)
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
