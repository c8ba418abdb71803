"""Journal operations, each run inside one transaction by a backend.

Every rule the invariants put on the journal (write-ahead I1, fence I2, sequence compare-and-set
I4, subtree fence I10) is enforced here (the action operations in ``actions``), inside the
transaction that changes the rows, never by a check in the caller followed by a write. Each
function takes a DB-API connection whose ``execute`` accepts ``?`` placeholders. ``/*LOCK a, b*/``
marks where PostgreSQL takes share locks on the rows a fence check reads, ``/*XLOCK a*/`` an
exclusive lock on a row about to be judged and moved (comments to SQLite, whose writer is
single). Every move of a row is a compare-and-set on what was read: PostgreSQL runs at READ
COMMITTED, where two processes may read the same state before either writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tether._core.columns import CONTROLS, DELEGATIONS, OWNERS, QUEUE, TASKS
from tether._core.documents import ControlIntent
from tether._core.errors import (
    ForgedRow,
    InvalidTransition,
    JournalCorrupt,
    JournalError,
    NotFound,
    OwnerChanged,
    StaleEpoch,
    StaleSequence,
    UserError,
)
from tether._core.model import (
    AWAITING_PROBE,
    RETRIED_FROM,
    ControlKind,
    DelegationState,
    check_delegation_move,
    fenced_below,
)
from tether._core.report import ActionRecord
from tether._core.signing import Signed

# The action operations live in actions.py and the shared row helpers in tables.py; ops still
# names every operation (``X as X`` marks a re-export).
from tether._journal.actions import action_in_doubt as action_in_doubt
from tether._journal.actions import actions as actions
from tether._journal.actions import begin_action as begin_action
from tether._journal.actions import facts as facts
from tether._journal.actions import finish_action as finish_action
from tether._journal.actions import get_action as get_action
from tether._journal.actions import mark_in_doubt as mark_in_doubt
from tether._journal.actions import receipts_missing as receipts_missing
from tether._journal.actions import resettle as resettle
from tether._journal.actions import settle_tree as settle_tree
from tether._journal.actions import unsettled_actions as unsettled_actions
from tether._journal.rows import (
    Begin,
    ControlRow,
    DelegationRow,
    DocumentRow,
    EventRow,
    NewDelegation,
    OwnerRow,
    dumps,
    loads,
)
from tether._journal.tables import (
    _ACTION_COLS,
    _CONTROL_COLS,
    _DELEGATION_COLS,
    _DELEGATION_COLS_D,
    _MOVE_TRIES,
    DOCUMENT_INSERT,
    LEASED,
    SUBTREE,
    Conn,
    Db,
    _action,
    _control,
    _decoded,
    _delegation,
    before,
    chunks,
    marks,
    signed_of,
    touch,
    values,
)
from tether._journal.tables import event as event
from tether._journal.tables import get_delegation as get_delegation
from tether._journal.tables import set_state as set_state

# -- owners ---------------------------------------------------------------------------------

_NEW_OWNER = OWNERS.insert(OWNERS.names)
_OWNERS = f"SELECT {OWNERS.select()} FROM owners"
_CONTROL_INSERT = CONTROLS.insert(CONTROLS.pick(without=("id",)), " RETURNING id")


def register_owner(db: Db, owner: OwnerRow) -> None:
    db.execute(
        _NEW_OWNER,
        (owner.id, owner.pid, owner.host, owner.started_at, owner.heartbeat_at,
         owner.lease_until),
    )


def heartbeat(db: Db, owner_id: str, now: float) -> None:
    db.execute("UPDATE owners SET heartbeat_at = ? WHERE id = ?", (now, owner_id))


def owners(db: Db) -> list[OwnerRow]:
    rows = db.execute(
        _OWNERS).fetchall()
    return [OwnerRow(*r) for r in rows]


# -- delegations ----------------------------------------------------------------------------

def list_delegations(db: Db, live_only: bool = False) -> list[DelegationRow]:
    terminal = tuple(s.value for s in DelegationState if s.terminal)
    where = f"WHERE state NOT IN ({marks(terminal)})" if live_only else ""
    rows = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations {where} ORDER BY created_at, id",
        terminal if live_only else (),
    ).fetchall()
    return [_delegation(r) for r in rows]


def subtree(db: Db, root_id: str) -> list[DelegationRow]:
    """The delegation and all its descendants, parents before children."""
    get_delegation(db, root_id)
    cols = _DELEGATION_COLS_D
    rows = db.execute(
        f"{SUBTREE} SELECT {cols} FROM delegations d JOIN sub ON sub.id = d.id "
        "ORDER BY sub.depth, d.created_at, d.id",
        (root_id,),
    ).fetchall()
    found = [_delegation(r) for r in rows]
    seen: set[str] = set()
    for row in found:
        if row.id in seen:
            raise JournalCorrupt(f"row {row.id!r} of table delegations is corrupted: it is its "
                                 "own ancestor (its parent_id, or an ancestor's, was edited)")
        seen.add(row.id)
    return found


def kin(db: Db, ids: Iterable[str]) -> list[str]:
    """``ids``, their subtrees, and every delegation (with its subtree) that shares a task id
    with any of them: the records whose idempotency keys (``task:tool:n``) a new attempt or
    epoch of these tasks replays, or reuses when they read as not applied. Those of an earlier
    epoch are not in the re-delegated one's subtree (a replay adds no row), so checking that
    subtree alone would believe a first epoch's COMPLETED refund flipped to NOT_APPLIED."""
    found: dict[str, None] = dict.fromkeys(ids)
    tasks: set[str] = set()
    todo = list(found)
    while todo:
        for start in todo:
            for r in db.execute(f"{SUBTREE} SELECT d.id, d.task_id FROM delegations d "
                                "JOIN sub ON sub.id = d.id", (start,)).fetchall():
                found.setdefault(str(r[0]))
                tasks.add(str(r[1]))
        more = [str(r[0]) for part in chunks(sorted(tasks)) for r in db.execute(
            f"SELECT id FROM delegations WHERE task_id IN ({marks(part)})",
            tuple(part)).fetchall()]
        todo = [d for d in dict.fromkeys(more) if d not in found]
        found.update(dict.fromkeys(todo))
    return list(found)


