"""Journal operations, each run inside one transaction by a backend.

Every rule the invariants put on the journal (write-ahead I1, fence I2, sequence compare-and-set
I4, subtree fence I10) is enforced here, inside the transaction that changes the rows, never by
a check in the caller followed by a write. Each function takes a DB-API connection whose
``execute`` accepts ``?`` placeholders. ``/*LOCK a, b*/`` marks where PostgreSQL takes share
locks on the rows a fence check reads (a comment to SQLite, whose writer is single).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from tether._core.documents import ControlIntent
from tether._core.errors import (
    IdempotencyConflict,
    InvalidTransition,
    JournalCorrupt,
    KeyInUse,
    NotFound,
    StaleEpoch,
    StaleSequence,
    UserError,
)
from tether._core.model import (
    ActionState,
    ControlKind,
    DelegationState,
    Effect,
    check_delegation_move,
)
from tether._core.outcome import (
    DEFAULT_DISPATCH_DEADLINE,
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
from tether._core.signing import Signed
from tether._core.verdict import JournalFacts
from tether._journal.rows import (
    Begin,
    BeginResult,
    ControlRow,
    DelegationRow,
    DocumentRow,
    EventRow,
    NewAction,
    NewDelegation,
    OwnerRow,
    dumps,
    loads,
)

T = TypeVar("T")


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Db(Protocol):
    def execute(self, sql: str, params: Any = ..., /) -> Cursor: ...


# A worker whose lease ran out is fenced by the journal itself: a paused process that wakes up
# after others presumed it dead cannot act, whether or not anybody reconciled it yet.
LEASED = ("NOT EXISTS (SELECT 1 FROM owners o WHERE o.id = {}.owner_id "
          "AND o.lease_until <= ?)")

SUBTREE = """WITH RECURSIVE sub(id, depth) AS (
    SELECT id, 0 FROM delegations WHERE id = ?
    UNION ALL SELECT d.id, sub.depth + 1 FROM delegations d JOIN sub ON d.parent_id = sub.id)"""

_DELEGATION_COLS = (
    "id, task_id, parent_id, epoch, attempt, agent, surface, args, owner_id, state, fenced, "
    "control_seq, created_at, updated_at, result, error, failure, model, trace_id, ended_at"
)
_ACTION_COLS = (
    "id, delegation_id, ordinal, tool, effect, args, idem_key, state, result, error, evidence, "
    "late, started_at, ended_at, deadline_at"
)


def _decoded(table: str, parse: Callable[[Any], T]) -> Callable[[Any], T]:
    """A row that does not decode (a flipped bit, a hand edit) is JournalCorrupt, naming the
    row, never a crash in the middle of an operation."""

    def decode(row: Any) -> T:
        try:
            return parse(row)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise JournalCorrupt(
                f"row {row[0]!r} of table {table} is corrupted ({type(exc).__name__}: {exc})"
            ) from None

    return decode


def _delegation_row(row: Any) -> DelegationRow:
    return DelegationRow(
        id=row[0], task_id=row[1], parent_id=row[2], epoch=row[3], attempt=row[4], agent=row[5],
        surface=tuple(loads(row[6])), args=loads(row[7]), owner_id=row[8],
        state=DelegationState(row[9]), fenced=bool(row[10]), control_seq=row[11],
        created_at=row[12], updated_at=row[13], result=loads(row[14]), error=row[15],
        failure=row[16], model=row[17], trace_id=row[18], ended_at=row[19],
    )


def _action_row(row: Any) -> ActionRecord:
    return ActionRecord(
        id=row[0], delegation_id=row[1], ordinal=row[2], tool=row[3], effect=Effect(row[4]),
        args=loads(row[5]), idempotency_key=row[6], state=ActionState(row[7]),
        result=loads(row[8]), error=row[9], evidence=loads(row[10]), late=bool(row[11]),
        started_at=row[12], ended_at=row[13],
        deadline_at=row[12] + DEFAULT_DISPATCH_DEADLINE if row[14] is None else row[14],
    )


_delegation = _decoded("delegations", _delegation_row)
_action = _decoded("actions", _action_row)


def event(db: Db, at: float, what: str, delegation_id: str | None = None,
          action_id: str | None = None, /, **detail: Any) -> None:
    db.execute(
        "INSERT INTO events (delegation_id, action_id, at, kind, detail) VALUES (?, ?, ?, ?, ?)",
        (delegation_id, action_id, at, what, dumps(detail)),
    )


# -- owners ---------------------------------------------------------------------------------

def register_owner(db: Db, owner: OwnerRow) -> None:
    db.execute(
        "INSERT INTO owners (id, pid, host, started_at, heartbeat_at, lease_until) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (owner.id, owner.pid, owner.host, owner.started_at, owner.heartbeat_at,
         owner.lease_until),
    )


def heartbeat(db: Db, owner_id: str, now: float) -> None:
    db.execute("UPDATE owners SET heartbeat_at = ? WHERE id = ?", (now, owner_id))


def owners(db: Db) -> list[OwnerRow]:
    rows = db.execute(
        "SELECT id, pid, host, started_at, heartbeat_at, lease_until FROM owners").fetchall()
    return [OwnerRow(*r) for r in rows]


# -- delegations ----------------------------------------------------------------------------

def get_delegation(db: Db, delegation_id: str) -> DelegationRow:
    row = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations WHERE id = ?", (delegation_id,)
    ).fetchone()
    if row is None:
        raise NotFound(f"no delegation {delegation_id!r} in this journal")
    return _delegation(row)


def list_delegations(db: Db, live_only: bool = False) -> list[DelegationRow]:
    terminal = tuple(s.value for s in DelegationState if s.terminal)
    where = f"WHERE state NOT IN ({', '.join('?' * len(terminal))})" if live_only else ""
    rows = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations {where} ORDER BY created_at, id",
        terminal if live_only else (),
    ).fetchall()
    return [_delegation(r) for r in rows]


def subtree(db: Db, root_id: str) -> list[DelegationRow]:
    """The delegation and all its descendants, parents before children."""
    get_delegation(db, root_id)
    cols = ", ".join(f"d.{c.strip()}" for c in _DELEGATION_COLS.split(","))
    rows = db.execute(
        f"{SUBTREE} SELECT {cols} FROM delegations d JOIN sub ON sub.id = d.id "
        "ORDER BY sub.depth, d.created_at, d.id",
        (root_id,),
    ).fetchall()
    return [_delegation(r) for r in rows]


def create_delegation(db: Db, new: NewDelegation) -> DelegationRow:
    """Insert a delegation: a fresh task at epoch 0, a re-delegation at epoch + 1 (CAS), a
    re-dispatch of a failed attempt, or a child under a parent that is neither fenced nor stale
    (I2, I10)."""
    if new.retry_of is not None:
        return _create_attempt(db, new)
    if new.redelegate_from_epoch is not None:
        cur = db.execute(
            "UPDATE tasks SET epoch = epoch + 1 WHERE id = ? AND epoch = ?",
            (new.task_id, new.redelegate_from_epoch),
        )
        if cur.rowcount != 1:
            row = db.execute("SELECT epoch FROM tasks WHERE id = ?", (new.task_id,)).fetchone()
            if row is None:
                raise NotFound(f"no task {new.task_id!r} in this journal")
            raise StaleEpoch(new.task_id, new.redelegate_from_epoch, row[0])
        epoch = new.redelegate_from_epoch + 1
    else:
        known = db.execute("SELECT epoch FROM tasks WHERE id = ?", (new.task_id,)).fetchone()
        if known is None:
            db.execute("INSERT INTO tasks (id, epoch) VALUES (?, 0)", (new.task_id,))
            epoch = 0
        elif new.parent_id is not None:
            # A re-delegated parent starts its children again under the same task ids, so their
            # idempotency keys repeat and completed actions replay instead of running twice.
            # The parent's own fence and epoch are checked by the insert below.
            epoch = known[0] + 1
            db.execute("UPDATE tasks SET epoch = ? WHERE id = ?", (epoch, new.task_id))
        else:
            raise UserError(
                f"task {new.task_id!r} already exists; re-delegate it instead of reusing the id"
            )
    values = _values(new, epoch)
    if new.parent_id is None:
        db.execute(_INSERT + "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)
    else:
        # The parent's fence and epoch are checked by the insert itself.
        cur = db.execute(
            _INSERT + "SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM delegations p "
            "JOIN tasks t ON t.id = p.task_id "
            "WHERE p.id = ? AND p.fenced = 0 AND p.epoch = ? AND t.epoch = p.epoch AND "
            f"{LEASED.format('p')} /*LOCK p, t*/",
            (*values, new.parent_id, new.parent_epoch, new.now),
        )
        if cur.rowcount != 1:
            raise FenceRefused(Begin.FENCED)
    if new.queued:
        db.execute("INSERT INTO queue (delegation_id, task_id, agent, enqueued_at) "
                   "VALUES (?, ?, ?, ?)", (new.id, new.task_id, new.agent, new.now))
        notify = getattr(db, "notify", None)
        if notify is not None:  # wakes idle workers
            notify("queued")
    event(db, new.now, "delegated", new.id, task=new.task_id, epoch=epoch,
          attempt=new.attempt, parent=new.parent_id, agent=new.agent, queued=new.queued)
    return get_delegation(db, new.id)


_INSERT = (
    "INSERT INTO delegations (id, task_id, parent_id, epoch, attempt, agent, surface, args, "
    "owner_id, state, created_at, updated_at, model, trace_id) "
)


def _values(new: NewDelegation, epoch: int) -> tuple[Any, ...]:
    return (
        new.id, new.task_id, new.parent_id, epoch, new.attempt, new.agent,
        dumps(list(new.surface)), dumps(new.args), new.owner_id, DelegationState.RUNNING.value,
        new.now, new.now, new.model, new.trace_id,
    )


def _create_attempt(db: Db, new: NewDelegation) -> DelegationRow:
    """A fresh child for the next attempt: only if the failed attempt is FAILED, still at the
    task's current epoch, and nobody forked its successor already (one statement)."""
    prior = get_delegation(db, str(new.retry_of))
    cur = db.execute(
        _INSERT + "SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM delegations f "
        "JOIN tasks t ON t.id = f.task_id "
        "WHERE f.id = ? AND f.state = 'FAILED' AND f.epoch = t.epoch AND NOT EXISTS "
        "(SELECT 1 FROM delegations n WHERE n.task_id = f.task_id AND n.epoch = f.epoch "
        f"AND n.attempt > f.attempt) AND {LEASED.format('f')} /*LOCK f, t*/",
        (*_values(new, prior.epoch), new.retry_of, new.now),
    )
    if cur.rowcount != 1:
        raise InvalidTransition(prior.id, prior.state.value, "re-dispatched")
    event(db, new.now, "delegated", new.id, task=new.task_id, epoch=prior.epoch,
          attempt=new.attempt, parent=new.parent_id, agent=new.agent, retry_of=new.retry_of)
    return get_delegation(db, new.id)


