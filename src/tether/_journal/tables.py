"""The tables as the journal's operations read them: the connection protocol, the SQL
fragments and columns they share, row decoders, the event log, and one delegation's row (read
and moved), which both the delegation and the action operations build on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence, Sized
from typing import Any, NamedTuple, Protocol, TypeVar

from tether._core import chain
from tether._core.columns import ACTIONS, CONTROLS, DELEGATIONS, DOCUMENTS, EVENTS, positions
from tether._core.errors import JournalCorrupt, JournalError, NotFound
from tether._core.model import (
    ActionState,
    ControlKind,
    DelegationState,
    Effect,
    check_delegation_move,
)
from tether._core.report import ActionRecord
from tether._core.signing import Signed
from tether._journal.rows import ControlRow, DelegationRow, dumps, loads

T = TypeVar("T")


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Db(Protocol):
    def execute(self, sql: str, params: Any = ..., /) -> Cursor: ...


class Conn(Db, Protocol):
    """What a runner hands an operation: SQL, and what the backend can do beyond it,
    declared (every runner's connection has both: a no-op or None where the backend
    cannot). The operations that tell or ask the backend take this."""

    def executemany(self, sql: str, params: Any, /) -> Any:
        """One statement for many rows (one round trip on PostgreSQL)."""

    def notify(self, payload: str) -> None:
        """Tell the journal's other processes, once this transaction commits (never if it
        rolls back): LISTEN/NOTIFY on PostgreSQL, ``wake`` on a SQLite file."""

    def server_time(self) -> float | None:
        """The database server's clock, which every host shares (PostgreSQL); None where
        the processes share the host's clock (SQLite)."""

    def send(self, steps: Sequence[Step], /, *, last: bool = False) -> None:
        """Statements whose results nobody reads, in order: one round trip on PostgreSQL.
        ``last``: nothing else runs in this transaction before its COMMIT, and they may wait
        to go with it (PostgreSQL: no round trip of their own; an error in them is then the
        COMMIT's, which fails the batch as theirs would have)."""

    def replies(self, statements: Sequence[tuple[str, Any]], /) -> list[Reply]:
        """Statements that do not depend on each other's results, in order, and what each
        answered: one round trip on PostgreSQL, with what its connection held back
        (``wire.Wire``). Their values are identifiers (ids, idempotency keys) and hashes,
        never a call's arguments, results or errors: PostgreSQL gets them as literals, and
        its log shows them with any error."""


# (sql, params, many): one statement, or one for each of many rows (``Conn.send``).
Step = tuple[str, Any, bool]


class Reply(NamedTuple):
    """One statement's answer in ``Conn.replies``: its rows (none for a write without
    RETURNING) and how many rows it touched."""

    rows: list[Any]
    rowcount: int


def replies_each(db: Any, statements: Sequence[tuple[str, Any]]) -> list[Reply]:
    """``Conn.replies`` where a statement costs no round trip (SQLite): one after another,
    each read to its end before the next runs."""
    out = []
    for sql, params in statements:
        cur = db.execute(sql, params)
        out.append(Reply(cur.fetchall(), cur.rowcount))
    return out


def send_each(db: Any, steps: Sequence[Step]) -> None:
    """``Conn.send`` where a statement costs no round trip (SQLite): one after another."""
    for sql, params, many in steps:
        if many:
            db.executemany(sql, params)
        else:
            db.execute(sql, params)


# A worker whose lease ran out is fenced by the journal itself: a paused process that wakes up
# after others presumed it dead cannot act, whether or not anybody reconciled it yet.
LEASED = ("NOT EXISTS (SELECT 1 FROM owners o WHERE o.id = {}.owner_id "
          "AND o.lease_until <= ?)")

# Bounded: a parent_id edited into a cycle (a row its own ancestor) would otherwise recurse for
# ever, hanging `tether show` and every recall's fence in its transaction. No real tree nests
# this deep; ``subtree`` names a row met twice as corrupt.
MAX_DEPTH = 1000
SUBTREE = f"""WITH RECURSIVE sub(id, depth) AS (
    SELECT id, 0 FROM delegations WHERE id = ?
    UNION ALL SELECT d.id, sub.depth + 1 FROM delegations d JOIN sub ON d.parent_id = sub.id
    WHERE sub.depth < {MAX_DEPTH})"""