def _superseded(db: Db, new: NewDelegation, epoch: int) -> None:
    """In the chain of each root delegation of the epoch moved from, which one replaced it:
    the newest epoch deleted as a whole, chain and all, is then named by the one before
    (``epoch_gaps``), and deleting this event too is a rollback of that delegation's chain."""
    for (old,) in db.execute(
            "SELECT id FROM delegations WHERE task_id = ? AND epoch = ? AND parent_id IS NULL",
            (new.task_id, new.redelegate_from_epoch)).fetchall():
        event(db, new.now, "superseded", str(old), None, by=new.id, epoch=epoch)


def epoch_gaps(db: Db, ids: Iterable[str]) -> dict[str, list[int]]:
    """The tasks of ``ids`` whose delegations skip an epoch, or whose newest epoch named as
    a successor is gone, and the epochs missing. Every epoch move inserts its delegation in
    the same transaction, and `tether prune` removes a task's epochs together: a gap is an
    epoch deleted as a whole by hand, chain and all (the one record that held a key's
    COMPLETED call, which would then be paid again, or a recall that kept a run out)."""
    tasks = sorted({str(r[0]) for part in chunks(sorted(set(ids))) for r in db.execute(
        f"SELECT task_id FROM delegations WHERE id IN ({marks(part)})",
        tuple(part)).fetchall()})
    seen: dict[str, set[int]] = {}
    named: dict[str, set[int]] = {}
    for part in chunks(tasks):
        # One statement: at READ COMMITTED (PostgreSQL) each statement sees what committed
        # before it, and a re-delegation committing between a read of the epochs and one of
        # the successors would read as its new epoch deleted (a false Tampered).
        m = marks(part)
        for task, epoch, detail in db.execute(
                f"SELECT task_id, epoch, NULL FROM delegations WHERE task_id IN ({m}) "
                "UNION ALL SELECT d.task_id, NULL, e.detail FROM events e JOIN delegations d "
                f"ON d.id = e.delegation_id WHERE e.kind = 'superseded' AND d.task_id IN ({m})",
                (*part, *part)).fetchall():
            if detail is None:
                if type(epoch) is int and 0 <= epoch < 1 << 20:
                    seen.setdefault(str(task), set()).add(epoch)
            elif (successor := _detail_epoch(detail)) is not None:
                named.setdefault(str(task), set()).add(successor)
    gaps = {}
    for task, epochs in seen.items():
        top = max(epochs | named.get(task, set()))
        missing = sorted(set(range(top + 1)) - epochs)
        if missing:
            gaps[task] = missing
    return gaps