def bump_cancel(db: Db, task_id: str, now: float, why: str) -> int:
    cur = db.execute("UPDATE tasks SET cancel_gen = cancel_gen + 1 WHERE id = ?", (task_id,))
    if cur.rowcount != 1:
        raise NotFound(f"no task {task_id!r} in this journal")
    event(db, now, "cancel_requested", None, None, task=task_id, why=why)
    return cancel_generation(db, task_id)


def cancel_generation(db: Db, task_id: str) -> int:
    row = db.execute("SELECT cancel_gen FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if row is None:
        raise NotFound(f"no task {task_id!r} in this journal")
    return int(row[0])


def tools_ran(db: Db, root_id: str) -> int:
    """Every tool call of the subtree, READ_ONLY ones (journaled as events) and delegations
    included: zero means the journal proves that no tool ran at all."""
    row = db.execute(
        f"{SUBTREE} SELECT (SELECT COUNT(*) FROM actions WHERE delegation_id IN "
        "(SELECT id FROM sub)) + (SELECT COUNT(*) FROM events WHERE kind = 'read' AND "
        "delegation_id IN (SELECT id FROM sub)) + (SELECT COUNT(*) - 1 FROM sub)",
        (root_id,),
    ).fetchone()
    return int(row[0])


class FenceRefused(Exception):
    """The fence refused a child delegation: the parent is fenced or stale (I2, I10)."""

    def __init__(self, status: Begin) -> None:
        super().__init__(status.value)
        self.status = status


def set_state(db: Db, delegation_id: str, new: DelegationState, now: float,
              result: Any = None, error: str | None = None,
              failure: str | None = None) -> DelegationRow:
    row = get_delegation(db, delegation_id)
    if row.state is new:
        return row
    check_delegation_move(delegation_id, row.state, new)
    db.execute(
        "UPDATE delegations SET state = ?, updated_at = ?, result = COALESCE(?, result), "
        "error = COALESCE(?, error), failure = COALESCE(?, failure), "
        "fenced = CASE WHEN ? THEN 1 ELSE fenced END, "
        "ended_at = CASE WHEN ? THEN COALESCE(ended_at, ?) ELSE ended_at END WHERE id = ?",
        (new.value, now, None if result is None else dumps(result), error, failure,
         new.terminal, new.terminal, now, delegation_id),
    )
    event(db, now, "state", delegation_id, old=row.state.value, new=new.value)
    return get_delegation(db, delegation_id)


def end_delegation(db: Db, delegation_id: str, new: DelegationState, now: float,
                   result: Any = None, error: str | None = None,
                   failure: str | None = None) -> tuple[DelegationRow, list[ActionRecord]]:
    """A child ended on its own: its final state, and its own actions left in doubt, in one
    round trip."""
    row = set_state(db, delegation_id, new, now, result, error, failure)
    rows = db.execute(
        f"SELECT {_ACTION_COLS} FROM actions WHERE delegation_id = ? "
        "AND state IN ('IN_DOUBT', 'UNKNOWN') ORDER BY started_at, ordinal",
        (delegation_id,),
    ).fetchall()
    return row, [_action(r) for r in rows]


# -- control --------------------------------------------------------------------------------

def accept_control(db: Db, signed: Signed, intent: ControlIntent, issuer: str,
                   accepted_at: float) -> ControlRow:
    """Sequence compare-and-set, state move and subtree fence in one transaction (I2, I4, I10).
    The signature was verified by the caller against the journal's trusted keys."""
    row = get_delegation(db, intent.delegation_id)
    if intent.seq != row.control_seq + 1:
        raise StaleSequence(intent.delegation_id, intent.seq, row.control_seq)
    if intent.epoch != row.epoch:
        raise StaleEpoch(row.task_id, intent.epoch, row.epoch)
    target = intent.kind.target
    check_delegation_move(intent.delegation_id, row.state, target)
    cur = db.execute(
        "UPDATE delegations SET control_seq = ?, state = ?, fenced = 1, updated_at = ? "
        "WHERE id = ? AND control_seq = ?",
        (intent.seq, target.value, accepted_at, intent.delegation_id, row.control_seq),
    )
    if cur.rowcount != 1:  # another writer moved first (only possible across processes)
        raise StaleSequence(intent.delegation_id, intent.seq, row.control_seq + 1)
    # A re-dispatch in preparation must see this request (I6).
    db.execute("UPDATE tasks SET cancel_gen = cancel_gen + 1 WHERE id = ?", (row.task_id,))
    # I10: every descendant is fenced before anybody waits; live ones follow the root's state.
    db.execute(
        f"{SUBTREE} UPDATE delegations SET fenced = 1, updated_at = ?, state = CASE "
        "WHEN state IN ('RUNNING', 'RECALLING') THEN ? ELSE state END "
        "WHERE id IN (SELECT id FROM sub) AND id <> ?",
        (intent.delegation_id, accepted_at, target.value, intent.delegation_id),
    )
    cur = db.execute(
        "INSERT INTO controls (delegation_id, seq, kind, body, key_id, signature, accepted_at, "
        "issuer) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (intent.delegation_id, intent.seq, intent.kind.value, signed.body, signed.key_id,
         signed.signature, accepted_at, issuer),
    )
    event(db, accepted_at, "control", intent.delegation_id, kind=intent.kind.value,
          seq=intent.seq, grace=intent.grace, reason=intent.reason, issuer=issuer)
    # Wakes the owner at once where the backend can (LISTEN/NOTIFY, delivered on commit);
    # owners also poll, so a lost notification only delays the drain.
    notify = getattr(db, "notify", None)
    if notify is not None:
        notify(row.owner_id)
    return controls(db, intent.delegation_id)[-1]


