"""Journal operations on actions: the write-ahead intent behind the fence (I1, I2, I7), receipts
and probe answers, declaring calls in doubt, and the reads the accounting uses. Each runs inside
one transaction, like every operation in ``ops`` (which re-exports these).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tether._core.columns import ACTIONS
from tether._core.errors import IdempotencyConflict, KeyInUse, NotFound
from tether._core.model import (
    ACTION_FINAL,
    AWAITING_PROBE,
    DELEGATION_TERMINAL,
    ActionState,
    DelegationState,
    Effect,
    executor_gone,
)
from tether._core.outcome import (
    KEY_FREE,
    ActionFacts,
    Gate,
    KeyVerdict,
    PriorCall,
    Receipt,
    decide_key,
    judge_gate,
    judge_receipt,
    settle,
)
from tether._core.report import ActionRecord
from tether._core.resolution import contradicts
from tether._core.verdict import JournalFacts
from tether._journal.rows import Begin, BeginResult, DelegationRow, NewAction, dumps, loads
from tether._journal.tables import (
    _ACTION_COLS,
    SUBTREE,
    Conn,
    Db,
    _action,
    before,
    event,
    get_delegation,
    marks,
    set_state,
    touch,
    values,
)

_A = ActionState


# An intent: the call's identity, its key and deadline, PENDING; its outcome columns wait.
_INTENT = ACTIONS.insert(("id", "delegation_id", "ordinal", "tool", "effect", "args", "idem_key",
                          "state", "started_at", "deadline_at", "args_hash"))


def begin_action(db: Conn, new: NewAction, tolerance: float) -> BeginResult:
    """The write-ahead intent (I1) behind the fence (I2), with the Stripe rule on keys (I7).
    The gate's rows are read under a share lock (PostgreSQL; SQLite has one writer), so an
    intent accepted for the delegation cannot commit between the check and the insert."""
    # One read on the hot path: the owner's lease rides along (not locked: a lease only
    # shrinks by time, and the comparison is with the caller's ``now``).
    # The earlier uses of the key are read with it, under a share lock (PostgreSQL): a late
    # receipt that re-opens a NOT_APPLIED one (``finish_action``, which locks it first) either
    # commits before this read, and the key replays, or waits for this intent, and then sees
    # it. One round trip for both; when the gate is closed the second was not needed (its
    # locks, taken in the same order as when it is open, are held until the batch ends).
    gate_reply, uses = db.replies([
        ("SELECT d.fenced, d.epoch, t.epoch, o.lease_until FROM delegations d "
         "JOIN tasks t ON t.id = d.task_id LEFT JOIN owners o ON o.id = d.owner_id "
         "WHERE d.id = ? /*LOCK d, t*/", (new.delegation_id,)),
        ("SELECT id, tool, args_hash, state, result, deadline_at FROM actions a "
         "WHERE idem_key = ? ORDER BY started_at /*LOCK a*/", (new.idem_key,)),
    ])
    gate_row = gate_reply.rows[0] if gate_reply.rows else None
    if gate_row is None:
        raise NotFound(f"no delegation {new.delegation_id!r} in this journal")
    gate = judge_gate(fenced=bool(gate_row[0]), epoch=gate_row[1], task_epoch=gate_row[2],
                      caller_epoch=new.epoch, lease_until=gate_row[3], now=new.now)
    if gate is not Gate.OPEN:
        if gate is Gate.LEASE_EXPIRED:
            event(db, new.now, "lease_refused", new.delegation_id, None, tool=new.tool,
                  key=new.idem_key)
        return BeginResult(Begin(gate.value), new.id)
    prior = [PriorCall(r[0], r[1], r[2], ActionState(r[3]), loads(r[4]), r[5])
             for r in uses.rows]
    decision = decide_key(new.tool, new.args_hash, prior, new.now, tolerance)
    found = decision.prior
    if decision.verdict is KeyVerdict.CONFLICT:
        assert found is not None
        raise IdempotencyConflict(new.idem_key, found.tool)
    if decision.verdict is KeyVerdict.REPLAY:
        assert found is not None
        return BeginResult(Begin.REPLAY, found.action_id, found.result)
    if decision.verdict is KeyVerdict.WAIT:
        assert found is not None
        return BeginResult(Begin.WAIT, found.action_id)
    if decision.verdict is KeyVerdict.UNKNOWN:
        assert found is not None
        raise KeyInUse(new.idem_key, found.action_id, found.state.value)
    db.execute(
        _INTENT,
        (new.id, new.delegation_id, new.ordinal, new.tool, new.effect.value, new.args_json,
         new.idem_key, ActionState.PENDING.value, new.now, new.deadline_at, new.args_hash),
    )
    touch(db, "actions", new.id)
    return BeginResult(Begin.STARTED, new.id)


def finish_action(db: Db, action_id: str, outcome: ActionState, now: float, result: Any = None,
                  error: str | None = None, evidence: dict[str, Any] | None = None) -> ActionState:
    """Record an outcome: an executor's receipt, or a probe's answer (with ``evidence``). A
    fence refuses new intents, never receipts: a receipt for an action already declared in
    doubt is a late receipt, kept and flagged, and it re-opens its delegation's accounting."""
    before(db, "actions", action_id)
    if evidence is None and outcome in ACTION_FINAL and judge_receipt(
            _A.PENDING, outcome, from_probe=False) is Receipt.RECORD:
        # The common case, a final receipt for a PENDING action: one statement, judged as if
        # the action were PENDING and written only if it still is. (A receipt that puts the
        # call in doubt takes the path below, which journals the move.)
        cur = db.execute(
            "UPDATE actions SET state = ?, result = ?, error = ?, ended_at = ? "
            "WHERE id = ? AND state = ?",
            (outcome.value, None if result is None else dumps(result), error, now, action_id,
             _A.PENDING.value),
        )
        if cur.rowcount == 1:
            touch(db, "actions", action_id)
            return outcome
    while True:
        # Locked (PostgreSQL) before it is judged: the check below for a new use of a freed
        # key then reads every intent that took the key before this lock was granted.
        row = db.execute("SELECT state, delegation_id, result IS NULL, idem_key FROM actions a "
                         "WHERE id = ? /*XLOCK a*/", (action_id,)).fetchone()
        if row is None:
            # Pruned (``tether prune``) after the tree was final, or never here: the fact is
            # kept as an event, never dropped, for a person to see.
            event(db, now, "receipt_for_pruned_action", None, action_id, outcome=outcome.value,
                  result=result, error=error, evidence=evidence)
            return outcome
        old = ActionState(row[0])
        verdict = judge_receipt(old, outcome, from_probe=evidence is not None,
                                fills_result=bool(row[2]) and result is not None)
        decided = resolved_as(db, action_id)
        contradicted = decided is not None and contradicts(decided, outcome)
        if verdict is Receipt.IGNORE:
            if contradicted:
                _contradicted(db, now, action_id, row[1], decided, outcome, result, error,
                              evidence)
                return old
            event(db, now, "outcome_ignored", None, action_id, old=old.value,
                  new=outcome.value)
            return old
        if old in KEY_FREE and outcome not in KEY_FREE and db.execute(
                "SELECT 1 FROM actions WHERE idem_key = ? AND id <> ? AND state NOT IN "
                f"({marks(KEY_FREE)})", (row[3], action_id, *values(KEY_FREE))
        ).fetchone() is not None:
            # The key was used again after a final "not applied" (a provider that broke its
            # dispatch deadline): the fact is kept as an event, never dropped, for a person.
            event(db, now, "contradicting_receipt", None, action_id, old=old.value,
                  new=outcome.value, result=result, error=error, evidence=evidence)
            resettle(db, row[1], now, "a receipt contradicts a final outcome", attention=True)
            return old
        late = verdict is Receipt.LATE
        cur = db.execute(
            "UPDATE actions SET state = ?, result = COALESCE(?, result), "
            "error = COALESCE(?, error), evidence = COALESCE(?, evidence), "
            "late = CASE WHEN ? THEN 1 ELSE late END, ended_at = COALESCE(ended_at, ?) "
            "WHERE id = ? AND state = ?",
            (outcome.value, None if result is None else dumps(result), error,
             None if evidence is None else dumps(evidence), late, now, action_id, old.value),
        )
        if cur.rowcount == 1:
            touch(db, "actions", action_id)
            break
        # Another process recorded an outcome between the read and this write (PostgreSQL):
        # judge this one again against it. An action's state moves a few times at most.
    event(db, now, "late_receipt" if late else "outcome", None, action_id,
          old=old.value, new=outcome.value)
    if contradicted:
        _contradicted(db, now, action_id, row[1], decided, outcome, result, error, evidence)
    elif late or evidence is not None:
        resettle(db, row[1], now, "late receipt" if late else "probe")
    return outcome


