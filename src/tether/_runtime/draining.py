"""The drain driver of a recall or terminate: acknowledge, run the grace window, stop what is
left, account for every action and record the verdict. Every decision is made by the drain
protocol (``_core.drain``); this module only carries it out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tether._core import drain as protocol
from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt, decode
from tether._core.errors import Recalled, Terminated
from tether._core.model import ControlKind, DelegationState
from tether._core.report import Report
from tether._core.signing import Signed
from tether._core.verdict import RecallInput, Verdict, evaluate_recall
from tether._runtime.accounting import Accounting
from tether._runtime.clock import first_of
from tether._runtime.logs import logger
from tether._runtime.state import ChildRuntime

if TYPE_CHECKING:
    from tether._runtime import ports

log = logger("supervisor")


async def drain(sup: ports.Drains, accounts: Accounting, rt: ChildRuntime, signed: Signed,
                accepted_at: float) -> Report:
    """Drive the drain protocol for ``rt``'s subtree; the report once it is accounted for."""
    # Verified already: by the journal's acceptance (our own intent) or by the admission of
    # another process's row (``Adoption.admit``). No await before the stops are set.
    intent = decode(signed.body, canonical_known=True)  # its form was proven by that check
    assert isinstance(intent, ControlIntent)
    stop, cut_now = protocol.start(intent.kind)
    answering = rt.answering
    answering.seq = max(answering.seq, intent.seq)
    for node in rt.walk():
        node.stop = node.stop or (Recalled if stop is protocol.Stop.RECALLED
                                  else Terminated)(node.id, intent.reason)
    verdict, reason = Verdict.TERMINATE, "terminate requested"
    if not cut_now:
        verdict, reason = await grace_window(sup, rt, signed, intent, accepted_at)
    plan = protocol.ending(verdict, killed=cut_now or any(
        isinstance(n.stop, Terminated) for n in rt.walk()))
    answering.planned = True  # no await since the grace window's end: a later terminate waits
    if plan.terminate:
        rt.cut(actions=plan.cut_calls)
    children = [n.task for n in rt.walk() if n.task is not None and not n.task.done()]
    for task in children:  # nothing can start any more; stop waiting for model work
        task.cancel()
    if children:
        await first_of(sup.clock, sup.policy.ack_timeout,
                       asyncio.gather(*children, return_exceptions=True))
    # The tree's settle, queued: an intent for one of its nodes waits behind it (``urgent``).
    with sup.journal.moves([n.id for n in rt.walk()]):
        report = await accounts.conclude(rt.id, plan.fallback, in_doubt=plan.mark_in_doubt,
                                         verdict=verdict, reason=reason, seq=answering.seq)
    if verdict is Verdict.GRACE_EXPIRED:
        sup.telemetry.grace_expiries.add(1, {"gen_ai.agent.name": rt.agent.name})
    log_verdict(report, verdict.value, reason)
    return report


async def cut_in(sup: ports.Issues | ports.Adopts, rt: ChildRuntime, seq: int) -> Report:
    """A terminate (sequence ``seq``) of a delegation whose drain is under way. It cuts the
    subtree now either way. Before the drain has chosen how it ends, the drain answers it (a
    recall's grace window cut short); after, that ending stands, and the terminate is answered
    once the drain is over, as for a delegation no longer tracked (``settle_here``): a verdict
    of its own, never the recall's taken for it."""
    draining = rt.draining
    assert draining is not None
    answering = rt.answering
    if seq <= answering.seq:  # adopted again (PostgreSQL lists it at every poll): answered
        return await asyncio.shield(draining)
    rt.cut()
    if not answering.planned:
        answering.seq = seq
        return await asyncio.shield(draining)
    later = answering.later
    if later is None or later[0] < seq:
        # In a task of the supervisor's, not the caller's: a caller that stops waiting (a
        # timeout around ``terminate``) leaves the accepted intent answered all the same. Its
        # failure is the caller's (one adopted from elsewhere: its spawned ``cut_in``'s).
        later = answering.later = (seq, sup.spawn(_after_drain(sup, rt.id, draining, seq),
                                                 told=True))
    return await asyncio.shield(later[1])


async def _after_drain(sup: ports.Issues | ports.Adopts, delegation_id: str,
                       draining: asyncio.Future[Report], seq: int) -> Report:
    await asyncio.gather(asyncio.shield(draining), return_exceptions=True)
    return await sup.settle_here(delegation_id, ControlKind.TERMINATE, seq=seq,
                                 reason="terminate after a recall's grace window ended")


def log_verdict(report: Report, verdict: str, reason: str) -> None:
    """A drain's end, for the operator: a warning when a person must look."""
    attention = report.outcome is DelegationState.NEEDS_ATTENTION
    log.log(logging.WARNING if attention else logging.INFO,
            "delegation %s settled %s (%s: %s)", report.delegation_id, report.outcome.value,
            verdict, reason, extra={"delegation": report.delegation_id,
                                    "outcome": report.outcome.value, "verdict": verdict,
                                    "unknown": [a.id for a in report.unknown]})


async def grace_window(sup: ports.Drains, rt: ChildRuntime, signed: Signed,
                       intent: ControlIntent, accepted_at: float) -> tuple[Verdict, str]:
    """Acknowledge with the in-flight manifest, then wait while actions finish, at most
    until the grace window ends or a terminate cuts it short."""
    nodes = rt.walk()
    guests = any(n.guests for n in nodes)
    signer, trusted = sup.keys.signer, await sup.current_trust()
    inflight = [a for n in nodes for a in n.inflight]
    # With guests, only the journal knows which calls other processes have in flight here,
    # and whether they started a side effect (the fence, accepted before this drain, stops
    # any new one): the manifest and the receipt sign what it says too.
    seen = await sup.journal.facts(rt.id) if guests else None
    if seen is not None:
        inflight += sorted(seen.pending.difference(inflight))
    ack = signer.sign(Acknowledgement(rt.id, intent.seq, tuple(inflight),
                                      acked_at=sup.clock.wall()))
    receipt = None
    if sum(n.effects_started for n in nodes) == 0 and not (
            seen is not None and seen.side_effecting):
        # Nothing started, and the fence (accepted before this drain) lets nothing start.
        receipt = signer.sign(NoEffectsReceipt(rt.id, intent.seq, sup.clock.wall()))
    await sup.journal.record_ack(ack, trusted, sup.clock.wall(), receipt)
    while True:
        # Counted before the journal is read: a call that ends after this count posted its
        # receipt before ending, and the read queues behind it on the writer, in its batch or
        # a later one, and answers once that batch committed (no flush needed first).
        running = rt.inflight_tasks()
        facts = await sup.journal.facts(rt.id)
        decision = evaluate_recall(RecallInput(
            signed, facts, accepted_at, sup.clock.now(), sup.policy, trusted, ack, receipt))
        step = protocol.grace_step(decision, live=len(running), guests=guests, terminated=any(
            isinstance(n.stop, Terminated) for n in nodes))
        if step.wait is None:
            return step.verdict, step.reason
        waits = [asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)] if running else []
        # A guest's receipt reaches this process through the journal alone: looked for at
        # each poll.
        wait = min(step.wait, sup.control_poll) if guests else step.wait
        await first_of(sup.clock, wait, *waits)