def _control_row(r: Any) -> ControlRow:
    return ControlRow(
        id=r[0], delegation_id=r[1], seq=r[2], kind=ControlKind(r[3]),
        signed=Signed(bytes(r[4]), r[5], bytes(r[6])), accepted_at=r[7], issuer=r[8],
    )


_control = _decoded("controls", _control_row)
_CONTROL_COLS = "id, delegation_id, seq, kind, body, key_id, signature, accepted_at, issuer"


def controls(db: Db, delegation_id: str) -> list[ControlRow]:
    rows = db.execute(
        f"SELECT {_CONTROL_COLS} FROM controls WHERE delegation_id = ? ORDER BY seq",
        (delegation_id,),
    ).fetchall()
    return [_control(r) for r in rows]


def controls_after(db: Db, after_id: int) -> list[ControlRow]:
    rows = db.execute(
        f"SELECT {_CONTROL_COLS} FROM controls WHERE id > ? ORDER BY id", (after_id,)
    ).fetchall()
    return [_control(r) for r in rows]


def last_control_id(db: Db) -> int:
    row = db.execute("SELECT COALESCE(MAX(id), 0) FROM controls").fetchone()
    return int(row[0])


def record_document(db: Db, delegation_id: str, seq: int, type_: str, signed: Signed,
                    now: float) -> None:
    db.execute(
        "INSERT INTO documents (delegation_id, seq, type, body, key_id, signature, recorded_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (delegation_id, seq, type_, signed.body, signed.key_id, signed.signature, now),
    )
    event(db, now, type_, delegation_id, seq=seq)


