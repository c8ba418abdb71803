"""The embedded SQLite backend: one writer thread, group commit, never the event loop.

Operations queue to a dedicated thread. It takes everything queued, runs each operation in its
own SAVEPOINT inside one transaction, commits once, then resolves every caller's future. An
intent that waits for its commit therefore shares that commit (and its fsync) with whatever else
arrived meanwhile; a refused operation rolls back only its own savepoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tether._core.errors import (
    JournalCorrupt,
    JournalError,
    JournalLocked,
    NotAJournal,
    SchemaTooNew,
)
from tether._journal.schema import APP, MIGRATIONS, SCHEMA_VERSION

T = TypeVar("T")
SQLITE_MAGIC = b"SQLite format 3\x00"
MAX_BATCH = 1024


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    write: bool
    future: asyncio.Future[Any] | None


def _map_error(exc: sqlite3.Error, path: Path) -> JournalError:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return JournalLocked(f"journal {path} is locked by another writer ({text})")
    if "malformed" in text or "not a database" in text or "corrupt" in text:
        return JournalCorrupt(f"journal {path} is corrupted ({text})")
    return JournalError(f"journal {path}: {text}")


def _check_or_init(conn: sqlite3.Connection, path: Path, create: bool) -> None:
    """Refuse anything that is not a tether journal before writing a single byte to it."""
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise _map_error(exc, path) from None
    if "tether_meta" in names:
        row = conn.execute("SELECT value FROM tether_meta WHERE key = 'app'").fetchone()
        if row is None or row[0] != APP:
            raise NotAJournal(f"{path} is not a tether journal")
        found = int(conn.execute(
            "SELECT value FROM tether_meta WHERE key = 'schema_version'").fetchone()[0])
        if found > SCHEMA_VERSION:
            raise SchemaTooNew(found, SCHEMA_VERSION)
        if found < SCHEMA_VERSION:
            _migrate(conn, found)
        return
    if names:
        raise NotAJournal(f"{path} is a SQLite database but not a tether journal")
    if not create:
        raise NotAJournal(f"{path} is empty, not a tether journal")
    _migrate(conn, 0)


def _migrate(conn: sqlite3.Connection, found: int) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        for version in range(found + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
        conn.execute("INSERT OR REPLACE INTO tether_meta VALUES ('app', ?)", (APP,))
        conn.execute("INSERT OR REPLACE INTO tether_meta VALUES ('schema_version', ?)",
                     (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def connect(path: Path, *, create: bool, synchronous: str,
            busy_timeout: float) -> sqlite3.Connection:
    """Open and validate a journal file; raises a JournalError and leaves the file untouched
    if it is not a tether journal."""
    if path.exists():
        with path.open("rb") as fh:
            head = fh.read(16)
        if head and head != SQLITE_MAGIC:
            raise NotAJournal(f"{path} is not a tether journal (not a SQLite database)")
    elif not create:
        raise NotAJournal(f"no journal at {path}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=busy_timeout
    )
    try:
        _check_or_init(conn, path, create)
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss. NORMAL (durable=False) survives a process crash.
        # OFF is for measuring CPU cost only.
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
    except sqlite3.Error as exc:
        conn.close()
        raise _map_error(exc, path) from None
    except BaseException:
        conn.close()
        raise
    return conn


class SqliteRunner:
    """Runs journal operations on one connection in one thread, batching commits."""

    def __init__(self, path: Path, *, create: bool = True, synchronous: str = "FULL",
                 busy_timeout: float = 5.0) -> None:
        self.path = path
        self._create = create
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn = await asyncio.to_thread(
            connect, self.path, create=self._create, synchronous=self._synchronous,
            busy_timeout=self._busy_timeout,
        )
        self._thread = threading.Thread(target=self._work, name="tether-journal", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def submit(self, fn: Callable[[sqlite3.Connection], T], *, write: bool,
               wait: bool = True) -> asyncio.Future[T] | None:
        if self._thread is None or self._loop is None:
            raise JournalError("journal is not open")
        future: asyncio.Future[T] | None = self._loop.create_future() if wait else None
        self._queue.put(_Op(fn, write, future))
        return future

    def _work(self) -> None:
        conn = self._conn
        assert conn is not None
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if op is None:
                    stopping = True
                    break
                batch.append(op)
            self._run_batch(conn, batch)
        conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        done: list[tuple[_Op, Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN IMMEDIATE" if any(op.write for op in batch) else "BEGIN")
        except sqlite3.Error as exc:
            err = _map_error(exc, self.path)
            self._resolve([(op, None, err) for op in batch])
            return
        alone = len(batch) == 1  # a lone operation needs no savepoint: ROLLBACK undoes it
        for op in batch:
            if not alone:
                conn.execute("SAVEPOINT op")
            try:
                value = op.fn(conn)
            except Exception as exc:  # refused or failed: undo this operation only
                conn.execute("ROLLBACK" if alone else "ROLLBACK TO op")
                if not alone:
                    conn.execute("RELEASE op")
                mapped = _map_error(exc, self.path) if isinstance(exc, sqlite3.Error) else exc
                done.append((op, None, mapped))
                if alone:
                    self._resolve(done)
                    return
            else:
                if not alone:
                    conn.execute("RELEASE op")
                done.append((op, value, None))
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            err = _map_error(exc, self.path)
            done = [(op, None, err) for op, _, _ in done]
        self._resolve(done)

    def _resolve(self, done: list[tuple[_Op, Any, BaseException | None]]) -> None:
        waiting = [d for d in done if d[0].future is not None]
        if not waiting or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody is waiting
            self._loop.call_soon_threadsafe(_settle, waiting)


def _settle(done: list[tuple[_Op, Any, BaseException | None]]) -> None:
    for op, value, error in done:
        fut = op.future
        if fut is None or fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