def _detail_epoch(detail: Any) -> int | None:
    """A superseded event's successor epoch; an unreadable one is the chain's to name."""
    try:
        epoch = loads(detail).get("epoch")
    except (ValueError, TypeError, AttributeError):
        return None
    return epoch if type(epoch) is int and 0 <= epoch < 1 << 20 else None


def create_delegation(db: Conn, new: NewDelegation) -> DelegationRow:
    """Insert a delegation: a fresh task at epoch 0, a re-delegation at epoch + 1 (CAS), a
    re-dispatch of a failed attempt, or a child under a parent that is neither fenced nor stale
    (I2, I10)."""
    if new.retry_of is not None:
        return _create_attempt(db, new)
    if new.redelegate_from_epoch is not None:
        # The epoch moved from, locked before the task is moved (PostgreSQL; every writer takes
        # a delegation's row before its task's): a prune that holds it commits first, and then
        # it is gone with its receipts, which the new epoch would replay by their keys (a
        # payment run again). A root or a child: a Temporal child workflow's run goes on as a
        # run of its own.
        if not db.execute("SELECT d.id FROM delegations d WHERE d.task_id = ? AND d.epoch = ? "
                          "/*LOCK d*/", (new.task_id, new.redelegate_from_epoch)).fetchall():
            raise NotFound(f"epoch {new.redelegate_from_epoch} of task {new.task_id!r} is "
                           "not in this journal (pruned): nothing to re-delegate")
        cur = db.execute(
            "UPDATE tasks SET epoch = epoch + 1 WHERE id = ? AND epoch = ?",
            (new.task_id, new.redelegate_from_epoch),
        )
        if cur.rowcount != 1:
            row = db.execute("SELECT epoch FROM tasks WHERE id = ?", (new.task_id,)).fetchone()
            if row is None:
                raise NotFound(f"no task {new.task_id!r} in this journal")
            raise StaleEpoch(new.task_id, new.redelegate_from_epoch, row[0])
        if new.unstopped is not None:
            # A recall or terminate accepted for it moves the task's row too (its cancel
            # generation): one that committed first is read here; a later one finds it ended.
            old, seq = new.unstopped
            found = db.execute("SELECT control_seq FROM delegations WHERE id = ?",
                               (old,)).fetchone()
            if found is None or found[0] != seq:
                raise StaleSequence(old, seq + 1, seq if found is None else found[0])
        epoch = new.redelegate_from_epoch + 1
    else:
        known = db.execute("SELECT epoch FROM tasks WHERE id = ?", (new.task_id,)).fetchone()
        if known is None:
            db.execute(_NEW_TASK, (new.task_id, 0))
            epoch = 0
        elif new.parent_id is not None:
            # A re-delegated parent starts its children again under the same task ids, so their
            # idempotency keys repeat and completed actions replay instead of running twice.
            # The parent's own fence and epoch are checked by the insert below.
            epoch = known[0] + 1
            if db.execute("SELECT 1 FROM delegations WHERE task_id = ? AND epoch = ?",
                          (new.task_id, known[0])).fetchone() is None:
                # Its epochs were pruned: a new one would replay none of their receipts (a
                # Temporal workflow id that ran as a run of its own, then as a child).
                raise NotFound(f"epoch {known[0]} of task {new.task_id!r} is not in this "
                               "journal (pruned): its calls' receipts are gone")
            # Compare-and-set (PostgreSQL): a run of the same task opened apart meanwhile
            # (``temporal_runs.open_run``) took this epoch; two live delegations at one epoch
            # would leave one of them out of every stop.
            if db.execute("UPDATE tasks SET epoch = ? WHERE id = ? AND epoch = ?",
                          (epoch, new.task_id, known[0])).rowcount != 1:
                current = db.execute("SELECT epoch FROM tasks WHERE id = ?",
                                     (new.task_id,)).fetchone()
                raise StaleEpoch(new.task_id, known[0], known[0] if current is None
                                 else current[0])
        else:
            raise UserError(
                f"task {new.task_id!r} already exists; re-delegate it instead of reusing the id"
            )
    values = _values(new, epoch)
    if new.parent_id is None:
        db.execute(f"{_INSERT}VALUES ({_MARKS})", values)
        touch(db, "delegations", new.id)
        if new.redelegate_from_epoch is not None:
            _superseded(db, new, epoch)
    else:
        # The parent's fence and epoch are checked by the insert itself.
        cur = db.execute(
            f"{_INSERT}SELECT {_MARKS} FROM delegations p "
            "JOIN tasks t ON t.id = p.task_id "
            "WHERE p.id = ? AND p.fenced = 0 AND p.epoch = ? AND t.epoch = p.epoch AND "
            f"{LEASED.format('p')} /*LOCK p, t*/",
            (*values, new.parent_id, new.parent_epoch, new.now),
        )
        if cur.rowcount != 1:
            raise FenceRefused(Begin.FENCED)
        touch(db, "delegations", new.id)
    if new.queued:
        db.execute(_QUEUED, (new.id, new.task_id, new.agent, new.now))
        db.notify("queued")  # wakes idle workers
    event(db, new.now, "delegated", new.id, task=new.task_id, epoch=epoch,
          attempt=new.attempt, parent=new.parent_id, agent=new.agent, queued=new.queued)
    return get_delegation(db, new.id)