def documents(db: Db, delegation_id: str) -> list[DocumentRow]:
    rows = db.execute(
        "SELECT delegation_id, seq, type, body, key_id, signature, recorded_at FROM documents "
        "WHERE delegation_id = ? ORDER BY id",
        (delegation_id,),
    ).fetchall()
    return [DocumentRow(r[0], r[1], r[2], Signed(bytes(r[3]), r[4], bytes(r[5])), r[6])
            for r in rows]


# -- actions --------------------------------------------------------------------------------

def begin_action(db: Db, new: NewAction) -> BeginResult:
    """The write-ahead intent (I1) behind the fence (I2), with the Stripe rule on keys (I7).
    The gate's rows are read under a share lock (PostgreSQL; SQLite has one writer), so an
    intent accepted for the delegation cannot commit between the check and the insert."""
    gate_row = db.execute(
        "SELECT d.fenced, d.epoch, t.epoch FROM delegations d "
        "JOIN tasks t ON t.id = d.task_id WHERE d.id = ? /*LOCK d, t*/",
        (new.delegation_id,),
    ).fetchone()
    if gate_row is None:
        raise NotFound(f"no delegation {new.delegation_id!r} in this journal")
    lease = db.execute(
        "SELECT o.lease_until FROM delegations d JOIN owners o ON o.id = d.owner_id "
        "WHERE d.id = ?", (new.delegation_id,)).fetchone()
    gate = judge_gate(fenced=bool(gate_row[0]), epoch=gate_row[1], task_epoch=gate_row[2],
                      caller_epoch=new.epoch, lease_until=None if lease is None else lease[0],
                      now=new.now)
    if gate is not Gate.OPEN:
        if gate is Gate.LEASE_EXPIRED:
            event(db, new.now, "lease_refused", new.delegation_id, None, tool=new.tool,
                  key=new.idem_key)
        return BeginResult(Begin(gate.value), new.id)
    prior = [PriorCall(r[0], r[1], r[2], ActionState(r[3]), loads(r[4])) for r in db.execute(
        "SELECT id, tool, args_hash, state, result FROM actions WHERE idem_key = ? "
        "ORDER BY started_at",
        (new.idem_key,),
    ).fetchall()]
    decision = decide_key(new.tool, new.args_hash, prior)
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
        f"INSERT INTO actions ({_ACTION_COLS.replace('result, error, evidence, late, ', '')}"
        ", args_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?)",
        (new.id, new.delegation_id, new.ordinal, new.tool, new.effect.value, new.args_json,
         new.idem_key, ActionState.PENDING.value, new.now, new.deadline_at, new.args_hash),
    )
    return BeginResult(Begin.STARTED, new.id)


