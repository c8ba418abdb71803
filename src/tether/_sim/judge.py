"""Judging a finished trial against the provider's own ledger (``tether chaos``'s classes).

- lost: a key applied, yet no COMPLETED journal record of it;
- duplicate: a key applied more than once, or two keys applied for one logical payment of one
  task (a re-delegation must reuse the keys);
- ghost: an application with no intent; an intent committed after a fence closed on its
  delegation or an ancestor; an intent of a task's attempt (or its subtree) committed after a
  stop of that task and epoch returned to the orchestrator that asked for it;
- unreconciled: an action PENDING or IN_DOUBT once every deadline passed and recovery ran; or
  one a process probed while it could still apply and left IN_DOUBT or UNKNOWN, though that
  process stayed up, open and unpaused past the call's deadline (it never probed it again);
- dishonest: NOT_APPLIED or FAILED for an action whose own request was applied, COMPLETED
  for a key never applied, a stopped delegation settled (RECALLED, TERMINATED,
  RECONCILED...) while one of its calls was still PENDING or IN_DOUBT, a delegation that
  ended while a child it started was still RUNNING (its code could still pay), or a call
  sent at or past the dispatch deadline its executor journaled, by that executor's own
  clock (the tool's promise that nothing is sent after it; the provider refuses it, another
  may not);
- stuck: a delegation not terminal at the end, or a trial that did not quiesce;
- tampered: a delegation whose chain does not verify at the end (nobody tampers in a trial:
  a writer that sealed or deleted what it should not, or a false alarm);
- error: a simulated process raised what its code does not expect (a simulator defect, or a
  core decision that broke an assumption of its callers), or a delegation failed on one of
  the journal's constraints (the schema refused what the runtime decided).

Orders are commit numbers of the journal, never clock readings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tether._core.model import ActionState
from tether._sim.world import Provider

CLASSES = ("lost", "duplicate", "ghost", "unreconciled", "dishonest", "stuck")
SIM_CLASSES = (*CLASSES, "tampered", "error")


class Facts(Protocol):
    """What the judge reads of a journal: its rows ordered by commit (``facts.View``).
    Delegations have ``id``, ``task_id``, ``parent_id``, ``epoch``, ``attempt``, ``state`` and
    ``fence_seq`` (the commit of the first fence on it); actions ``id``, ``delegation_id``,
    ``key``, ``state`` and ``seq`` (the commit of its intent)."""

    @property
    def rows(self) -> Mapping[str, Any]: ...
    @property
    def actions(self) -> Mapping[str, Any]: ...
    @property
    def by_key(self) -> Mapping[str, Sequence[Any]]: ...
    @property
    def early(self) -> Sequence[tuple[str, str, str]]: ...
    @property
    def orphans(self) -> Sequence[tuple[str, str, str]]: ...


@dataclass(frozen=True, slots=True)
class Violation:
    trial_seed: int
    faults: tuple[str, ...]
    kind: str
    detail: str

    @property
    def fault(self) -> str:
        return "+".join(self.faults) or "none"

    def to_json(self) -> dict[str, Any]:
        return {"trial_seed": self.trial_seed, "fault": self.fault,
                "faults": list(self.faults), "class": self.kind, "detail": self.detail}


def judge(journal: Facts, provider: Provider, stops: list[tuple[str, int, int]],
          errors: list[str], quiesced: str | None,
          broken: Sequence[str] = (), neglected: Sequence[str] = (),
          tampered: Sequence[str] = ()) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    def flag(kind: str, detail: str) -> None:
        found.append((kind, detail))

    if quiesced is not None:
        flag("stuck", f"the trial did not quiesce: {quiesced}")
    for error in errors:
        flag("error", error)
    for promise in broken:
        flag("dishonest", promise)
    for call in neglected:
        flag("unreconciled", call)
    for problem in tampered:
        flag("tampered", problem)
    for did, state, calls in journal.early:
        flag("dishonest", f"{did} settled {state} while {calls} could still apply")
    for did, state, children in journal.orphans:
        flag("dishonest", f"{did} ended {state} while its child {children} was still RUNNING")
    rows = journal.rows
    for row in rows.values():
        if not row.state.terminal:
            flag("stuck", f"{row.id} ({row.task_id} epoch {row.epoch} attempt {row.attempt})"
                          f" is {row.state.value}")
    applied_by: set[str] = set()
    logical: dict[str, dict[str, None]] = {}
    for app in provider.ledger:
        applied_by.add(app.action_id)
        logical.setdefault(app.logical, {})[app.key] = None
    for key, n in provider.applied.items():
        mine = journal.by_key.get(key, [])
        if n > 1:
            flag("duplicate", f"key {key} applied {n} times")
        if not mine:
            flag("ghost", f"key {key} applied with no intent in the journal")
        if not any(a.state is ActionState.COMPLETED for a in mine):
            states = ", ".join(f"{a.id} {a.state.value}" for a in mine) or "no action"
            flag("lost", f"key {key} applied, no COMPLETED record ({states})")
    for name, keys in logical.items():
        if len(keys) > 1:
            flag("duplicate", f"payment {name} applied under keys {', '.join(keys)}")

    def chain(row: Any) -> list[Any]:
        out = []
        while row is not None:
            out.append(row)
            row = rows.get(row.parent_id) if row.parent_id is not None else None
        return out

    for a in journal.actions.values():
        if a.state in (ActionState.PENDING, ActionState.IN_DOUBT):
            flag("unreconciled", f"{a.id} ({a.key}) left {a.state.value}")
        if a.state in (ActionState.NOT_APPLIED, ActionState.FAILED) and a.id in applied_by:
            flag("dishonest", f"{a.id} ({a.key}) says {a.state.value}; its request was applied")
        if a.state is ActionState.COMPLETED and not provider.applied.get(a.key):
            flag("dishonest", f"{a.id} ({a.key}) says COMPLETED; the key was never applied")
        up = chain(rows.get(a.delegation_id))
        fences = [r.fence_seq for r in up if r.fence_seq is not None]
        if fences and a.seq > min(fences):
            flag("ghost", f"{a.id} ({a.key}) intent committed at #{a.seq}, after the fence "
                          f"at #{min(fences)} of {up[-1].id if up else '?'}'s subtree")
        for task, epoch, at in stops:
            if a.seq > at and any(r.task_id == task and r.epoch == epoch for r in up):
                flag("ghost", f"{a.id} ({a.key}) intent committed at #{a.seq}, after a stop "
                              f"of {task} epoch {epoch} returned at #{at}")
                break
    return found


__all__ = ["CLASSES", "SIM_CLASSES", "Violation", "judge"]
