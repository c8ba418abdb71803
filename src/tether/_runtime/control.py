"""A person's recall or terminate from outside the owning process (``tether recall``, the
console): sign the intent with the deployment's key and the operator's name, have the
journal accept it (the fence closes at once), and, if asked, wait for the owner's report."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether._core import drain
from tether._core.documents import ControlIntent
from tether._core.errors import (
    AlreadyFinished,
    InvalidTransition,
    StaleSequence,
    TetherError,
    UserError,
)
from tether._core.model import ControlKind, Policy
from tether._core.signing import Signed
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow
from tether._journal.triage import DelegationQuery
from tether._runtime.clock import SystemClock
from tether._runtime.keys import KeyRing
from tether._runtime.reconcile import build_report
from tether._runtime.remote import owner_alive, settle_unclaimed
from tether._runtime.resolve import operator_of


@dataclass(frozen=True)
class ControlRequest:
    """One person's request. ``via`` says through what it came ("cli", "console"): the
    journal records the issuer as ``via:name``, never a bare name, so that no name can pass
    for a supervisor's own owner id (whose intents adoption leaves to it)."""

    journal_url: str
    keys: Path | None
    delegation_id: str
    kind: ControlKind
    grace: float | None
    reason: str
    by: str | None
    via: str = "cli"
    wait: bool = False


WAITERS = 64  # owners' reports read at once by a request for many delegations


async def send_control(req: ControlRequest) -> dict[str, Any]:
    """The intent accepted (``accepted``, ``seq``), and with ``wait`` the owner's report,
    or ``waiting`` saying why there is none yet."""
    by = operator_of(req.by)
    async with Journal(req.journal_url, create=False) as j:
        ring = await asyncio.to_thread(KeyRing.load, req.keys or j.keys_dir)
        j.seal_with(ring.signer, ring.trusted)  # this process's writes are sealed with its key
        answer = await _accept(j, ring, req, req.delegation_id, by)
        if req.wait:
            await _wait(j, answer["delegation"], req.kind, req.grace, answer)
        return answer