def finish_action(db: Db, action_id: str, outcome: ActionState, now: float, result: Any = None,
                  error: str | None = None, evidence: dict[str, Any] | None = None) -> ActionState:
    """Record an outcome: an executor's receipt, or a probe's answer (with ``evidence``). A
    fence refuses new intents, never receipts: a receipt for an action already declared in
    doubt is a late receipt, kept and flagged, and it re-opens its delegation's accounting."""
    if evidence is None and outcome in (ActionState.COMPLETED, ActionState.FAILED):
        # The common case, a receipt for a PENDING action: one statement.
        cur = db.execute(
            "UPDATE actions SET state = ?, result = ?, error = ?, ended_at = ? "
            "WHERE id = ? AND state = 'PENDING'",
            (outcome.value, None if result is None else dumps(result), error, now, action_id),
        )
        if cur.rowcount == 1:
            return outcome
    row = db.execute("SELECT state, delegation_id FROM actions WHERE id = ?",
                     (action_id,)).fetchone()
    if row is None:
        raise NotFound(f"no action {action_id!r} in this journal")
    old = ActionState(row[0])
    verdict = judge_receipt(old, outcome, from_probe=evidence is not None)
    if verdict is Receipt.IGNORE:
        event(db, now, "outcome_ignored", None, action_id, old=old.value, new=outcome.value)
        return old
    late = verdict is Receipt.LATE
    db.execute(
        "UPDATE actions SET state = ?, result = COALESCE(?, result), error = COALESCE(?, error), "
        "evidence = COALESCE(?, evidence), late = CASE WHEN ? THEN 1 ELSE late END, "
        "ended_at = COALESCE(ended_at, ?) WHERE id = ? AND state = ?",
        (outcome.value, None if result is None else dumps(result), error,
         None if evidence is None else dumps(evidence), late, now, action_id, old.value),
    )
    event(db, now, "late_receipt" if late else "outcome", None, action_id,
          old=old.value, new=outcome.value)
    if late or evidence is not None:
        resettle(db, row[1], now, "late receipt" if late else "probe")
    return outcome