def _contradicted(db: Db, now: float, action_id: str, delegation_id: str,
                  decided: ActionState | None, outcome: ActionState, result: Any,
                  error: str | None, evidence: dict[str, Any] | None) -> None:
    """A fact after a person's decision says otherwise: both are kept, and a person must look
    again (``_core.resolution``)."""
    event(db, now, CONTRADICTED, None, action_id, resolved=None if decided is None
          else decided.value, new=outcome.value, result=result, error=error, evidence=evidence)
    resettle(db, delegation_id, now, "a receipt contradicts a person's decision",
             attention=True)


RESOLVED = "resolved"  # the event of a person's decision (``_journal.resolutions``)
CONTRADICTED = "resolution_contradicted"  # a later fact that says otherwise


def resolved_as(db: Db, action_id: str) -> ActionState | None:
    """The latest decision a person recorded for the action, if any."""
    row = db.execute(
        "SELECT detail FROM events WHERE action_id = ? AND kind = ? ORDER BY id DESC LIMIT 1",
        (action_id, RESOLVED)).fetchone()
    return None if row is None else ActionState(loads(row[0])["outcome"])


def resettle(db: Db, delegation_id: str, now: float, why: str, *,
             attention: bool = False) -> DelegationRow:
    """Re-open a stopped delegation's accounting after a new fact about one of its actions:
    it moves to its settled state once nothing of it or of its subtree may still apply, and
    so may its ancestors. A running delegation settles when it ends."""
    row, new = _judge(db, delegation_id, attention=attention)
    if new is not row.state:
        event(db, now, "resettled", delegation_id, None, old=row.state.value, new=new.value,
              why=why)
        row = set_state(db, delegation_id, new, now)
    if row.parent_id is not None and row.state.terminal:
        resettle(db, row.parent_id, now, f"child {delegation_id} settled")
    return row