async def send_controls(req: ControlRequest, query: DelegationQuery,
                        waiters: int = WAITERS) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The request for every live delegation ``query`` selects (its ``delegation_id`` is not
    used): each intent signed and accepted at once (the journal's writer commits them in
    batches, so every fence closes within a few commits), then, with ``wait``, each owner's
    report. A delegation under another one selected is left to that one's recall, which
    fences its whole subtree: the second mapping names it and its selected ancestor. One that
    ended meanwhile is answered ``accepted: False`` with ``ended``, never an error."""
    by = operator_of(req.by)
    async with Journal(req.journal_url, create=False) as j:
        ring = await asyncio.to_thread(KeyRing.load, req.keys or j.keys_dir)
        j.seal_with(ring.signer, ring.trusted)
        chosen = await j.page(query)
        parents = {r.id: r.parent_id for r in await j.delegations(live_only=True)}
        selected = {r.id for r in chosen if not r.state.terminal}
        covered: dict[str, str] = {}
        for row in chosen:
            up = row.parent_id
            while up is not None and row.id not in covered:
                if up in selected:
                    covered[row.id] = up
                up = parents.get(up)
        targets = [r.id for r in chosen if r.id in selected and r.id not in covered]

        async def one(delegation_id: str) -> dict[str, Any]:
            told = {"delegation": delegation_id, "kind": req.kind.value, "accepted": False}
            try:
                return await _accept(j, ring, req, delegation_id, by)
            except AlreadyFinished as exc:
                return {**told, "ended": str(exc)}
            except (InvalidTransition, StaleSequence) as exc:
                # Another intent came first (a recall still in its grace window, a request
                # racing this one): that one stops it, and its report is waited for.
                return {**told, "refused": str(exc)}
            except TetherError as exc:
                return {**told, "error": str(exc)}

        answers = list(await asyncio.gather(*(one(d) for d in targets)))
        if answers and all("error" in a for a in answers):
            # Nothing was accepted (a key the journal does not trust, say): the first
            # refusal is the command's, as for one delegation.
            raise UserError(answers[0]["error"])
        if req.wait:
            # The owners drain in parallel whatever this process does; a bounded number of
            # watchers reads their reports (each polls the journal), all by one deadline.
            gate = asyncio.Semaphore(waiters)
            deadline = asyncio.get_running_loop().time() + _budget(req.grace)

            async def waited(answer: dict[str, Any]) -> None:
                async with gate:
                    await _wait(j, answer["delegation"], req.kind, req.grace, answer,
                                deadline=deadline, settle=answer["accepted"])

            await asyncio.gather(*(waited(a) for a in answers
                                   if a["accepted"] or "refused" in a))
        return answers, covered


async def _accept(j: Journal, ring: KeyRing, req: ControlRequest, delegation_id: str,
                  by: str) -> dict[str, Any]:
    """Sign and have the journal accept the intent for ``delegation_id`` (or, between its
    attempts, for its latest attempt); ``AlreadyFinished`` when it ended."""
    issuer = f"{req.via}:{by}"
    # A recall offers the next sequence as read now, so that the loser of two racing recalls
    # is told the current sequence (I4); a terminate takes the next one whatever came before
    # it (it cuts a recall's grace window short).
    # Urgent: this process (a shell's, the console's) queues no state move of its own.
    offered = None
    if req.kind is ControlKind.RECALL:
        offered = (await j.get(delegation_id, urgent=True)).control_seq + 1
    now = time.time()

    task: list[str] = []  # the task of the delegation the intent is signed for

    def make(row: DelegationRow) -> Signed:
        task[:] = [row.task_id]
        seq = row.control_seq + 1 if offered is None else offered
        return ring.signer.sign(ControlIntent(req.kind, row.id, row.epoch, seq, req.grace,
                                              req.reason, now, issued_by=by))

    try:
        intent, _ = await j.sign_and_accept(delegation_id, make, ring.trusted, issuer,
                                            time.time, urgent=True)
    except AlreadyFinished:
        # Between attempts nothing runs, yet the request must stop a re-dispatch, which
        # re-checks the task's cancel generation before forking; one that forked already is
        # stopped in its own right.
        row = await j.get(delegation_id)
        await j.bump_cancel(row.task_id, now, f"{req.kind.value.lower()}: {req.reason}")
        latest = await j.latest_attempt(delegation_id)
        if latest.id == delegation_id or latest.state.terminal:
            raise
        delegation_id = latest.id
        intent, _ = await j.sign_and_accept(delegation_id, make, ring.trusted, issuer,
                                            time.time, urgent=True)
    return {"delegation": delegation_id, "task": task[0], "seq": intent.seq,
            "kind": req.kind.value, "accepted": True, "issuer": issuer}


def _budget(grace: float | None) -> float:
    """How long a shell waits for the owner's report: a recall's budget of an issuer in a
    supervisor (``drain.report_budget``), and a few seconds more, since it learns of the
    report by polling. Running out, it reconciles nothing (it says the owner has not settled
    it yet), so a terminate need not wait for a recall's drain's probes as well."""
    return drain.report_budget(ControlKind.RECALL, grace, Policy()) + 5.0


async def _wait(j: Journal, delegation_id: str, kind: ControlKind, grace: float | None,
                answer: dict[str, Any], *, deadline: float | None = None,
                settle: bool = True) -> None:
    """The owner's report into ``answer``, or ``waiting`` with why there is none. ``settle``:
    this process's intent was accepted, so it settles a queued task nobody claimed."""
    policy = Policy()
    budget = _budget(grace)
    loop = asyncio.get_running_loop()
    if deadline is None:
        deadline = loop.time() + budget
    watcher = _Watcher(j, SystemClock(), f"cli:{os.getpid()}", policy)
    # Queued and no worker claimed it (none can now: it is fenced): nothing ran, and no owner
    # drains it; the issuer takes it off the queue and settles it, as a supervisor does.
    never = await settle_unclaimed(watcher, delegation_id, kind) if settle else None
    if never is not None:
        answer["report"] = never.to_json()
        return
    next_look = loop.time() + 0.5
    settled_at: float | None = None
    while loop.time() < deadline:
        current = await j.get(delegation_id)
        # Drained by its owner: settled, or with calls left in doubt (still in flight); the
        # report says which. Settled without a verdict: as ``remote.settle_elsewhere``.
        if current.state.terminal and settled_at is None:
            settled_at = loop.time()
        if await j.drained(delegation_id) or (
                settled_at is not None and drain.verdict_overdue(settled_at, loop.time(), policy)):
            answer["report"] = (await build_report(j, delegation_id)).to_json()
            return
        if settled_at is None and loop.time() >= next_look:  # a dead owner settles nothing
            next_look = loop.time() + 0.5
            if not await owner_alive(watcher, current.owner_id):
                answer["waiting"] = (
                    f"the owner of {delegation_id} ({current.owner_id}) is gone: nothing "
                    f"settled it; run 'tether reconcile {delegation_id}'")
                return
        await asyncio.sleep(0.05)
    answer["waiting"] = (
        f"the owner of {delegation_id} has not settled it within {budget:g}s; if its "
        f"process is gone, run 'tether reconcile {delegation_id}'")


@dataclass(frozen=True)
class _Watcher:
    """What judging another owner's liveness needs (``remote.owner_alive``)."""

    journal: Journal
    clock: SystemClock
    owner_id: str
    policy: Policy
