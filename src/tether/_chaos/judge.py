"""Judging a chaos trial by the outside world's own record (the ledger) against the journal
as recovery left it; the violation classes are named in ``harness``'s docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tether
from tether._chaos.ledger import Ledger
from tether._chaos.plan import Plan
from tether._core.report import ActionRecord
from tether._journal.rows import ControlRow, DelegationRow, EventRow

__all__ = ["CLASSES", "Snapshot", "Violation", "judge", "snapshot"]

CLASSES = ("lost", "duplicate", "ghost", "unreconciled", "dishonest", "stuck", "tampered")


@dataclass(frozen=True)
class Violation:
    trial_seed: int
    fault: str
    kind: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"trial_seed": self.trial_seed, "fault": self.fault, "class": self.kind,
                "detail": self.detail}


@dataclass
class Snapshot:
    rows: list[DelegationRow]
    actions: list[ActionRecord]
    controls: list[ControlRow]
    events: list[EventRow]
    chains: list[str]  # what each delegation's chain check found wrong (``tether verify``'s)


async def snapshot(url: str) -> Snapshot:
    async with tether.Journal(url, create=False) as j:
        rows = await j.delegations()
        ids = [r.id for r in rows]
        actions = await j.actions(ids)
        controls = [c for r in rows for c in await j.controls(r.id)]
        events = await j.events(ids)
        # Read as `tether verify` reads it, under the deployment's keys and the heads its
        # configuration remembers: nobody tampers in a trial.
        try:
            verdicts = await j.chain_verdicts(ids, tether.KeyRing.load(j.keys_dir).trusted)
            chains = [f"{v.delegation_id}: {p.record}: {p.problem}"
                      for v in verdicts for p in v.problems]
        except tether.TetherError as exc:
            chains = [f"the chains could not be read: {exc}"]
    return Snapshot(rows, actions, controls, events, chains)


def judge(snap: Snapshot, ledger: Ledger, plan: Plan, outcome: str) -> list[Violation]:
    applied = ledger.keys()
    first_applied: dict[str, float] = {}
    for key, at, _ in ledger.applications():
        first_applied.setdefault(key, at)
    found: list[Violation] = []

    def flag(kind: str, detail: str) -> None:
        found.append(Violation(plan.seed, plan.fault, kind, detail))

    if outcome == "hung":
        flag("stuck", "the orchestrator did not finish")
    for problem in snap.chains:
        flag("tampered", problem)
    notes = ledger.notes()
    for _, _, what, key, detail in notes:
        if what == "helper_hung":
            flag("stuck", f"helper {key} (pid {detail.get('pid')}) did not finish in "
                          f"{detail.get('after')}s" + (f"; its log ends:\n{detail['log']}"
                                                        if detail.get("log") else ""))
    rows, actions = snap.rows, snap.actions
    fences: dict[str, float] = {}
    for c in snap.controls:
        fences[c.delegation_id] = min(fences.get(c.delegation_id, c.accepted_at), c.accepted_at)
    by_id = {r.id: r for r in rows}
    # A stop issued from another process (the CLI, a second supervisor) and answered: nothing
    # of that task may start afterwards, whichever attempt runs it.
    task_stops: dict[str, float] = {}
    for at, _, what, key, detail in notes:
        if what == "control_returned" and detail.get("code", 0) in (0, 2) \
                and "error" not in detail:
            task_stops[key] = min(task_stops.get(key, at), at)

    def fence_of(delegation_id: str) -> float | None:
        times = []
        node = by_id.get(delegation_id)
        while node is not None:
            if node.id in fences:
                times.append(fences[node.id])
            node = by_id.get(node.parent_id or "")
        return min(times) if times else None

    for r in rows:
        if not r.state.terminal:
            flag("stuck", f"{r.id} is {r.state.value}")
    completed_keys = {a.idempotency_key for a in actions
                      if a.state is tether.ActionState.COMPLETED}
    journaled = {a.idempotency_key: a for a in actions}
    for key, n in applied.items():
        if n > 1:
            flag("duplicate", f"key {key} applied {n} times")
        if key not in journaled:
            flag("ghost", f"key {key} applied with no intent in the journal")
        if key not in completed_keys:
            flag("lost", f"key {key} applied, no COMPLETED record")
    for a in actions:
        if a.state in (tether.ActionState.PENDING, tether.ActionState.IN_DOUBT):
            flag("unreconciled", f"{a.id} ({a.idempotency_key}) left {a.state.value}")
        if a.state in (tether.ActionState.NOT_APPLIED, tether.ActionState.FAILED) \
                and a.idempotency_key in applied:
            when = first_applied[a.idempotency_key] - a.started_at
            probed = (a.evidence or {}).get("probed_at")
            order = "" if probed is None else (
                f", probed {float(probed) - a.started_at:.3f}s after it")
            flag("dishonest", f"{a.id} ({a.idempotency_key}) says {a.state.value}, the ledger "
                              f"says applied {when:.3f}s after the intent{order}")
        fence = fence_of(a.delegation_id)
        if fence is not None and a.started_at > fence:
            flag("ghost", f"{a.id} intent at {a.started_at} after the fence at {fence}")
        row = by_id.get(a.delegation_id)
        stop = task_stops.get(row.task_id) if row is not None else None
        if stop is not None and a.started_at > stop:
            flag("ghost", f"{a.id} ({a.idempotency_key}, attempt {row.attempt if row else '?'})"
                          f" intent {a.started_at - stop:.3f}s after a stop of task "
                          f"{row.task_id if row else '?'} returned")
    return found