def _judge(db: Db, delegation_id: str, *,
           attention: bool = False) -> tuple[DelegationRow, DelegationState]:
    """A node and its settled state (``settle``), judged on the facts as they are now."""
    # The row is locked first (PostgreSQL), so that the facts below are read after any other
    # process's re-settling of it has committed: a judgement on stale facts never lands.
    db.execute("SELECT id FROM delegations d WHERE id = ? /*XLOCK d*/", (delegation_id,))
    row = get_delegation(db, delegation_id)
    mine = db.execute("SELECT state, evidence FROM actions WHERE delegation_id = ?",
                      (delegation_id,)).fetchall()
    children = db.execute("SELECT state FROM delegations WHERE parent_id = ?",
                          (delegation_id,)).fetchall()
    new = settle(row.state, [ActionFacts(ActionState(r[0]), r[1] is not None) for r in mine],
                 row.state,
                 children_settled=all(DelegationState(c[0]).terminal for c in children),
                 attention=attention)
    return row, new


def settle_tree(db: Db, root_id: str, now: float,
                verdict: Mapping[str, str | int] | None = None) -> None:
    """Every node of a subtree, deepest first, to its settled state, each judged under its
    lock on the facts as they are when it is written (never on facts read in an earlier
    transaction, which another process's probe or receipt may have changed since); then the
    root's ``verdict`` event, if any, in the same transaction."""
    ids = [r[0] for r in db.execute(f"{SUBTREE} SELECT id FROM sub ORDER BY depth DESC, id",
                                    (root_id,)).fetchall()]
    for delegation_id in ids:
        row, new = _judge(db, delegation_id)
        if new is not row.state:
            set_state(db, delegation_id, new, now)
    if verdict is not None:
        event(db, now, "verdict", root_id, **verdict)


def mark_in_doubt(db: Db, root_id: str, now: float) -> list[str]:
    """Every call of a subtree whose executors are going away (``executor_gone``)."""
    rows = db.execute(
        f"{SUBTREE} SELECT id FROM actions WHERE state = ? "
        "AND delegation_id IN (SELECT id FROM sub)",
        (root_id, _A.PENDING.value),
    ).fetchall()
    ids = [r[0] for r in rows]
    for action_id in ids:
        _gone(db, action_id, _A.PENDING)
        event(db, now, "in_doubt", None, action_id)
    return ids