_NEW_TASK = TASKS.insert(("id", "epoch"))
_QUEUED = QUEUE.insert(("delegation_id", "task_id", "agent", "enqueued_at"))
# A new delegation's columns, in ``_values``'s order; the rest keep their defaults.
_NEW = DELEGATIONS.named((
    "id", "task_id", "parent_id", "epoch", "attempt", "agent", "surface", "args", "owner_id",
    "state", "created_at", "updated_at", "model", "trace_id", "work_body", "work_key", "work_sig"))
_INSERT = DELEGATIONS.into(_NEW) + " "
_MARKS = ", ".join("?" * len(_NEW))


def _values(new: NewDelegation, epoch: int) -> tuple[Any, ...]:
    return (
        new.id, new.task_id, new.parent_id, epoch, new.attempt, new.agent,
        dumps(list(new.surface)), dumps(new.args), new.owner_id, DelegationState.RUNNING.value,
        new.now, new.now, new.model, new.trace_id,
        None if new.work is None else new.work.body,
        None if new.work is None else new.work.key_id,
        None if new.work is None else new.work.signature,
    )


def _create_attempt(db: Db, new: NewDelegation) -> DelegationRow:
    """A fresh child for the next attempt: only if the failed attempt is FAILED, still at the
    task's current epoch, and nobody forked its successor already (one statement)."""
    prior = get_delegation(db, str(new.retry_of))
    if prior.parent_id is not None:
        # Under a parent fenced meanwhile (its recall or terminate), no new attempt may start
        # (I10). Read under a share lock: a fence being accepted commits first or waits.
        parent = db.execute("SELECT p.fenced FROM delegations p WHERE p.id = ? /*LOCK p*/",
                            (prior.parent_id,)).fetchone()
        if parent is None or parent[0]:
            raise FenceRefused(Begin.FENCED)
    cur = db.execute(
        f"{_INSERT}SELECT {_MARKS} FROM delegations f "
        "JOIN tasks t ON t.id = f.task_id "
        "WHERE f.id = ? AND f.state = ? AND f.epoch = t.epoch AND NOT EXISTS "
        "(SELECT 1 FROM delegations n WHERE n.task_id = f.task_id AND n.epoch = f.epoch "
        f"AND n.attempt > f.attempt) AND {LEASED.format('f')} /*LOCK f, t*/",
        (*_values(new, prior.epoch), new.retry_of, RETRIED_FROM.value, new.now),
    )
    if cur.rowcount != 1:
        raise InvalidTransition(prior.id, prior.state.value, "re-dispatched")
    touch(db, "delegations", new.id)
    event(db, new.now, "delegated", new.id, task=new.task_id, epoch=prior.epoch,
          attempt=new.attempt, parent=new.parent_id, agent=new.agent, retry_of=new.retry_of)
    return get_delegation(db, new.id)


def work_of(db: Db, delegation_id: str) -> Signed | None:
    """The signed work order a delegation carries, if any."""
    row = db.execute("SELECT id, work_body, work_key, work_sig FROM delegations WHERE id = ?",
                     (delegation_id,)).fetchone()
    if row is None or row[1] is None or row[2] is None or row[3] is None:
        return None
    return _work(row)


