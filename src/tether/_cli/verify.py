"""``tether verify [ID] [--json]``: check every signed record of the journal.

It checks what is signed today: the key registry (rooted in the pinned root), every control
intent (signer trusted, body naming its row), every acknowledgement and receipt (signer trusted,
body naming its delegation and sequence), every person's decision (signer trusted, body naming
its delegation) and every queued delegation's work order (signer trusted, body matching the
row); and that each fence or accepted sequence has the accepted intent that explains it.
It also reads every delegation's chain (``_core.chain``): an action, a control row, a
document, an event or the delegation's own row altered, inserted or deleted by hand is named,
and so is a chain whose entries or sealed head were edited. Records older than the chain are
listed as unchained. A genuine earlier state restored as a whole (rows, chain and head rolled
back together) is named when this configuration remembers a later head of that delegation
(``heads.jsonl`` in its key directory; docs/security.md, "Rollback"), and the heads that verify
are remembered in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt, WorkOrder
from tether._core.errors import ControlRefused, NotFound, UnknownKey
from tether._core.model import DelegationState
from tether._core.resolution import Resolution, decode_resolution
from tether._core.signing import TrustedKeys
from tether._core.trust import Registry, bound, check_work
from tether._journal.journal import DEFAULT_URL, Journal
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


_CONTROLLED = frozenset({DelegationState.RECALLING, DelegationState.TERMINATING,
                         DelegationState.RECALLED, DelegationState.TERMINATED})


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


def register(app: typer.Typer, out: Console,
             cli_errors: Callable[[Callable[..., None]], Callable[..., None]],
             emit_json: Callable[[Any], None]) -> None:
    @app.command("verify")
    @cli_errors
    def verify(delegation_id: Annotated[str | None, typer.Argument()] = None,
               journal: Annotated[str, typer.Option("--journal", "-j", envvar="TETHER_JOURNAL",
                                                    help="Journal URL.")] = DEFAULT_URL,
               keys: Annotated[Path | None, typer.Option("--keys", help="Key directory.")]
               = None,
               as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """Check every signed record (registry, intents, acknowledgements, queued work) and
        every delegation's chain (actions, results, events); exit 1 naming each record that
        fails."""

        async def go() -> dict[str, Any]:
            async with Journal(journal, create=False) as j:
                directory = keys if keys is not None else j.keys_dir
                ring = (await asyncio.to_thread(KeyRing.load, directory)
                        if (directory / "signing.json").exists() else None)
                return await verify_journal(j, ring, delegation_id)

        data = asyncio.run(go())
        if as_json:
            emit_json(data)
        else:
            out.print(f"{data['records_checked']} signed records and {data['chains_checked']} "
                      f"chains in {data['delegations']} delegations checked; "
                      f"{len(data['problems'])} problem(s)")
            for u in data["unchained"]:
                out.print(f"{u['delegation']}: {u['records']} record(s) written before the "
                          "journal was chained (unchained, not checked)", highlight=False)
            for p in data["problems"]:
                where = f"{p['delegation']}: " if p["delegation"] else ""
                out.print(f"[red]{where}{p['record']}[/red]: {p['problem']}", highlight=False)
        raise typer.Exit(0 if data["ok"] else 1)