def action_in_doubt(db: Db, action_id: str, now: float, why: str) -> bool:
    """One PENDING action declared in doubt (its executor is going away with it running)."""
    moved = _gone(db, action_id, _A.PENDING)
    if moved:
        event(db, now, "in_doubt", None, action_id, why=why)
    return moved


def _gone(db: Db, action_id: str, judged: ActionState) -> bool:
    """The core's move for an action whose executor goes away, written only if the action is
    still in the state it was judged in."""
    new = executor_gone(judged)
    if new is judged:
        return False
    before(db, "actions", action_id)
    cur = db.execute("UPDATE actions SET state = ? WHERE id = ? AND state = ?",
                     (new.value, action_id, judged.value))
    if cur.rowcount == 1:
        touch(db, "actions", action_id)
    return bool(cur.rowcount == 1)


def receipts_missing(db: Db, root_id: str | None) -> list[ActionRecord]:
    """PENDING actions of settled delegations: their receipt was never written (a full or
    read-only disk refused it) although their delegation went on and ended. Nobody will write
    it now, so they are in doubt, for a probe to settle."""
    where = (f"state = ? AND delegation_id IN (SELECT id FROM delegations "
             f"WHERE state IN ({marks(DELEGATION_TERMINAL)}))")
    states = (_A.PENDING.value, *values(DELEGATION_TERMINAL))
    if root_id is None:
        rows = db.execute(f"SELECT {_ACTION_COLS} FROM actions WHERE {where} "
                          "ORDER BY started_at", states).fetchall()
    else:
        rows = db.execute(f"{SUBTREE} SELECT {_ACTION_COLS} FROM actions WHERE {where} "
                          "AND delegation_id IN (SELECT id FROM sub) ORDER BY started_at",
                          (root_id, *states)).fetchall()
    return [_action(r) for r in rows]


def get_action(db: Db, action_id: str) -> ActionRecord:
    row = db.execute(f"SELECT {_ACTION_COLS} FROM actions WHERE id = ?", (action_id,)).fetchone()
    if row is None:
        raise NotFound(f"no action {action_id!r} in this journal")
    return _action(row)


def actions(db: Db, delegation_ids: Iterable[str]) -> list[ActionRecord]:
    ids = list(delegation_ids)
    if not ids:
        return []
    rows = db.execute(
        f"SELECT {_ACTION_COLS} FROM actions WHERE delegation_id IN ({marks(ids)}) "
        "ORDER BY started_at, ordinal",
        ids,
    ).fetchall()
    return [_action(r) for r in rows]


def unsettled_actions(db: Db, root_id: str | None) -> list[ActionRecord]:
    """IN_DOUBT and UNKNOWN actions (of one subtree, or of the whole journal)."""
    where = f"state IN ({marks(AWAITING_PROBE)})"
    if root_id is None:
        rows = db.execute(
            f"SELECT {_ACTION_COLS} FROM actions WHERE {where} ORDER BY started_at",
            values(AWAITING_PROBE),
        ).fetchall()
    else:
        rows = db.execute(
            f"{SUBTREE} SELECT {_ACTION_COLS} FROM actions WHERE {where} "
            "AND delegation_id IN (SELECT id FROM sub) ORDER BY started_at",
            (root_id, *values(AWAITING_PROBE)),
        ).fetchall()
    return [_action(r) for r in rows]


def facts(db: Db, root_id: str) -> JournalFacts:
    root = get_delegation(db, root_id)
    rows = db.execute(
        f"{SUBTREE} SELECT id, state, effect FROM actions "
        "WHERE delegation_id IN (SELECT id FROM sub)",
        (root_id,),
    ).fetchall()
    pending = frozenset(r[0] for r in rows if r[1] == ActionState.PENDING.value)
    in_doubt = frozenset(
        r[0] for r in rows if r[1] in (ActionState.IN_DOUBT.value, ActionState.UNKNOWN.value)
    )
    effecting = sum(1 for r in rows if Effect(r[2]).side_effecting)
    return JournalFacts(root_id, root.control_seq, pending, in_doubt, effecting)

