"""One writer thread per journal, group commit, never the event loop. Backends subclass it.

Operations queue to a dedicated thread. It takes everything queued, runs each operation in its
own SAVEPOINT inside one transaction, commits once, then resolves every caller's future. An
intent that waits for its commit therefore shares that commit (and its fsync) with whatever else
arrived meanwhile; a refused operation rolls back only its own savepoint. A transaction the
database aborts as a whole (a deadlock with another process, say) is retried from the start:
nothing of it was committed.

A lost connection (a server restart, a terminated backend) is an ordinary event for a backend
that can reconnect (PostgreSQL): the thread reconnects with bounded backoff for up to
``reconnect_within`` seconds and runs the batch again. A batch lost before its COMMIT was sent
committed nothing; one lost around its COMMIT is looked up (the backend's ``committed``: a
marker the batch wrote) before anything is run again, so nothing is guessed and nothing runs
twice. Whatever happens, the thread never leaves an operation waiting: a batch it cannot run
fails with a JournalError, and if the thread itself ends, everything queued fails with it. A
server that stops answering without closing anything (a paused host) is the one case a client
cannot see by itself: a watchdog cuts a connection that has been busy for longer than
``stall_after()`` seconds, which turns it into a lost connection like any other.

The batch itself (``Runner``) and the choice of what goes into it (``Backlog``) are shared
with the inline runner a simulation uses (``tether._journal.inline``); only the writer thread
(``tether._journal.writer``) has a thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tether._core.errors import JournalError
from tether._journal.tables import Tx

T = TypeVar("T")
log = logging.getLogger("tether.journal")
MAX_BATCH = 1024
# The share of a batch urgent operations may take when others wait too: a storm of recalls
# never makes a batch longer than any other, nor holds the receipts behind it for long.
URGENT_SHARE = MAX_BATCH // 2
# A batch of posted writes alone (receipts nobody waits for) waits this long for one more
# operation before it runs: a child's next intent, right behind its receipt, then shares its
# transaction instead of running a second one (its BEGIN, chain, seal and COMMIT).
POSTED_WAIT = 0.001
RETRIES = 8
BACKOFF_FIRST, BACKOFF_MAX = 0.05, 1.0  # seconds between reconnection attempts
STOP_WAIT = 10.0  # how long closing waits for a thread stuck on a server that does not answer
MAX_HELD = 10_000  # posted writes kept through an outage; beyond it, lost as to a crash


@dataclass
class Op:
    fn: Callable[[Any], Any]
    write: bool
    future: asyncio.Future[Any] | None
    # Its caller needs the commit to survive a crash of this process, not of the machine:
    # a batch of such operations (and posted ones) commits without waiting for the disk
    # (``relax``); the next durable commit makes it durable too (the same log, in order).
    relaxed: bool = False
    # A control intent (the fence) and the read before it: into the next batch, ahead of a
    # backlog of other writes (``Backlog``).
    urgent: bool = False
    order: int = 0  # its place in submission order (``Backlog.add``)


Done = list[tuple[Op, Any, Exception | None]]
# Called at the end of a write batch, before its COMMIT, with the records it wrote.
Sealer = Callable[[Any, list[tuple[str, Any]]], None]


class Retry(Exception):
    """Raised by a backend's error mapping: roll the whole batch back and run it again."""


class Careful(Exception):
    """An operation of a batch run without savepoints failed: the batch was rolled back, to
    run again with a savepoint around each operation."""


class Lost(Exception):
    """The connection broke under a batch. ``at_commit``: its COMMIT had been sent, so whether
    it committed is unknown until the journal is read back; ``done`` is what it computed."""

    def __init__(self, cause: BaseException, at_commit: bool, done: Done | None = None,
                 tx: Any = None) -> None:
        super().__init__(str(cause).strip() or type(cause).__name__)
        self.at_commit = at_commit
        self.done = done or []
        self.tx = tx  # the batch's connection (its ``Tx.after``, run if it committed)


