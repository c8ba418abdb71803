"""The journal's batches run inline on the event loop: for a simulation, never in production.

``InlineRunner`` runs the same batch code as the writer thread (``Runner._run``: savepoints per
operation, the seal before the COMMIT, a lost COMMIT read back before anything runs again),
but as one callback on the caller's event loop, ``latency`` seconds of loop time after the
first operation of the batch was submitted: whatever else is submitted meanwhile shares the
batch and its commit, as with the thread. Nothing else may run between a batch's BEGIN and its
COMMIT, so each batch is atomic even when several runners share one database.

``MemorySqlite`` is the backend: one in-memory SQLite database shared by every simulated
process of a trial (``file:NAME?mode=memory&cache=shared``), one connection per process.
Given a ``Bus``, it has PostgreSQL's notifications (``listen``, and ``notify`` on the
connection the operations get), delivered among the trial's processes on the loop.
``lose_commit`` is the seam for a lost commit reply: asked at each batch's COMMIT (told
whether the transaction wrote anything), it may say that the reply is lost after the COMMIT
("after") or that the connection broke before it ("before"); either way the runner sees a
lost connection at its COMMIT and reads back, from a commit marker the batch wrote (as on
PostgreSQL), whether it committed.
"""

from __future__ import annotations

import asyncio
import contextvars
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from tether._core.errors import JournalError
from tether._journal import sqlite as sqlite_backend
from tether._journal.runner import Backlog, Done, Op, Runner, _settle
from tether._journal.tables import Reply, Step, replies_each, send_each

T = TypeVar("T")
Loss = Literal["before", "after"] | None


class CommitLost(Exception):
    """The connection broke at a COMMIT (injected): its reply never came."""


