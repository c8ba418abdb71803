"""The journal's writer thread (``ThreadRunner``): every backend's runner in production.

Operations queue to one thread per journal; it moves them into its ``Backlog`` and runs each
batch the backlog chooses with ``Runner._run`` (savepoints, seal, COMMIT, read-back). A
watchdog cuts a connection busy for longer than ``stall_after()`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from tether._core.errors import JournalError
from tether._journal.runner import MAX_BATCH, POSTED_WAIT, Backlog, Done, Op, Runner, _settle

T = TypeVar("T")


_OPEN: weakref.WeakSet[ThreadRunner] = weakref.WeakSet()


def busy() -> bool:
    """Whether an open journal of this process has work on one of its threads that will answer
    an event loop. A test clock moves time on its own only when none has
    (``VirtualClock.autojump``): a loop waiting for a commit is not waiting for time."""
    return any(r.outstanding > 0 for r in list(_OPEN) if r._thread is not None
               or (r._abandoned is not None and r._abandoned.is_alive() and r._answering))




class ThreadRunner(Runner):
    """One writer thread per journal: operations queue to it, it takes what is queued as one
    batch (``Backlog``: a control intent first), and answers each caller on its event loop."""

    def __init__(self) -> None:
        super().__init__()
        # The hand-off from the event loop; the writer thread moves what comes into its
        # backlog, which chooses each batch.
        self._queue: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._backlog = Backlog()
        # The backlog is the writer's, but a close that gave up on a stuck writer empties it
        # from the loop's thread: each operation is then either run or failed, never both.
        self._taking = threading.Lock()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # submit against the thread's end
        self._dead = False
        self._closing = threading.Event()
        # The writer a close gave up on (stuck on a server that does not answer): until it has
        # ended, it still reads this queue and this runner's connection.
        self._abandoned: threading.Thread | None = None
        # Whether it still answers the loop: after a cancelled close, yes; after a close that
        # gave up on it, no (every caller was answered then).
        self._answering = False
        _OPEN.add(self)

    def closing(self) -> bool:
        return self._closing.is_set()

    def pause(self, seconds: float) -> None:
        self._closing.wait(seconds)

    async def start(self) -> None:
        if self._thread is not None:
            raise JournalError(f"{self.where()} is open already")  # a second writer otherwise
        if self._abandoned is not None:
            if self._abandoned.is_alive():
                # A second thread on the same queue and connection: two writers, one file.
                raise JournalError(
                    f"{self.where()} is still held by the writer of its last opening, whose "
                    "last call never returned; open it again once that call has ended, or "
                    "open a new Journal")
            self._abandoned = None
        self._loop = asyncio.get_running_loop()
        # Each opening has a queue and a backlog of its own: an end of queue the last
        # opening's writer never read must not end this one's.
        self._queue = queue.SimpleQueue()
        self._backlog = Backlog()
        self._held = []
        self._closing.clear()  # a journal may be opened again after it was closed
        self._dead = False
        self._lost_at = None
        self._conn = await asyncio.to_thread(self.connect)
        self._thread = threading.Thread(target=self._work, name="tether-journal", daemon=True)
        self._thread.start()
        if self.watched:
            threading.Thread(target=self._watch, args=(self._thread,),
                             name="tether-journal-watchdog", daemon=True).start()

    def _watch(self, writer: threading.Thread) -> None:
        while True:
            writer.join(0.25)
            if not writer.is_alive():
                return
            busy, conn = self._busy_since, self._conn
            if busy is not None and conn is not None and \
                    time.monotonic() - busy > self.stall_after():
                self._busy_since = None
                with contextlib.suppress(Exception):
                    self.interrupt(conn)

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._closing.set()  # ends a reconnection loop at once
        self._queue.put(None)
        try:
            await asyncio.to_thread(thread.join, self.stop_wait)
        finally:
            # Cancelled while it waited, too: closed all the same, and not opened again
            # while that writer lives (it ends at the end of the queue, after what it holds).
            self._thread = None
            if thread.is_alive():
                self._abandoned, self._answering = thread, True
        if thread.is_alive():
            # Stuck in a call to a server that does not answer (a paused host): never wait on
            # it for ever. What it holds fails here; its late answer finds the futures done.
            err = JournalError(f"{self.where()} did not answer; closed without it")
            _settle([(op, None, err) for op in [*self._inflight, *self._drain()]
                     if op.future is not None])
            self._answering = False  # every caller is answered: nothing waits for it
            # The drain took the end of the queue too: the writer ends once its call returns
            # (its own ending then counts nothing outstanding and closes its connection).
            self._queue.put(None)
            await asyncio.to_thread(self.close, None)

    def submit(self, fn: Callable[[Any], T], *, write: bool, wait: bool = True,
               relaxed: bool = False, urgent: bool = False) -> asyncio.Future[T] | None:
        if self._thread is None or self._loop is None:
            raise JournalError("journal is not open")
        future: asyncio.Future[T] | None = self._loop.create_future() if wait else None
        with self._lock:
            if self._dead:
                if future is None:
                    return None  # a posted write to a journal already lost: as after a crash
                raise JournalError(f"{self.where()} is no longer available")
            self._queue.put(Op(fn, write, future, relaxed, urgent))
            self.outstanding += 1
        return future

    def _drain(self) -> list[Op]:
        with self._taking:
            ops = self._backlog.drain()
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return ops
            if op is not None:
                ops.append(op)

    def _work(self) -> None:
        reason = "journal is closed"
        try:
            self._serve()
        except BaseException as exc:  # never end with operations waiting
            reason = f"the journal's writer stopped: {exc!r}"
            raise
        finally:
            with self._lock:
                self._dead = True
            err = JournalError(reason)
            self._resolve([(op, None, err) for op in [*self._inflight, *self._drain()]])
            with self._lock:
                self.outstanding = 0
            self._inflight = []
            with contextlib.suppress(Exception):
                self.close(self._conn)
            self._conn = None

    def _serve(self) -> None:
        stopping = False
        backlog = self._backlog
        while backlog or not stopping:
            if not backlog:
                first = self._queue.get()
                if first is None:
                    break
                with self._taking:
                    backlog.add(first)
            if not stopping:
                stopping = self._gather()
            with self._taking:
                batch = backlog.take(self.room())
            if not batch and not self._held:  # a close that gave up emptied the backlog
                continue
            self._inflight = batch
            taken = len(batch)  # before _run prepends what an outage held (counted already)
            self._run(batch)
            self._inflight = []
            with self._lock:
                self.outstanding -= taken
        self._write_held()

    def _gather(self) -> bool:
        """Move what is queued into the backlog; whether the journal is closing (what came
        before its close still runs, in batches). Posted writes alone wait for one more
        operation until ``POSTED_WAIT`` after the first (a deadline: a steady trickle of
        them never holds the first back longer)."""
        backlog = self._backlog
        until = self.monotonic() + POSTED_WAIT
        while True:
            left = until - self.monotonic() \
                if len(backlog) < MAX_BATCH and backlog.posted_only() else 0.0
            try:
                op = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return False
            if op is None:
                return True
            with self._taking:
                backlog.add(op)

    def _resolve(self, done: Done) -> None:
        waiting = [d for d in done if d[0].future is not None]
        if not waiting or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody is waiting
            self._loop.call_soon_threadsafe(_settle, waiting)
