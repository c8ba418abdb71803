"""One writer thread per journal, group commit, never the event loop. Backends subclass it.

Operations queue to a dedicated thread. It takes everything queued, runs each operation in its
own SAVEPOINT inside one transaction, commits once, then resolves every caller's future. An
intent that waits for its commit therefore shares that commit (and its fsync) with whatever else
arrived meanwhile; a refused operation rolls back only its own savepoint. A transaction the
database aborts as a whole (a deadlock with another process, say) is retried from the start:
nothing of it was committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tether._core.errors import JournalError

T = TypeVar("T")
MAX_BATCH = 1024
RETRIES = 8


@dataclass
class Op:
    fn: Callable[[Any], Any]
    write: bool
    future: asyncio.Future[Any] | None


class Retry(Exception):
    """Raised by a backend's error mapping: roll the whole batch back and run it again."""


class ThreadRunner:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what a backend provides ----------------------------------------------------------
    def connect(self) -> Any:
        """Open and validate the connection (runs in a worker thread)."""
        raise NotImplementedError

    def close(self, conn: Any) -> None:
        conn.close()

    def begin(self, conn: Any, write: bool) -> None:
        raise NotImplementedError

    def db(self, conn: Any) -> Any:
        """What operations receive: a connection whose execute takes '?' placeholders."""
        return conn

    def map_error(self, exc: Exception) -> Exception:
        """A database error as a tether error; Retry for a transaction to run again."""
        return exc

    # -- the thread -----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn = await asyncio.to_thread(self.connect)
        self._thread = threading.Thread(target=self._work, name="tether-journal", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def submit(self, fn: Callable[[Any], T], *, write: bool,
               wait: bool = True) -> asyncio.Future[T] | None:
        if self._thread is None or self._loop is None:
            raise JournalError("journal is not open")
        future: asyncio.Future[T] | None = self._loop.create_future() if wait else None
        self._queue.put(Op(fn, write, future))
        return future

    def _work(self) -> None:
        conn = self._conn
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
            for attempt in range(RETRIES):
                try:
                    self._resolve(self._run_batch(conn, batch))
                    break
                except Retry as exc:
                    if attempt == RETRIES - 1:
                        err = JournalError(f"journal transaction kept failing: {exc}")
                        self._resolve([(op, None, err) for op in batch])
                except Exception as exc:
                    # Anything else (a connection lost at a SAVEPOINT, say) fails this batch
                    # with a clear error; the thread lives on, so no caller waits forever.
                    mapped = self.map_error(exc)
                    err = mapped if isinstance(mapped, JournalError) else JournalError(
                        f"journal write failed: {exc}")
                    self._resolve([(op, None, err) for op in batch])
                    break
        self.close(conn)

    def _run_batch(self, conn: Any, batch: list[Op]) -> list[tuple[Op, Any, Exception | None]]:
        done: list[tuple[Op, Any, Exception | None]] = []
        db = self.db(conn)
        try:
            self.begin(conn, any(op.write for op in batch))
        except Exception as exc:
            err = self.map_error(exc)
            if isinstance(err, Retry):
                raise err from None
            return [(op, None, err) for op in batch]
        alone = len(batch) == 1  # a lone operation needs no savepoint: ROLLBACK undoes it
        for op in batch:
            if not alone:
                conn.execute("SAVEPOINT op")
            try:
                value = op.fn(db)
            except Exception as exc:  # refused or failed: undo this operation only
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
                if not alone:
                    conn.execute("RELEASE SAVEPOINT op")
                done.append((op, value, None))
        try:
            conn.execute("COMMIT")
        except Exception as exc:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            err = self.map_error(exc)
            if isinstance(err, Retry):
                raise err from None
            done = [(op, None, err) for op, _, _ in done]
        return done

    def _resolve(self, done: list[tuple[Op, Any, Exception | None]]) -> None:
        waiting = [d for d in done if d[0].future is not None]
        if not waiting or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody is waiting
            self._loop.call_soon_threadsafe(_settle, waiting)


def _settle(done: list[tuple[Op, Any, Exception | None]]) -> None:
    for op, value, error in done:
        fut = op.future
        if fut is None or fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
