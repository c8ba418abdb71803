"""What ``tether verify`` checks (its command is ``_cli.verify``): every signed record of the
journal against the deployment's key registry, each fence's explaining intent, and every
delegation's chain. A module of its own, below the command line: an operator's check that the
simulator also runs (``_sim.operator``), with no terminal in it."""

from __future__ import annotations

import contextlib
from typing import Any

from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt, WorkOrder
from tether._core.errors import ControlRefused, NotFound, UnknownKey
from tether._core.model import ControlKind
from tether._core.resolution import Resolution, decode_resolution
from tether._core.signing import TrustedKeys
from tether._core.trust import Registry, bound, check_work
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow
from tether._runtime.keys import KeyRing


async def _check_delegation(j: Journal, reg: Registry, d: DelegationRow,
                            problems: list[dict[str, Any]]) -> int:
    checked = 0

    def refused(record: str, exc: ControlRefused) -> None:
        problems.append({"delegation": d.id, "record": record, "problem": str(exc)})

    rows = await j.controls(d.id)
    if d.control_seq and d.control_seq not in {c.seq for c in rows}:
        problems.append({"delegation": d.id, "record": f"sequence {d.control_seq}",
                         "problem": f"the delegation's accepted sequence is {d.control_seq} "
                                    "but no controls row holds it (deleted, or the sequence "
                                    "set by hand)"})
    for c in rows:
        checked += 1
        try:
            bound(reg.verify(c.signed, ControlIntent), d.id, c.seq, c.kind, d.epoch)
        except ControlRefused as exc:
            refused(f"controls row {c.id} (sequence {c.seq})", exc)
    for doc in await j.documents(d.id):
        checked += 1
        if doc.type == Resolution.TYPE:  # a person's decision: a document of its own
            try:
                if doc.signed.key_id not in reg.keys:
                    raise UnknownKey(reg.explain(doc.signed.key_id))
                reg.keys.verify_bytes(doc.signed)
                res = decode_resolution(doc.signed.body)
                if res.delegation_id != d.id:
                    raise ControlRefused(f"signed for delegation {res.delegation_id}: a "
                                         "copied or replayed resolution")
            except ControlRefused as exc:
                refused(f"resolution {doc.seq}", exc)
            continue
        try:
            body: Acknowledgement | NoEffectsReceipt = (
                reg.verify(doc.signed, Acknowledgement) if doc.type == Acknowledgement.TYPE
                else reg.verify(doc.signed, NoEffectsReceipt))
            if (body.delegation_id, body.seq) != (d.id, doc.seq):
                raise ControlRefused(f"signed for delegation {body.delegation_id} sequence "
                                     f"{body.seq}: a copied or replayed {doc.type}")
        except ControlRefused as exc:
            refused(f"{doc.type} for sequence {doc.seq}", exc)
    if await j.queue_entry(d.id) is not None:
        checked += 1
        work = await j.work_of(d.id)
        try:
            if work is None:
                raise ControlRefused("queued without a signed work order")
            order = reg.verify(work, WorkOrder)
            check_work(order, d.id, d.task_id, d.parent_id, d.agent, d.args, d.surface)
        except ControlRefused as exc:
            refused("queued work", exc)
    return checked


# The states only an accepted intent leads to (its move, and its drain's end).
_CONTROLLED = frozenset({k.target for k in ControlKind} | {k.settled for k in ControlKind})


async def _unexplained_fence(j: Journal, d: DelegationRow) -> bool:
    """Only an accepted intent (on the row or an ancestor, I10) fences a live delegation or
    moves it to a recall's or terminate's states; a row that says so without one was edited."""
    if d.state not in _CONTROLLED and not (d.fenced and not d.state.terminal):
        return False
    row: DelegationRow | None = d
    seen: set[str] = set()
    while row is not None and row.id not in seen:  # a parent_id edited into a cycle ends
        seen.add(row.id)
        if row.control_seq and await j.controls(row.id):
            return False
        try:
            row = await j.get(row.parent_id) if row.parent_id else None
        except NotFound:  # its parent's row is gone: nothing explains the fence
            return True
    return True


async def verify_journal(j: Journal, ring: KeyRing | None,
                         delegation_id: str | None) -> dict[str, Any]:
    pins = ring.trusted if ring is not None else KeyRing.ephemeral().trusted
    reg = await j.registry(pins)
    problems: list[dict[str, Any]] = [
        {"delegation": None, "record": "key registry", "problem": p} for p in reg.problems]
    if reg.root is None or reg.root not in reg.pinned:
        problems.append({"delegation": None, "record": "key registry",
                         "problem": reg.explain("(any)")})
    rows = await (j.subtree(delegation_id) if delegation_id else j.delegations())
    found, checked, chained, unchained = await _delegations(j, reg, pins, rows)
    # The journal is read a statement at a time while other processes write: a prune, or a
    # key trusted and its holder's intent, committed between two reads, read as a problem of
    # a moment that never was. A delegation with problems is read and judged again; what
    # still fails is named, and one gone since (pruned) is not.
    suspects = list(dict.fromkeys(p["delegation"] for p in found))
    if suspects:
        found = [p for p in found if p["delegation"] not in suspects]
        again = []
        for did in suspects:
            with contextlib.suppress(NotFound):
                again.append(await j.get(did))
        found += (await _delegations(j, await j.registry(pins), pins, again))[0]
    problems += found
    for task, missing in (await j.epoch_gaps([d.id for d in rows])).items():
        problems.extend({"delegation": f"task {task}", "record": f"epoch {n}",
                         "problem": "the task's later epochs are here but no delegation at "
                                    "this epoch (deleted as a whole by hand; a prune removes "
                                    "a task's epochs together)"} for n in missing)
    return {"root": reg.root, "delegations": len(rows), "records_checked": checked,
            "chains_checked": chained, "unchained": unchained,
            "problems": problems, "ok": not problems}


async def _delegations(j: Journal, reg: Registry, pins: TrustedKeys, rows: list[DelegationRow]
                       ) -> tuple[list[dict[str, Any]], int, int, list[dict[str, Any]]]:
    """The problems of these delegations' signed records, fences and chains; the records
    and chains checked, and the delegations with records older than the chain."""
    problems: list[dict[str, Any]] = []
    checked = 0
    for d in rows:
        checked += await _check_delegation(j, reg, d, problems)
        if await _unexplained_fence(j, d):
            problems.append({"delegation": d.id, "record": "fence",
                             "problem": f"{d.state.value}{' and fenced' if d.fenced else ''} "
                                        "with no accepted control intent on it or an "
                                        "ancestor (set by hand?)"})
    unchained: list[dict[str, Any]] = []
    chained = 0
    for v in await j.chain_verdicts([d.id for d in rows], pins):
        problems.extend({"delegation": v.delegation_id, "record": p.record,
                         "problem": p.problem} for p in v.problems)
        if v.unchained:
            unchained.append({"delegation": v.delegation_id, "records": len(v.unchained)})
        chained += 1
    return problems, checked, chained, unchained


__all__ = ["verify_journal"]