class InlineRunner(Runner):
    """Operations run as batches on the loop itself; see the module's docstring."""

    # Long enough for a read-back to run (a reconnection on the loop never waits).
    reconnect_within = 5.0

    def __init__(self, latency: Callable[[], float] = lambda: 0.0,
                 alive: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self.latency = latency
        # False once the process is killed: its code may still run (a ``finally`` while its
        # coroutines are closed where they stand), but a killed process writes nothing more.
        self.alive = alive
        self.running = False  # a batch is running (a seal's work is inside one)
        self._pending = Backlog()  # the same choice of each batch as the writer thread's
        self._flush_due = False
        self._open = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn = self.connect()
        self._lost_at = None
        self._held = []
        self._open = True

    async def stop(self) -> None:
        if not self._open:
            return
        while self._pending and self.alive():
            self._flush()
        if self.alive():
            self._write_held()
        self._open = False
        conn, self._conn = self._conn, None
        self.close(conn)

    def submit(self, fn: Callable[[Any], T], *, write: bool, wait: bool = True,
               relaxed: bool = False, urgent: bool = False) -> asyncio.Future[T] | None:
        if not self._open or self._loop is None:
            raise JournalError("journal is not open")
        future: asyncio.Future[T] | None = self._loop.create_future() if wait else None
        self._pending.add(Op(fn, write, future, relaxed, urgent))
        self.outstanding += 1
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_later(self.latency(), self._flush)
        return future

    def _flush(self) -> None:
        self._flush_due = False
        if not self.alive():
            self._pending, self._held = Backlog(), []
            return
        batch = self._pending.take(self.room())
        if self._pending and self._loop is not None:
            self._flush_due = True
            self._loop.call_later(self.latency(), self._flush)
        if not batch and not self._held:
            return
        taken = len(batch)
        self.running = True
        try:
            self._run(batch)
        finally:
            self.running = False
        self.outstanding -= taken

    def _resolve(self, done: Done) -> None:
        _settle([d for d in done if d[0].future is not None])

    def monotonic(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0


class Bus:
    """The journal's notifications among a trial's processes, as PostgreSQL's LISTEN/NOTIFY
    gives them: a payload is heard by every listener once its transaction commits, never if it
    rolls back, after ``latency()`` seconds of loop time, in the context the listener listened
    from (so a crashed process hears nothing and a paused one hears when it resumes).
    ``lose()`` may drop one delivery: notifications are hints, and polling covers a lost one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, latency: Callable[[], float],
                 lose: Callable[[], bool] = lambda: False) -> None:
        self._loop, self._latency, self._lose = loop, latency, lose
        self._listeners: dict[int, tuple[Callable[[str], None], contextvars.Context]] = {}

    def listen(self, who: object, callback: Callable[[str], None]) -> None:
        # The first callback stays, as with PostgreSQL's listener (``PostgresRunner.listen``).
        self._listeners.setdefault(id(who), (callback, contextvars.copy_context()))

    def unlisten(self, who: object) -> None:
        self._listeners.pop(id(who), None)

    def deliver(self, payloads: list[str], lossless: bool = False) -> None:
        """``lossless``: what a listener tells itself (its own reconnection), not the wire."""
        for payload in payloads:
            for callback, context in list(self._listeners.values()):
                if lossless or not self._lose():
                    self._loop.call_later(self._latency(), callback, payload, context=context)


class Server:
    """The journal's server as a crash of it sees a trial's shared database: the commits that
    did not wait for the disk (``flush(durable=False)``, relaxed posts: PostgreSQL's
    ``synchronous_commit = off``, SQLite's ``synchronous=NORMAL``) since the last that did
    are lost with it, and every connection is cut. A commit that waited synced the log up to
    itself, so what is lost is always a suffix of the commits, never one in the middle.

    ``remember`` and ``restore`` carry along whatever a simulation keeps about the commits
    (its judge's record), taken and put back with the database."""

    def __init__(self, anchor: sqlite3.Connection, bus: Bus | None = None,
                 remember: Callable[[], Any] = lambda: None,
                 restore: Callable[[Any], None] = lambda _memo: None) -> None:
        self.anchor, self.bus = anchor, bus
        self._remember, self._restore = remember, restore
        self._image: tuple[sqlite3.Connection, Any] | None = None  # as the disk has it
        self._conns: list[_Conn] = []

    def connected(self, conn: _Conn) -> None:
        self._conns = [c for c in self._conns if not c.closed]
        self._conns.append(conn)

    def writing(self, relaxed: bool) -> None:
        """A write batch is about to begin (no other transaction is open: batches are
        atomic on the loop). The first relaxed one since the disk was synced keeps the
        database as the disk has it."""
        if relaxed and self._image is None:
            image = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self.anchor.backup(image)
            self._image = image, self._remember()

    def synced(self) -> None:
        """A write batch that waited for the disk committed: everything before it is safe."""
        if self._image is not None:
            self._image[0].close()
            self._image = None

    def crash(self) -> bool:
        """Lose every commit since the disk was last synced, and cut every connection (the
        next batch on one finds it broken and reconnects, as from a restarted server).
        False, and nothing happens, when there is nothing to lose."""
        if self._image is None:
            return False
        image, memo = self._image
        self._image = None
        for conn in self._conns:
            conn.close()
        self._conns = []
        image.backup(self.anchor)
        image.close()
        self._restore(memo)
        if self.bus is not None:  # the listeners' connections were cut too (``reconnected``)
            self.bus.deliver(["reconnected"], lossless=True)
        return True


class _Conn:
    """A connection whose COMMIT a fault may break (``MemorySqlite.lose_commit``), and whose
    ``notify`` queues a payload for the bus when its transaction commits (as ``pg_notify``):
    one rolled back, whole or to its savepoint, drops what it queued."""

    def __init__(self, inner: sqlite3.Connection, lose: Callable[[bool], Loss],
                 landed: Callable[[list[str]], None]) -> None:
        self.inner = inner
        self._lose = lose
        self._changes = inner.total_changes  # at BEGIN: whether a COMMIT writes anything
        self._landed = landed
        self.closed = False
        self._notes: list[str] = []
        self._savepoint = 0

    def notify(self, payload: str) -> None:
        self._notes.append(payload)

    def server_time(self) -> None:  # a simulation's processes share the loop's clock
        return None

    def send(self, steps: Sequence[Step], *, last: bool = False) -> None:
        send_each(self, steps)

    def replies(self, statements: Sequence[tuple[str, Any]]) -> list[Reply]:
        return replies_each(self, statements)

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if self.closed:
            raise CommitLost("the connection is closed")
        if sql == "COMMIT" and self.inner.in_transaction:
            notes, self._notes = self._notes, []
            loss = self._lose(self.inner.total_changes != self._changes)
            if loss == "before":
                self.inner.execute("ROLLBACK")
                self.close()
                raise CommitLost("connection lost before the COMMIT reached the database")
            cur = self.inner.execute(sql)
            self._landed(notes)
            if loss == "after":
                self.close()
                raise CommitLost("connection lost before the COMMIT's reply came back")
            return cur
        if sql.startswith("BEGIN") or sql == "ROLLBACK":
            self._notes = []
            self._changes = self.inner.total_changes
        elif sql == "SAVEPOINT op":
            self._savepoint = len(self._notes)
        elif sql == "ROLLBACK TO SAVEPOINT op":
            del self._notes[self._savepoint:]
        return self.inner.execute(sql, *args)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_TEMPLATE: sqlite3.Connection | None = None


def _template() -> sqlite3.Connection:
    """A journal made once per process, copied into each new shared database (``backup``):
    migrating the schema anew for every trial would cost more than the trial."""
    global _TEMPLATE
    if _TEMPLATE is None:
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        sqlite_backend._check_or_init(conn, Path(":memory:"), True)
        _TEMPLATE = conn
    return _TEMPLATE


def shared_database(name: str) -> sqlite3.Connection:
    """Create the shared in-memory journal ``name`` and return the connection that keeps it
    alive (close it to drop the database)."""
    anchor = sqlite3.connect(f"file:{name}?mode=memory&cache=shared", uri=True,
                             isolation_level=None, check_same_thread=False)
    _template().backup(anchor)
    return anchor


class MemorySqlite(InlineRunner):
    """One simulated process's runner on a trial's shared in-memory journal."""

    def __init__(self, name: str, *, latency: Callable[[], float] = lambda: 0.0,
                 lose_commit: Callable[[bool], Loss] = lambda wrote: None,
                 mark: str = "commit",
                 on_commit: Callable[[MemorySqlite], None] | None = None,
                 bus: Bus | None = None,
                 on_refusal: Callable[[str], None] | None = None,
                 server: Server | None = None,
                 alive: Callable[[], bool] = lambda: True) -> None:
        super().__init__(latency, alive)
        self.name = name
        self.server = server  # a crash of it loses the relaxed commits not synced yet
        self._relaxed = False  # the batch about to begin may skip the disk (``relax``)
        # The batch begun: None (a read), or whether its commit may skip the disk.
        self.relaxed_write: bool | None = None
        self.lose_commit = lose_commit
        self.bus = bus
        self.on_refusal = on_refusal  # told of each write the schema's constraints refused
        # Told of every COMMIT that took effect (replies lost or not), for the simulation's
        # record of commit order; ``staged`` is what the batch gave its sealer.
        self.on_commit = on_commit
        self.staged: list[tuple[str, Any]] = []
        self._mark_key = f"commit:{mark}"  # this runner's commit marker (``committed``)
        self._mark = 0

    def connect(self) -> _Conn:
        inner = sqlite3.connect(f"file:{self.name}?mode=memory&cache=shared", uri=True,
                                isolation_level=None, check_same_thread=False)
        inner.execute("PRAGMA foreign_keys=ON")
        conn = _Conn(inner, self.lose_commit, self._landed)
        if self.server is not None:
            self.server.connected(conn)
        return conn

    def relax(self, conn: Any, relaxed: bool) -> None:
        self._relaxed = relaxed

    def _landed(self, notes: list[str]) -> None:
        if self.server is not None and self.relaxed_write is False:
            self.server.synced()
        if self.on_commit is not None:
            self.on_commit(self)
        if notes and self.bus is not None:
            self.bus.deliver(notes)

    def listen(self, callback: Callable[[str], None]) -> bool:
        if self.bus is None:
            return False
        self.bus.listen(self, callback)
        return True

    def close(self, conn: Any) -> None:
        if self.bus is not None:
            self.bus.unlisten(self)
        if conn is not None:
            conn.close()

    def begin(self, conn: _Conn, write: bool) -> None:
        self.staged = []
        self.relaxed_write = self._relaxed if write else None
        if write and self.server is not None:
            self.server.writing(self._relaxed)
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        if write:  # the marker a read-back after a lost COMMIT looks for
            self._mark += 1
            conn.execute("INSERT INTO tether_meta (key, value) VALUES (?, ?) ON CONFLICT (key) "
                         "DO UPDATE SET value = excluded.value", (self._mark_key, str(self._mark)))

    def committed(self, conn: _Conn) -> bool:
        rows = conn.execute("SELECT value FROM tether_meta WHERE key = ?",
                            (self._mark_key,)).fetchall()  # to the end: no lock left held
        return bool(rows) and rows[0][0] == str(self._mark)

    def is_lost(self, conn: Any, exc: BaseException) -> bool:
        return isinstance(exc, CommitLost) or bool(getattr(conn, "closed", False))

    def where(self) -> str:
        return f"simulated journal {self.name}"

    def map_error(self, exc: Exception) -> Exception:
        if isinstance(exc, sqlite3.IntegrityError) and self.on_refusal is not None:
            self.on_refusal(str(exc))
        if isinstance(exc, sqlite3.Error):
            return sqlite_backend._map_error(exc, Path(self.name))
        return exc


__all__ = ["Bus", "CommitLost", "InlineRunner", "MemorySqlite", "Server", "shared_database"]