def resettle(db: Db, delegation_id: str, now: float, why: str) -> DelegationRow:
    """Re-open a stopped delegation's accounting after a new fact about one of its actions:
    it moves to its settled state once nothing of it may still apply. A running delegation
    settles when it ends."""
    row = get_delegation(db, delegation_id)
    if row.state is DelegationState.RUNNING:
        return row
    mine = db.execute("SELECT state, evidence FROM actions WHERE delegation_id = ?",
                      (delegation_id,)).fetchall()
    new = settle(row.state, [ActionFacts(ActionState(r[0]), r[1] is not None) for r in mine],
                 row.state)
    if new is row.state:
        return row
    event(db, now, "resettled", delegation_id, None, old=row.state.value, new=new.value,
          why=why)
    return set_state(db, delegation_id, new, now)


def mark_in_doubt(db: Db, root_id: str, now: float) -> list[str]:
    rows = db.execute(
        f"{SUBTREE} SELECT id FROM actions WHERE state = 'PENDING' "
        "AND delegation_id IN (SELECT id FROM sub)",
        (root_id,),
    ).fetchall()
    ids = [r[0] for r in rows]
    for action_id in ids:
        db.execute("UPDATE actions SET state = 'IN_DOUBT' WHERE id = ? AND state = 'PENDING'",
                   (action_id,))
        event(db, now, "in_doubt", None, action_id)
    return ids