# What the operations read of a delegation (its signed work order apart) and of an action (its
# arguments' hash apart), in the declared order; the decoders read those rows by name.
_DELEGATION_READ = DELEGATIONS.pick(without=("work_body", "work_key", "work_sig"))
_ACTION_READ = ACTIONS.pick(without=("args_hash",))
_DELEGATION_COLS = ", ".join(_DELEGATION_READ)
_ACTION_COLS = ", ".join(_ACTION_READ)
_DELEGATION_COLS_D = ", ".join(f"d.{c}" for c in _DELEGATION_READ)  # aliased ``d``
_ACTION_COLS_A = ", ".join(f"a.{c}" for c in _ACTION_READ)  # aliased ``a``
_D = positions(_DELEGATION_READ)
_A = positions(_ACTION_READ)


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
    d = _D
    return DelegationRow(
        id=row[d["id"]], task_id=row[d["task_id"]], parent_id=row[d["parent_id"]],
        epoch=row[d["epoch"]], attempt=row[d["attempt"]], agent=row[d["agent"]],
        surface=tuple(loads(row[d["surface"]])), args=loads(row[d["args"]]),
        owner_id=row[d["owner_id"]], state=DelegationState(row[d["state"]]),
        fenced=bool(row[d["fenced"]]), control_seq=row[d["control_seq"]],
        created_at=row[d["created_at"]], updated_at=row[d["updated_at"]],
        result=loads(row[d["result"]]), error=row[d["error"]], failure=row[d["failure"]],
        model=row[d["model"]], trace_id=row[d["trace_id"]], ended_at=row[d["ended_at"]],
    )


def _action_row(row: Any) -> ActionRecord:
    a = _A
    return ActionRecord(
        id=row[a["id"]], delegation_id=row[a["delegation_id"]], ordinal=row[a["ordinal"]],
        tool=row[a["tool"]], effect=Effect(row[a["effect"]]), args=loads(row[a["args"]]),
        idempotency_key=row[a["idem_key"]], state=ActionState(row[a["state"]]),
        result=loads(row[a["result"]]), error=row[a["error"]],
        evidence=loads(row[a["evidence"]]), late=bool(row[a["late"]]),
        started_at=row[a["started_at"]], ended_at=row[a["ended_at"]],
        deadline_at=_finite_or_none(row[a["deadline_at"]]),
    )


def _finite_or_none(value: Any) -> float | None:
    """A deadline column: NULL in rows older than schema v3 (the tool's own deadline then
    decides, see ``reconcile.deadline_of``), else a finite number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"deadline_at is {value!r}, not a time")
    return float(value)


_delegation = _decoded("delegations", _delegation_row)
_action = _decoded("actions", _action_row)


class Tx:
    """What a write batch's operations receive: the backend's connection, plus the records
    they wrote (``touch``), for the sealer to chain before the COMMIT."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.execute = inner.execute
        self.notify = inner.notify
        self.server_time = inner.server_time
        self.dirty: list[tuple[str, Any]] = []
        # Each updated record's row as this transaction found it, read under its lock before
        # the first write (``before``): the chain keeps it beside the row written.
        self.pre: dict[tuple[str, Any], str] = {}
        # The heads its seal moved, (delegation, length, hash): remembered once it committed.
        self.sealed: list[tuple[str, int, str]] | None = None
        # What to do once it is known to have committed (``runner._after``): a batch can be
        # rolled back and run again, so nothing it read or wrote is remembered outside the
        # journal before then.
        self.after: list[Callable[[], None]] = []
        # It wrote a key registry entry: a registry read after that holds an entry that is
        # not committed yet (``trustops.registry`` then remembers it only after the commit).
        self.trust_written = False
        # Its COMMIT does not wait for the disk (``runner.relaxed_batch``): what it sealed can
        # still be lost by the machine or a PostgreSQL server, so it is not remembered yet.
        self.relaxed = False
        # Its COMMIT must leave the log synced even if it wrote nothing (``Runner.landed``):
        # heads other processes committed without waiting for the disk are remembered then.
        self.sync_log = False

    def mark(self) -> tuple[int, int, int, bool]:
        """Where the next operation begins: what ``undo`` takes back if it fails alone."""
        return len(self.dirty), len(self.pre), len(self.after), self.trust_written

    def undo(self, mark: tuple[int, int, int, bool]) -> None:
        """An operation rolled back to its savepoint: the records it wrote are not chained,
        the rows it found are forgotten (their locks went with the savepoint on PostgreSQL:
        another process may change them before the batch writes them again), nothing it
        meant to remember is, and a registry entry it wrote no longer defers the batch's
        later registry reads (they hold committed entries alone)."""
        del self.dirty[mark[0]:]
        if len(self.pre) > mark[1]:  # insertion-ordered: what it added is at the end
            for key in list(self.pre)[mark[1]:]:
                del self.pre[key]
        del self.after[mark[2]:]
        self.trust_written = mark[3]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def touch(db: Db, table: str, pk: Any) -> None:
    """Note a record this transaction wrote (and holds locked until it commits), for the
    writer to chain and seal before its COMMIT (``chainops.seal``). A connection that does not
    collect (a read, a migration) ignores it."""
    if isinstance(db, Tx):
        db.dirty.append((table, pk))
        db.pre.setdefault((table, pk), "")  # inserted: no row before


def before(db: Db, table: str, pk: Any) -> None:
    """Before this transaction first updates a record: read its row as committed, under its
    lock (PostgreSQL), for the chain to keep its hash with the new entry. A row altered by
    hand since its last entry is then told apart from the writer's own update of it, instead
    of being sealed as if the writer had written it (``chain.judge``)."""
    if not isinstance(db, Tx) or (table, pk) in db.pre:
        return
    # A batch's first statement, often: with its BEGIN, in one round trip (PostgreSQL).
    (found,) = db.replies(
        [(f"SELECT {chain.COLUMNS[table]} FROM {table} x WHERE id = ? /*XLOCK x*/", (pk,))])
    db.pre[(table, pk)] = "" if not found.rows else chain.content_hash(found.rows[0])


