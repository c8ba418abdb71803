"""A recall or terminate this process issues (``Handle.recall``, ``terminate``): signed with
its key, accepted by the journal behind the fence, then drained here, or wherever the
delegation runs, or settled at once if nobody runs it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tether._core.documents import ControlIntent
from tether._core.errors import ControlRefused, TetherError, UserError
from tether._core.model import ControlKind, check_grace
from tether._core.report import Report
from tether._core.signing import Signed
from tether._journal.rows import DelegationRow
from tether._runtime import ports
from tether._runtime.draining import cut_in
from tether._runtime.logs import logger
from tether._runtime.remote import settle_elsewhere, settle_unclaimed

if TYPE_CHECKING:
    from tether._runtime.handle import Handle

log = logger("supervisor")


async def issue_control(sup: ports.Issues, delegation_id: str, kind: ControlKind,
                    grace: float | None, reason: str, seq: int | None = None) -> Report:
    """Sign a recall or terminate, have the journal accept it, and drain the delegation
    (here, or wherever it runs): what ``Handle.recall`` and ``terminate`` do."""
    if kind is ControlKind.RECALL:
        grace = check_grace(grace, sup.policy)
    if not isinstance(reason, str):
        raise UserError("reason must be a string")
    if seq is None and kind is ControlKind.RECALL:
        # The next sequence as this caller sees it, so that of two racing recalls the
        # loser is told the current sequence (I4) rather than that the state moved. A
        # terminate takes the next one in the accepting transaction: it must land even
        # when a recall was accepted a moment before (it cuts the grace window short).
        seq = (await sup.journal.get(delegation_id, urgent=urgent(sup, delegation_id))
               ).control_seq + 1
    offered = seq

    async def accept() -> tuple[ControlIntent, Signed]:
        # Stamped, and its urgency judged, in this task's first step, which queues the
        # accept with no await before it: no call of this process can then be queued
        # between the stamp and the fence with a later intent time, and no state move of
        # its tree queued between the judgment and the fence.
        issued = sup.clock.wall()

        def make(row: DelegationRow) -> Signed:  # runs in the journal's transaction
            return sup.keys.signer.sign(ControlIntent(
                kind=kind, delegation_id=row.id, epoch=row.epoch,
                seq=row.control_seq + 1 if offered is None else offered, grace=grace,
                reason=reason, issued_at=issued))

        return await sup.journal.sign_and_accept(
            delegation_id, make, sup.keys.trusted, sup.owner_id, sup.clock.wall,
            urgent=urgent(sup, delegation_id))

    accepting = asyncio.ensure_future(accept())
    try:
        intent, signed = await asyncio.shield(accepting)
    except asyncio.CancelledError:
        # The caller stopped waiting (a timeout around ``recall``); the journal may accept
        # the intent all the same, and an accepted intent is answered: then here, in a task
        # of the supervisor's, as if its caller had stayed.
        accepting.add_done_callback(lambda done: answer_later(sup, delegation_id, kind, done))
        raise
    except ControlRefused as exc:
        counted(sup, kind, exc)
        raise
    counted(sup, kind, None)
    log.info("%s accepted for %s (sequence %d)", kind.value, delegation_id, intent.seq,
             extra={"delegation": delegation_id, "kind": kind.value, "seq": intent.seq,
                    "reason": reason})
    return await answer(sup, delegation_id, kind, intent, signed)


def counted(sup: ports.Issues, kind: ControlKind, refused: BaseException | None) -> None:
    sup.telemetry.intents.add(1, {"tether.kind": kind.value, "tether.accepted": False,
                                  "error.type": type(refused).__name__} if refused else
                              {"tether.kind": kind.value, "tether.accepted": True})


def answer_later(sup: ports.Issues, delegation_id: str, kind: ControlKind,
                 accepting: asyncio.Future[tuple[ControlIntent, Signed]]) -> None:
    """An intent whose caller stopped waiting before the journal answered: answered in the
    supervisor's own task if the journal accepted it (its refusal has nobody to tell)."""
    if accepting.cancelled():
        return
    failed = accepting.exception()
    if isinstance(failed, ControlRefused):
        counted(sup, kind, failed)  # journaled by the journal (``control_refused``)
        return
    if failed is not None:  # a lost journal: accepted or not, a recovery finds out
        log.warning("%s for %s: its caller stopped waiting, and its accept failed: %s",
                    kind.value, delegation_id, failed,
                    extra={"delegation": delegation_id, "kind": kind.value})
        return
    intent, signed = accepting.result()
    counted(sup, kind, None)
    log.info("%s accepted for %s (sequence %d) after its caller stopped waiting", kind.value,
             delegation_id, intent.seq, extra={"delegation": delegation_id,
                                               "kind": kind.value, "seq": intent.seq})
    if sup.is_open:  # closing: its drain would outlive the journal; a recovery answers it
        sup.spawn(answer(sup, delegation_id, kind, intent, signed))