def action_in_doubt(db: Db, action_id: str, now: float, why: str) -> bool:
    """One PENDING action declared in doubt (its executor is going away with it running)."""
    cur = db.execute("UPDATE actions SET state = 'IN_DOUBT' WHERE id = ? AND state = 'PENDING'",
                     (action_id,))
    if cur.rowcount == 1:
        event(db, now, "in_doubt", None, action_id, why=why)
    return cur.rowcount == 1


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
        f"SELECT {_ACTION_COLS} FROM actions WHERE delegation_id IN ({', '.join('?' * len(ids))}) "
        "ORDER BY started_at, ordinal",
        ids,
    ).fetchall()
    return [_action(r) for r in rows]


def unsettled_actions(db: Db, root_id: str | None) -> list[ActionRecord]:
    """IN_DOUBT and UNKNOWN actions (of one subtree, or of the whole journal)."""
    if root_id is None:
        rows = db.execute(
            f"SELECT {_ACTION_COLS} FROM actions WHERE state IN ('IN_DOUBT', 'UNKNOWN') "
            "ORDER BY started_at"
        ).fetchall()
    else:
        rows = db.execute(
            f"{SUBTREE} SELECT {_ACTION_COLS} FROM actions WHERE state IN ('IN_DOUBT', 'UNKNOWN') "
            "AND delegation_id IN (SELECT id FROM sub) ORDER BY started_at",
            (root_id,),
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


def drained(db: Db, delegation_id: str) -> bool:
    """Whether a drain ended (a verdict) after the delegation's latest accepted intent."""
    row = db.execute(
        "SELECT MAX(CASE WHEN kind = 'control' THEN id END), "
        "MAX(CASE WHEN kind = 'verdict' THEN id END) FROM events "
        "WHERE delegation_id = ? AND kind IN ('control', 'verdict')",
        (delegation_id,),
    ).fetchone()
    return row is not None and row[0] is not None and row[1] is not None and row[1] > row[0]


def last_verdict(db: Db, delegation_id: str) -> dict[str, Any] | None:
    row = db.execute(
        "SELECT detail FROM events WHERE delegation_id = ? AND kind = 'verdict' "
        "ORDER BY id DESC LIMIT 1",
        (delegation_id,),
    ).fetchone()
    return None if row is None else dict(loads(row[0]))


def events(db: Db, delegation_ids: Iterable[str]) -> list[EventRow]:
    ids = list(delegation_ids)
    if not ids:
        return []
    marks = ", ".join("?" * len(ids))
    rows = db.execute(
        "SELECT id, delegation_id, action_id, at, kind, detail FROM events "
        f"WHERE delegation_id IN ({marks}) OR action_id IN "
        f"(SELECT id FROM actions WHERE delegation_id IN ({marks})) ORDER BY id",
        (*ids, *ids),
    ).fetchall()
    return [EventRow(r[0], r[1], r[2], r[3], r[4], loads(r[5])) for r in rows]