_work = _decoded("delegations", lambda r: signed_of(r[1], r[2], r[3]))
_document = _decoded("documents", lambda r: DocumentRow(
    r[1], r[2], r[3], signed_of(r[4], r[5], r[6]), r[7], int(r[0])))


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



def end_delegation(db: Db, delegation_id: str, new: DelegationState, now: float,
                   result: Any = None, error: str | None = None,
                   failure: str | None = None) -> tuple[DelegationRow, list[ActionRecord]]:
    """A child ended on its own: its final state, and its own actions left in doubt, in one
    round trip."""
    row = set_state(db, delegation_id, new, now, result, error, failure)
    rows = db.execute(
        f"SELECT {_ACTION_COLS} FROM actions WHERE delegation_id = ? "
        f"AND state IN ({marks(AWAITING_PROBE)}) ORDER BY started_at, ordinal",
        (delegation_id, *values(AWAITING_PROBE)),
    ).fetchall()
    return row, [_action(r) for r in rows]


# -- control --------------------------------------------------------------------------------

def accept_control(db: Conn, signed: Signed, intent: ControlIntent, issuer: str,
                   stamp: float | Callable[[], float], owner: str | None = None) -> ControlRow:
    """Sequence compare-and-set, state move and subtree fence in one transaction (I2, I4, I10).
    The signature was verified by the caller against the journal's trusted keys. ``stamp``
    (a clock) is read once the row is locked: an intent of another process that held the
    row's share lock committed before that moment, so it never reads as after the fence.
    ``owner``: only while the delegation still has this owner (a recovery judged it gone; a
    worker's claim since hands the delegation to a live one), else OwnerChanged."""
    target = intent.kind.target
    before(db, "delegations", intent.delegation_id)  # locked from here on (PostgreSQL)
    accepted_at = stamp() if callable(stamp) else stamp
    while True:
        row = get_delegation(db, intent.delegation_id)
        if owner is not None and row.owner_id != owner:
            raise OwnerChanged(intent.delegation_id, owner, row.owner_id)
        if intent.seq != row.control_seq + 1:
            raise StaleSequence(intent.delegation_id, intent.seq, row.control_seq)
        if intent.epoch != row.epoch:
            raise StaleEpoch(row.task_id, intent.epoch, row.epoch)
        check_delegation_move(intent.delegation_id, row.state, target, row.control_seq)
        # Compare-and-set on the sequence and the state read: another process may have moved
        # the row since (its child ended, another intent landed); then it is judged again
        # against what that writer left, never overwritten. The sequence only grows and a
        # state moves a bounded number of times, so this ends.
        cur = db.execute(
            "UPDATE delegations SET control_seq = ?, state = ?, fenced = 1, updated_at = ? "
            "WHERE id = ? AND control_seq = ? AND state = ?"
            + ("" if owner is None else " AND owner_id = ?"),
            (intent.seq, target.value, accepted_at, intent.delegation_id, row.control_seq,
             row.state.value, *(() if owner is None else (owner,))),
        )
        if cur.rowcount == 1:
            touch(db, "delegations", intent.delegation_id)
            break
    _fence_below(db, intent.delegation_id, intent.kind, accepted_at)
    # A re-dispatch in preparation must see this request (I6), in the whole subtree: a child
    # waiting out its settle delay under a recalled parent must not fork again. After the
    # subtree's rows: every writer takes a delegation's row before its task's (a re-delegation
    # of a child's task holds the child, then moves the task).
    db.execute(
        f"{SUBTREE} UPDATE tasks SET cancel_gen = cancel_gen + 1 "
        "WHERE id IN (SELECT d.task_id FROM delegations d JOIN sub ON sub.id = d.id)",
        (intent.delegation_id,))
    squatter = db.execute("SELECT id FROM controls WHERE delegation_id = ? AND seq = ?",
                          (intent.delegation_id, intent.seq)).fetchone()
    if squatter is not None:
        # The delegation's own sequence says this slot is free: a row the acceptance never
        # wrote (forged, or left by a hand edit) holds it. Name it, change nothing.
        raise ForgedRow(f"controls row {squatter[0]} holds sequence {intent.seq} of "
                        f"delegation {intent.delegation_id}, whose accepted sequence is "
                        f"{row.control_seq}: that row was not written by an accepted intent "
                        "(forged or edited); remove it, then retry")
    inserted = db.execute(
        _CONTROL_INSERT,
        (intent.delegation_id, intent.seq, intent.kind.value, signed.body, signed.key_id,
         signed.signature, accepted_at, issuer),
    ).fetchone()
    touch(db, "controls", inserted[0])
    event(db, accepted_at, "control", intent.delegation_id, kind=intent.kind.value,
          seq=intent.seq, grace=intent.grace, reason=intent.reason, issuer=issuer)
    # Wakes the owner at once where the backend can (LISTEN/NOTIFY, delivered on commit);
    # owners also poll, so a lost notification only delays the drain.
    db.notify(row.owner_id)
    return controls(db, intent.delegation_id)[-1]