_EVENT = EVENTS.insert(("delegation_id", "action_id", "at", "kind", "detail"), " RETURNING id")


def event(db: Db, at: float, what: str, delegation_id: str | None = None,
          action_id: str | None = None, /, **detail: Any) -> None:
    row = db.execute(
        _EVENT,
        (delegation_id, action_id, at, what, dumps(detail)),
    ).fetchone()
    if delegation_id is not None or action_id is not None:
        touch(db, "events", row[0])



def blob(value: Any) -> bytes:
    """A BLOB column's bytes. ``bytes(text)`` would raise a bare TypeError deep in a read (a
    hand-written row in SQLite, whose columns take any type), and ``bytes(n)`` would make n
    zero bytes: anything but bytes is a TypeError the row decoders turn into JournalCorrupt."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"a {type(value).__name__} where signed bytes belong")


def signed_of(body: Any, key_id: Any, signature: Any) -> Signed:
    if not isinstance(key_id, str):
        raise TypeError(f"a {type(key_id).__name__} where a key id belongs")
    return Signed(blob(body), key_id, blob(signature))


_CONTROL_COLS = CONTROLS.select()
# A signed document (an acknowledgement, a receipt, a person's resolution): its id is the row's.
DOCUMENT_INSERT = DOCUMENTS.insert(DOCUMENTS.pick(without=("id",)), " RETURNING id")
_C = positions(CONTROLS.names)


def _control_row(r: Any) -> ControlRow:
    c = _C
    return ControlRow(
        id=r[c["id"]], delegation_id=r[c["delegation_id"]], seq=r[c["seq"]],
        kind=ControlKind(r[c["kind"]]),
        signed=signed_of(r[c["body"]], r[c["key_id"]], r[c["signature"]]),
        accepted_at=r[c["accepted_at"]], issuer=r[c["issuer"]],
    )


_control = _decoded("controls", _control_row)


def get_delegation(db: Db, delegation_id: str) -> DelegationRow:
    row = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations WHERE id = ?", (delegation_id,)
    ).fetchone()
    if row is None:
        raise NotFound(f"no delegation {delegation_id!r} in this journal")
    return _delegation(row)



def set_state(db: Db, delegation_id: str, new: DelegationState, now: float,
              result: Any = None, error: str | None = None,
              failure: str | None = None) -> DelegationRow:
    """Move a delegation, judged against the state it holds when written: a compare-and-set,
    so that of two processes that read the same state (PostgreSQL, READ COMMITTED) the second
    is judged again against what the first wrote, never overwrites it."""
    before(db, "delegations", delegation_id)
    for _ in range(_MOVE_TRIES):
        row = get_delegation(db, delegation_id)
        if row.state is new:
            return row
        check_delegation_move(delegation_id, row.state, new)
        cur = db.execute(
            "UPDATE delegations SET state = ?, updated_at = ?, result = COALESCE(?, result), "
            "error = COALESCE(?, error), failure = COALESCE(?, failure), "
            "fenced = CASE WHEN ? THEN 1 ELSE fenced END, "
            "ended_at = CASE WHEN ? THEN COALESCE(ended_at, ?) ELSE ended_at END "
            "WHERE id = ? AND state = ?",
            (new.value, now, None if result is None else dumps(result), error, failure,
             new.terminal, new.terminal, now, delegation_id, row.state.value),
        )
        if cur.rowcount == 1:
            touch(db, "delegations", delegation_id)
            event(db, now, "state", delegation_id, old=row.state.value, new=new.value)
            return get_delegation(db, delegation_id)
    raise JournalError(f"delegation {delegation_id} kept moving under this write; try again")


# A row moves a bounded number of times in its life (RUNNING, RECALLING, TERMINATING, an end),
# so a compare-and-set that keeps losing means something else is wrong.
_MOVE_TRIES = 8


CHUNK = 500  # rows per statement (SQLite allows 32766 parameters)


# States reach SQL as parameters, never as literals: which states a statement reads or moves
# is the core's set (``_core.model``, ``_core.outcome``), bound as ``IN ({marks(s)})`` with
# ``values(s)``, so no state is chosen in SQL.
def marks(items: Sized) -> str:
    """``?, ?, ...``: one placeholder per item, for an ``IN (...)`` list."""
    return ", ".join("?" * len(items))


def values(states: Collection[ActionState | DelegationState]) -> tuple[str, ...]:
    return tuple(sorted(s.value for s in states))


def chunks(items: Sequence[T], size: int = CHUNK) -> list[Sequence[T]]:
    """``items`` in slices of ``size``, for statements with an ``IN (...)`` list."""
    return [items[i:i + size] for i in range(0, len(items), size)]