class Runner:
    """What a journal runs its operations with. The batch, its savepoints, its seal, its
    COMMIT and the read-back of a COMMIT lost on the way live here, shared by every way of
    running them: a writer thread (``ThreadRunner``, every backend in production) or inline on
    a simulation's event loop (``tether._journal.inline``). Subclasses say only how operations
    reach a batch and how a batch's answers reach their callers."""

    #: Seconds to keep reconnecting after a connection is lost before failing what waits
    #: (0: the backend does not reconnect).
    reconnect_within: float = 0.0
    #: Whether the backend can cut a connection from another thread (``interrupt``).
    watched = False

    def __init__(self) -> None:
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: list[Op] = []
        self.reconnects = 0  # connections re-opened after a loss (for tests and figures)
        self._busy_since: float | None = None  # when the batch on the wire was sent
        # When the connection was first lost since a batch last committed: an outage lasts
        # until one does (a server that takes connections but breaks every batch is down).
        self._lost_at: float | None = None
        # Posted writes (receipts) whose batch failed for want of a connection: nobody waits
        # for them, so nobody would write them again. They run first once it is back, so a
        # child that ends after the outage does not end with its receipt missing.
        self._held: list[Op] = []
        self.sealer: Sealer | None = None  # set by the Journal (``chainops.seal``)
        # Operations submitted whose batch has not answered yet (``busy``).
        self.outstanding = 0
        self.stop_wait = STOP_WAIT  # how long closing waits for a batch stuck on its server

    def sync_log(self) -> bool:
        """Put on disk what is committed, without writing (False: this backend cannot)."""
        return False

    # -- how it runs (a thread, or a simulation's loop) -----------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def submit(self, fn: Callable[[Any], T], *, write: bool, wait: bool = True,
               relaxed: bool = False, urgent: bool = False) -> asyncio.Future[T] | None:
        """Queue ``fn`` for a batch (``Backlog``); ``urgent``: ahead of a backlog."""
        raise NotImplementedError

    def _resolve(self, done: Done) -> None:
        """Hand each waiting caller its answer, on its event loop."""
        raise NotImplementedError

    def monotonic(self) -> float:
        """The clock reconnection windows and late renewals are judged on (the event loop's
        in production: ``time.monotonic``)."""
        return time.monotonic()

    def closing(self) -> bool:
        return False

    def pause(self, seconds: float) -> None:
        """Wait between two reconnection attempts (ended early by closing)."""

    # -- what a backend provides ----------------------------------------------------------
    def connect(self) -> Any:
        """Open and validate the connection (runs in a worker thread)."""
        raise NotImplementedError

    def close(self, conn: Any) -> None:
        """End the backend's use of the journal (``conn`` is None if it was lost)."""
        if conn is not None:
            conn.close()

    def begin(self, conn: Any, write: bool) -> None:
        raise NotImplementedError

    def listen(self, callback: Callable[[str], None]) -> bool:
        """Have ``callback(payload)`` called (from any thread) for each notification an
        operation sent (``notify`` on its connection) once its transaction commits. False
        where the backend cannot push: its readers poll."""
        return False

    def relax(self, conn: Any, relaxed: bool) -> None:
        """Before ``begin``: whether the next commit may skip waiting for the disk."""

    def db(self, conn: Any) -> Any:
        """What operations receive: a connection whose execute takes '?' placeholders."""
        return conn

    def map_error(self, exc: Exception) -> Exception:
        """A database error as a tether error; Retry for a transaction to run again."""
        return exc

    def is_lost(self, conn: Any, exc: BaseException) -> bool:
        """Whether ``exc`` means the connection is gone (and another may be opened)."""
        return False

    def after_op(self, conn: Any) -> None:
        """After an operation returned: raise if it left its transaction unable to go on (it
        caught a statement's error), so that it fails, alone, as if it had raised."""

    def before_commit(self, conn: Any) -> None:
        """Before a batch's COMMIT: make sure its transaction reached the server (a backend
        whose statements may wait for the next one), so that a connection lost with the
        COMMIT is the only loss that can leave the batch in doubt."""

    def committed(self, conn: Any) -> bool:
        """On a fresh connection: whether the last write batch, lost around its COMMIT,
        committed. Waits for that transaction if the server still runs it."""
        raise NotImplementedError

    def where(self) -> str:
        return "journal"

    def landed(self, conn: Any, sync: bool = False) -> None:
        """After a write batch's COMMIT: raise a JournalError if it did not land where the
        journal's readers look (a file deleted or replaced while the batch ran). ``sync``:
        leave the log synced, whatever the batch wrote (a PostgreSQL write batch always
        writes its marker, so its durable COMMIT flushed the log past whatever it read)."""

    def interrupt(self, conn: Any) -> None:
        """From another thread: make whatever ``conn`` waits for fail as a lost connection."""

    def stall_after(self) -> float:
        """Seconds a batch may be on the wire before the watchdog cuts its connection."""
        return max(2.0, self.reconnect_within)

    def backoff_cap(self) -> float:
        """The longest wait between reconnection attempts: short next to the window, so that a
        server back with a moment of it left is found in time (a worker's window is its
        lease, and a second's step would use up a third of a 3 s one)."""
        return max(BACKOFF_FIRST, min(BACKOFF_MAX, self.reconnect_within / 20))

    # -- running a batch (shared) ---------------------------------------------------------
    def _fail(self, batch: list[Op], err: Exception) -> None:
        self._resolve([(op, None, err) for op in batch])

    def _run(self, batch: list[Op], alone: bool = False) -> None:
        """Run one batch to an answer for every operation in it. ``alone``: without what an
        outage held (itself a part of that)."""
        attempt = 0
        careful = False  # each operation in a savepoint of its own (``_run_batch``)
        deadline: float | None = None  # set by the first lost connection
        losses, delay = 0, BACKOFF_FIRST  # connections lost under this batch
        while True:
            if self._conn is None:  # lost earlier, or under this batch
                if deadline is None:
                    # The window runs from the loss, not from each batch: once it is over,
                    # every later batch gets one attempt to connect and fails at once, rather
                    # than each waiting a window of its own (a supervisor settling its
                    # children on SIGTERM, with the server down, took batches x windows).
                    deadline = (self._lost_at or self.monotonic()) + self.reconnect_within
                if not self._reconnect(deadline):
                    self._hold(batch)
                    self._fail(batch, self._gone(deadline))
                    return
            if self._held and not alone:  # what an outage left, before what came after it
                room = max(0, MAX_BATCH - len(batch))
                # Every held receipt commits before an operation queued after it; an urgent
                # one skips them (``Backlog``). More than fit (the connection came back under
                # this batch): the rest first, in batches of their own.
                while any(not op.urgent for op in batch) and len(self._held) > room \
                        and self._conn is not None:
                    part, self._held = self._held[:MAX_BATCH], self._held[MAX_BATCH:]
                    self._run(part, alone=True)
                if self._conn is None:  # lost again meanwhile: a loss of this batch's too
                    losses += 1
                    if deadline is None:
                        deadline = (self._lost_at or self.monotonic()) + self.reconnect_within
                    if losses > 1 and self.monotonic() >= deadline:
                        self._hold(batch)
                        self._fail(batch, self._gone(deadline))
                        return
                    continue  # connect, or fail this batch
                batch[:0], self._held = self._held[:room], self._held[room:]
            try:
                self._busy_since = self.monotonic()
                try:
                    done = self._run_batch(self._conn, batch, careful)
                finally:
                    self._busy_since = None
                self._lost_at = None  # a batch went through: whatever outage there was is over
                self._resolve(done)
                return
            except Careful:
                careful = True  # one of them failed: run it again, each undone alone
            except Retry as exc:
                attempt += 1
                if attempt == RETRIES:
                    self._fail(batch, JournalError(f"journal transaction kept failing: {exc}"))
                    return
            except Lost as lost:
                self._drop()
                if deadline is None:
                    deadline = (self._lost_at or self.monotonic()) + self.reconnect_within
                if self.reconnect_within <= 0:
                    self._fail(batch, JournalError(f"lost the {self.where()}: {lost}"))
                    return
                if lost.at_commit:
                    outcome = self._read_back(deadline)
                    if outcome is None:
                        self._hold(batch)  # receipts are safe to write twice
                        self._fail(batch, JournalError(
                            f"lost the {self.where()} while committing, and could not read "
                            f"back within {self.reconnect_within:g} s whether the commit "
                            f"happened: {lost}"))
                        return
                    if outcome:
                        self._lost_at = None
                        _after(lost.tx)
                        self._resolve(lost.done)
                        return
                # Nothing of it committed: run it again on a new connection, within the
                # window. A server that takes connections but breaks every batch, or a batch
                # the watchdog cuts each time, fails then, never loops for ever.
                losses += 1
                left = deadline - self.monotonic()
                if left <= 0:
                    self._hold(batch)
                    self._fail(batch, JournalError(
                        f"lost the {self.where()} under this batch {losses} times in "
                        f"{self.reconnect_within:g} s: {lost}"))
                    return
                if losses > 1:
                    self.pause(min(delay, left))
                    delay = min(delay * 2, self.backoff_cap())
            except Exception as exc:
                # Anything else fails this batch with a clear error; the thread lives on,
                # so no caller waits for ever.
                mapped = self.map_error(exc)
                err = mapped if isinstance(mapped, JournalError) else JournalError(
                    f"journal write failed: {exc}")
                self._fail(batch, err)
                return

    def _hold(self, batch: list[Op]) -> None:
        if self.closing():
            return  # closing: lost as to a crash, settled by reconciliation
        # In the order they were posted (some come back from a batch that carried the oldest
        # of those already held): a later heartbeat must not be overwritten by an earlier one.
        posted = [op for op in batch if op.future is None and op.write]
        self._held = sorted([*self._held, *posted], key=lambda op: op.order)[:MAX_HELD]

    def _gone(self, deadline: float) -> JournalError:
        if self.closing():
            return JournalError(f"{self.where()} closed while reconnecting")
        return JournalError(f"lost the {self.where()} and could not reconnect within "
                            f"{self.reconnect_within:g} s")

    def _drop(self) -> None:
        if self._lost_at is None:
            self._lost_at = self.monotonic()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _reconnect(self, deadline: float) -> bool:
        """Open a new connection, with bounded backoff, until the deadline or closing."""
        delay = BACKOFF_FIRST
        while not self.closing():
            try:
                self._conn = self.connect()
                self.reconnects += 1
                return True
            except Exception:
                left = deadline - self.monotonic()
                if left <= 0:
                    return False
                self.pause(min(delay, left))
                delay = min(delay * 2, self.backoff_cap())
        return False

    def _read_back(self, deadline: float) -> bool | None:
        """Whether the batch lost at its COMMIT committed; None if that cannot be read within
        the window (a read-back lost again and again: a COMMIT hung on a missing standby,
        whose lock the read waits on until the watchdog cuts it)."""
        delay = BACKOFF_FIRST
        while True:
            if self._conn is None and not self._reconnect(deadline):
                return None
            self._busy_since = self.monotonic()
            try:
                return self.committed(self._conn)
            except Exception as exc:
                if not self.is_lost(self._conn, exc):
                    return None
                self._drop()
            finally:
                self._busy_since = None
            left = deadline - self.monotonic()
            if left <= 0:
                return None
            self.pause(min(delay, left))
            delay = min(delay * 2, self.backoff_cap())

    def _write_held(self) -> None:
        """At a close: receipts an outage held, with the connection back, written rather than
        left for reconciliation to probe (one attempt each: closing, a lost connection is not
        waited for, and what it held is dropped as at a crash)."""
        while self._held and self._conn is not None:
            self._run([])
        self._held = []  # not to a later opening: reconciliation settles their calls

    def room(self) -> int:
        """How much of the next batch operations queued since may fill, beside what an outage
        held (``_run`` puts it first). Held receipts were posted before anything queued now,
        so each commits first: a flush or a read queued after one never answers before it is
        written. An urgent operation (a fence) skips them, as it skips the backlog."""
        if self._conn is None:
            return MAX_BATCH  # nothing is written before a connection: ``_run`` orders them
        return max(0, MAX_BATCH - len(self._held))

    def op_mark(self) -> int:
        """Where an operation's notifications begin among those its batch queued (a backend
        that queues them itself): a failed one's are dropped with it (``op_undone``), as a
        NOTIFY inside a savepoint rolled back is on PostgreSQL."""
        return 0

    def op_undone(self, mark: int) -> None:
        pass

    def _run_batch(self, conn: Any, batch: list[Op], careful: bool = False) -> Done:
        """Run ``batch`` in one transaction. At first without a savepoint per operation (two
        statements each, two round trips on PostgreSQL): if one of them fails, the whole
        transaction is rolled back and ``Careful`` raised, for the batch to run again with
        them (``careful``), where a failed operation is undone alone. So an operation may run
        more than once: it keeps nothing outside the journal that depends on what it read or
        wrote until its batch committed (``Tx.after``)."""
        done: Done = []
        write = any(op.write for op in batch)
        db = Tx(self.db(conn)) if write and self.sealer is not None else self.db(conn)
        dirty = db.dirty if isinstance(db, Tx) else None
        relaxed = relaxed_batch(batch)
        if isinstance(db, Tx):
            db.relaxed = relaxed
        try:
            self.relax(conn, relaxed)
            self.begin(conn, write)
        except Exception as exc:
            if self.is_lost(conn, exc):
                raise Lost(exc, at_commit=False) from exc
            err = self.map_error(exc)
            if isinstance(err, Retry):
                raise err from None
            return [(op, None, err) for op in batch]
        alone = len(batch) == 1  # a lone operation needs no savepoint: ROLLBACK undoes it
        marked = careful and not alone
        start = self.op_mark()
        try:
            for op in batch:
                if marked:
                    conn.execute("SAVEPOINT op")
                mark = db.mark() if isinstance(db, Tx) else None
                queued = self.op_mark()
                try:
                    value = op.fn(db)
                    self.after_op(conn)
                except Exception as exc:  # refused or failed: undo this operation only
                    if mark is not None:
                        db.undo(mark)  # what it wrote and meant to remember goes with it
                    self.op_undone(queued)  # and what it notified
                    if self.is_lost(conn, exc):
                        raise
                    if not alone and not marked:  # judged (``map_error``) on the careful run
                        with contextlib.suppress(Exception):
                            conn.execute("ROLLBACK")
                        self.op_undone(start)
                        raise Careful from None
                    mapped = self.map_error(exc)
                    with contextlib.suppress(Exception):
                        conn.execute("ROLLBACK" if alone or isinstance(mapped, Retry)
                                     else "ROLLBACK TO SAVEPOINT op")
                    if isinstance(mapped, Retry):
                        raise mapped from None
                    if alone:
                        return [(op, None, mapped)]
                    conn.execute("RELEASE SAVEPOINT op")
                    done.append((op, None, mapped))
                else:
                    if marked:
                        conn.execute("RELEASE SAVEPOINT op")
                    done.append((op, value, None))
            if dirty:
                assert self.sealer is not None
                try:
                    self.sealer(db, dirty)
                except Exception as exc:
                    if self.is_lost(conn, exc):
                        raise
                    # Nothing of the batch commits unsealed: every operation fails with it.
                    return self._abandon(conn, batch, exc,
                                         "the journal could not chain this batch's records")
            try:
                self.before_commit(conn)
            except Exception as exc:
                if self.is_lost(conn, exc):
                    raise
                return self._abandon(conn, batch, exc, "journal write failed")
        except (Retry, Careful):
            raise
        except Exception as exc:
            if self.is_lost(conn, exc):  # before COMMIT: nothing of it committed
                raise Lost(exc, at_commit=False) from exc
            raise
        try:
            conn.execute("COMMIT")
        except Exception as exc:
            if self.is_lost(conn, exc):
                raise Lost(exc, at_commit=write, done=done, tx=db) from exc
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            err = self.map_error(exc)
            if isinstance(err, Retry):
                raise err from None
            done = [(op, None, err) for op, _, _ in done]
            return done
        if write:
            try:
                self.landed(conn, sync=isinstance(db, Tx) and db.sync_log)
            except JournalError as err:  # committed where nobody will read it: not journaled
                done = [(op, None, err) for op, _, _ in done]
                return done
            _after(db)
        return done

    def _abandon(self, conn: Any, batch: list[Op], exc: Exception, what: str) -> Done:
        """After its operations, the batch failed (its seal, or reaching the server):
        rolled back, and every operation fails with it (or it runs again: ``Retry``)."""
        with contextlib.suppress(Exception):
            conn.execute("ROLLBACK")
        mapped = self.map_error(exc)
        if isinstance(mapped, Retry):
            raise mapped from None
        err = mapped if isinstance(mapped, JournalError) else JournalError(f"{what}: {exc!r}")
        return [(op, None, err) for op in batch]