async def answer(sup: ports.Issues, delegation_id: str, kind: ControlKind,
                 intent: ControlIntent, signed: Signed) -> Report:
    """Drain an accepted intent: here, or wherever the delegation runs. Whatever the
    answer takes goes on if the caller stops waiting for it (each path is shielded)."""
    rt = sup.runtime(delegation_id)
    if rt is not None and rt.draining is not None:
        if kind is ControlKind.TERMINATE:
            return await cut_in(sup, rt, intent.seq)  # a recall's drain is under way
        # A recall answered late (its caller stopped waiting at the accept): a terminate
        # accepted after it drains the delegation meanwhile, and its verdict answers both.
        return await asyncio.shield(rt.draining)
    if rt is None:
        return await asyncio.shield(sup.spawn(untracked(sup, delegation_id, kind, signed),
                                              told=True))
    return await asyncio.shield(sup.start_drain(rt, signed, sup.clock.now()))


async def untracked(sup: ports.Issues, delegation_id: str, kind: ControlKind,
                    signed: Signed) -> Report:
    """An accepted intent for a delegation this process does not run now."""
    never = await settle_unclaimed(sup, delegation_id, kind)  # queued, unclaimed
    if never is not None:
        return never
    if (await sup.journal.get(delegation_id)).owner_id == sup.owner_id:
        # Ours, but no longer tracked (a recall's grace ended with calls left
        # running): settle it here, cutting those calls if this is a terminate.
        return await sup.settle_here(delegation_id, kind)
    return await settle_elsewhere(sup, delegation_id, signed)


def urgent(sup: ports.Issues, delegation_id: str) -> bool:
    """Whether a control intent for ``delegation_id`` skips the writes queued before it
    (the fence waits for no backlog): not past a state move of its tree queued here (a
    child's end its code reached; an ancestor's drain settling it), which then stands as
    it ended, not stopped again."""
    rt = sup.runtime(delegation_id)
    return not sup.journal.moving([delegation_id] if rt is None else
                                  [n.id for n in rt.walk()])


async def stop_many(sup: ports.Issues, delegations: Iterable[str | Handle],
                    handle_for: Callable[[str], Handle], kind: ControlKind,
                    grace: float | None, reason: str) -> dict[str, Report | TetherError]:
    """Recall or terminate each delegation (an id, or a handle) at once, as its handle
    would: their reads and fences share the journal's batches (a storm), and each answer is
    its own, a report or the error that stopped it (one already gone stops none of the
    others)."""
    from tether._runtime.handle import Handle

    if kind is ControlKind.RECALL:
        grace = check_grace(grace, sup.policy)
    if not isinstance(reason, str):
        raise UserError("reason must be a string")
    if isinstance(delegations, str | Handle) or not isinstance(delegations, Iterable):
        raise UserError("give a list of delegation ids or handles to stop")
    unique: dict[str, Handle] = {}
    for d in delegations:
        if isinstance(d, Handle):
            unique.setdefault(d.id, d)
        elif isinstance(d, str) and d:
            unique.setdefault(d, handle_for(d))
        else:
            raise UserError(f"a delegation to stop is an id or a Handle, not {d!r}")

    async def one(h: Handle) -> Report:
        if kind is ControlKind.RECALL:
            assert grace is not None
            return await h.recall(grace, reason)
        return await h.terminate(reason)

    answers = await asyncio.gather(*(one(h) for h in unique.values()),
                                   return_exceptions=True)
    out: dict[str, Report | TetherError] = {}
    for d, answer in zip(unique, answers, strict=True):
        if isinstance(answer, Report | TetherError):
            out[d] = answer
        else:  # a defect or a cancellation is not an answer: it stops the caller
            raise answer
    return out
