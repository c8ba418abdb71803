"""Journal operations for a person's decisions on actions (``_core.resolution``): recorded in
one transaction with the signed document, the action's new state, the event and the
re-settling of its delegation; and the reads ``tether show`` and the reports use."""

from __future__ import annotations

from typing import Any

from tether._core.errors import Malformed, UserError
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE
from tether._core.report import ActionRecord
from tether._core.resolution import Resolution, judge_resolution
from tether._core.signing import Signed
from tether._journal.actions import CONTRADICTED, RESOLVED, get_action, resettle
from tether._journal.rows import dumps, loads
from tether._journal.tables import DOCUMENT_INSERT, Db, before, event, touch


def _contradicted(db: Db, action_id: str) -> bool:
    """A fact contradicted the latest decision (and no decision came since)."""
    row = db.execute(
        "SELECT MAX(CASE WHEN kind = ? THEN id END), MAX(CASE WHEN kind = ? THEN id END) "
        "FROM events WHERE action_id = ? AND kind IN (?, ?)",
        (RESOLVED, CONTRADICTED, action_id, RESOLVED, CONTRADICTED)).fetchone()
    return row is not None and row[1] is not None and (row[0] is None or row[1] > row[0])


def resolve_action(db: Db, signed: Signed, res: Resolution, now: float,
                   tolerance: float) -> ActionRecord:
    """Record a verified decision: the action moves to the decided outcome with the decision
    in its evidence, and its delegation (and ancestors) re-settle."""
    action = get_action(db, res.action_id)
    # The delegation's row locked first (PostgreSQL): decisions on its actions take its next
    # document number one after another, and the action is read again after the wait.
    db.execute("SELECT id FROM delegations d WHERE id = ? /*XLOCK d*/", (action.delegation_id,))
    action = get_action(db, res.action_id)
    if action.delegation_id != res.delegation_id:
        raise Malformed(f"action {action.id} belongs to {action.delegation_id}, "
                        f"not {res.delegation_id}")
    # A row older than schema v3 has no deadline: its start plus the default, as a probe
    # judges it (``_runtime.reconcile.deadline_of`` for a tool it does not know).
    deadline = action.deadline_at if action.deadline_at is not None else \
        action.started_at + DEFAULT_DISPATCH_DEADLINE
    why = judge_resolution(action.state, res.outcome, deadline_at=deadline, now=now,
                           tolerance=tolerance, contradicted=_contradicted(db, action.id))
    if why is not None:
        raise UserError(f"cannot resolve {action.id} as {res.outcome.value}: {why}")
    decision = {"outcome": res.outcome.value, "operator": res.operator, "key_id": signed.key_id,
                "note": res.note, "at": now}
    evidence = {**(action.evidence or {}), "resolution": decision}
    before(db, "actions", action.id)
    cur = db.execute(
        "UPDATE actions SET state = ?, evidence = ?, ended_at = COALESCE(ended_at, ?) "
        "WHERE id = ? AND state = ?",
        (res.outcome.value, dumps(evidence), now, action.id, action.state.value))
    if cur.rowcount != 1:  # another writer moved it first (only possible across processes)
        raise UserError(f"action {action.id} changed while it was being resolved; try again")
    touch(db, "actions", action.id)
    seq = db.execute("SELECT COUNT(*) FROM documents WHERE delegation_id = ? AND type = ?",
                     (action.delegation_id, Resolution.TYPE)).fetchone()[0] + 1
    doc = db.execute(
        DOCUMENT_INSERT,
        (action.delegation_id, seq, Resolution.TYPE, signed.body, signed.key_id,
         signed.signature, now)).fetchone()
    touch(db, "documents", doc[0])
    event(db, now, RESOLVED, action.delegation_id, action.id, old=action.state.value,
          **decision)
    resettle(db, action.delegation_id, now, f"resolved by {res.operator}")
    return get_action(db, action.id)


def resolutions(db: Db, delegation_ids: list[str]) -> list[dict[str, Any]]:
    """Decisions and contradictions of these delegations' actions, oldest first."""
    if not delegation_ids:
        return []
    marks = ", ".join("?" * len(delegation_ids))
    rows = db.execute(
        "SELECT e.id, e.action_id, e.at, e.kind, e.detail FROM events e "
        f"JOIN actions a ON a.id = e.action_id WHERE a.delegation_id IN ({marks}) "
        "AND e.kind IN (?, ?) ORDER BY e.id",
        (*delegation_ids, RESOLVED, CONTRADICTED)).fetchall()
    return [{"action": r[1], "at": r[2], "kind": r[3], **loads(r[4])} for r in rows]