def _fence_below(db: Db, root_id: str, kind: ControlKind, at: float) -> None:
    """I10: every descendant is fenced before anybody waits, each moved as the core decides
    (``fenced_below``: live ones follow the root), written guarded by the state it was judged
    in. The rows are locked first (PostgreSQL), so a guard fails only where nothing locks."""
    ids = [r[0] for r in db.execute(f"{SUBTREE} SELECT id FROM sub WHERE id <> ? ORDER BY id",
                                    (root_id, root_id)).fetchall()]
    for below in ids:
        before(db, "delegations", below)
    for _ in range(_MOVE_TRIES):
        judged: dict[str, list[str]] = {}  # by the state as stored
        for part in chunks(ids):
            for row_id, state in db.execute(
                    f"SELECT id, state FROM delegations WHERE id IN ({marks(part)}) ORDER BY id",
                    tuple(part)).fetchall():
                judged.setdefault(state, []).append(row_id)
        left: list[str] = []
        for old, group in judged.items():
            new = _fenced_state(old, kind)
            for part in chunks(group):
                done = {r[0] for r in db.execute(
                    "UPDATE delegations SET fenced = 1, updated_at = ?, state = ? "
                    f"WHERE id IN ({marks(part)}) AND state = ? RETURNING id",
                    (at, new, *part, old)).fetchall()}
                for row_id in part:
                    if row_id in done:
                        touch(db, "delegations", row_id)
                    else:
                        left.append(row_id)
        if not left:
            return
        ids = sorted(left)  # moved by another writer between the read and the write
    raise JournalError(f"the subtree of {root_id} kept moving under its fence; try again")


def _fenced_state(stored: str, kind: ControlKind) -> str:
    """A descendant's state once fenced. One that does not decode (a hand edit) is fenced all
    the same and keeps what it holds: refusing the recall would leave the whole subtree open,
    and ``tether verify`` names the row."""
    try:
        return fenced_below(DelegationState(stored), kind).value
    except ValueError:
        return stored


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
    inserted = db.execute(
        DOCUMENT_INSERT,
        (delegation_id, seq, type_, signed.body, signed.key_id, signed.signature, now),
    ).fetchone()
    touch(db, "documents", inserted[0])
    event(db, now, type_, delegation_id, seq=seq)


def documents(db: Db, delegation_id: str) -> list[DocumentRow]:
    rows = db.execute(
        "SELECT id, delegation_id, seq, type, body, key_id, signature, recorded_at "
        "FROM documents WHERE delegation_id = ? ORDER BY id",
        (delegation_id,),
    ).fetchall()
    return [_document(r) for r in rows]



def drained(db: Db, delegation_id: str) -> bool:
    """Whether the delegation's latest accepted intent has its verdict. A drain's verdict
    names the newest intent it answers (a terminate accepted once a recall's drain had chosen
    its ending is answered by a verdict of its own after it); a verdict that names none (a
    settle of ended code, a recovery) answers every intent before it."""
    rows = {r[0]: (r[1], loads(r[2])) for r in db.execute(
        "SELECT kind, id, detail FROM events WHERE id IN ("
        "(SELECT MAX(id) FROM events WHERE delegation_id = ? AND kind = 'control'), "
        "(SELECT MAX(id) FROM events WHERE delegation_id = ? AND kind = 'verdict'))",
        (delegation_id, delegation_id)).fetchall()}
    if "control" not in rows or "verdict" not in rows:
        return False
    (control_id, intent), (verdict_id, verdict) = rows["control"], rows["verdict"]
    if "seq" in verdict:
        return int(verdict["seq"]) >= int(intent["seq"])
    return bool(verdict_id > control_id)


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