def _after(db: Any) -> None:
    """Once a batch is known to have committed: what its operations deferred to then. The
    batch committed whatever happens here: a failure is logged, never the batch's (the
    registry's memory keeps a mark it could not save, and saves it at its next look or when
    the journal closes, ``Journal.close``)."""
    if isinstance(db, Tx) and db.after:
        after, db.after = db.after, []
        for then in after:
            try:
                then()
            except Exception as exc:
                log.warning("after a commit: %s", exc)


class Backlog:
    """Operations waiting for a batch, and which go into the next one: urgent operations (a
    control intent: the fence) first, so that an intent waits for the batch running when it
    came, never for a backlog of receipts and events queued before it; then the others in
    the order they came. Urgent ones take at most ``URGENT_SHARE`` of a batch others wait
    for. A batch runs its operations in submission order: an urgent operation skips the
    backlog, never what shares its batch, so every batch is a serial history in which the
    intent came a little earlier. Touched by one thread (the writer's, or the loop's)."""

    def __init__(self, cap: int = MAX_BATCH) -> None:
        self.cap = cap  # a batch's length at most (smaller in a simulation: more backlog)
        self._urgent: collections.deque[Op] = collections.deque()
        self._normal: collections.deque[Op] = collections.deque()
        self._order = 0
        self._waited = 0  # operations someone waits for (not posted)

    def __len__(self) -> int:
        return len(self._urgent) + len(self._normal)

    def add(self, op: Op) -> None:
        self._order += 1
        op.order = self._order
        self._waited += op.future is not None
        (self._urgent if op.urgent else self._normal).append(op)

    def posted_only(self) -> bool:
        """Whether nobody waits for any operation waiting (receipts alone)."""
        return self._waited == 0

    def take(self, room: int = MAX_BATCH) -> list[Op]:
        """The next batch, at most ``cap`` operations, in submission order. ``room``: how many
        fit beside what an outage held (``Runner.room``), which goes first. The others join
        only within it, so that none of them commits before a receipt posted earlier; urgent
        ones skip those receipts as they skip the backlog."""
        cap, urgent, normal = self.cap, self._urgent, self._normal
        share = max(1, cap * URGENT_SHARE // MAX_BATCH) if normal else cap
        batch = [urgent.popleft() for _ in range(min(share, len(urgent)))]
        skipped = bool(batch)
        limit, others = min(cap, room), 0
        # Never an operation past an urgent one left for later: each still commits no later
        # than everything submitted before it but the urgent ones it skipped (a flush's
        # promise), so others wait their turn behind a storm's remainder.
        while len(batch) < limit and normal and (not urgent or normal[0].order < urgent[0].order):
            batch.append(normal.popleft())
            others += 1
        top = limit if others else cap
        batch += [urgent.popleft() for _ in range(min(top - len(batch), len(urgent)))]
        if skipped:
            batch.sort(key=lambda op: op.order)
        self._waited -= sum(op.future is not None for op in batch)
        return batch

    def drain(self) -> list[Op]:
        """Everything waiting, in submission order, and nothing left."""
        ops = sorted([*self._urgent, *self._normal], key=lambda op: op.order)
        self._urgent.clear()
        self._normal.clear()
        self._waited = 0
        return ops


def relaxed_batch(batch: list[Op]) -> bool:
    """Durable unless someone asked for less and nobody waiting asked for more (posted
    operations wait for no commit, so they ride either kind)."""
    return any(op.relaxed for op in batch) and \
        all(op.relaxed or op.future is None for op in batch)


def _settle(done: Done) -> None:
    for op, value, error in done:
        fut = op.future
        if fut is None or fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
