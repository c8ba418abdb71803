"""A deterministic asyncio event loop: virtual time, a seeded order, hosts that crash and pause.

``SimLoop`` is an ``asyncio.BaseEventLoop`` whose "selector" never blocks. When nothing is
ready it jumps its clock to the next timer (Trio's ``MockClock`` autojump rule), so a trial's
minutes of leases and deadlines take milliseconds. Callbacks ready at the same instant run in
an order drawn from the trial's ``random.Random``, so the seed fixes the interleaving and a
different seed tries another one.

A simulated process runs its tasks under a ``Host`` (the ``HOST`` context variable, which
every task and callback it creates inherits). Every callback carries the context it was
scheduled in, so the loop knows whose it is:

- a crash (``crash``) drops every callback of the host from then on and closes its tasks'
  coroutines where they stand: nothing of it runs again, as when a process is killed;
- a pause (``pause``) defers the host's callbacks until it ends;
- a host's wall clock may be offset (``HostClock``).

Real I/O and threads are refused (``RealIO``): production code that reaches for a socket, a
subprocess, an executor or another thread inside a simulation is a leak to find, not to hide.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import heapq
import itertools
import random
import selectors
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
WALL0 = 1_800_000_000.0  # the wall clock's reading at virtual time 0


class RealIO(RuntimeError):
    """Production code tried real I/O or a thread inside the simulation."""


class Stalled(RuntimeError):
    """Nothing is ready and no timer is set, yet the awaited work is not done."""


class Host:
    """One simulated process: its tasks, its clock's offset, whether it is alive or paused."""

    def __init__(self, name: str, offset: Callable[[float], float] | None = None) -> None:
        self.name = name
        self.alive = True
        self.paused_until = 0.0
        self.offset = offset or (lambda _t: 0.0)
        self.tasks: list[asyncio.Task[Any]] = []
        self.deferred: list[asyncio.Handle] = []
        self.pauses: list[tuple[float, float]] = []  # (from, until), on the true clock

    def __repr__(self) -> str:
        return f"Host({self.name})"


HOST: contextvars.ContextVar[Host | None] = contextvars.ContextVar("tether_sim_host",
                                                                   default=None)


def _host_of(handle: asyncio.Handle) -> Host | None:
    ctx: contextvars.Context | None = getattr(handle, "_context", None)
    return None if ctx is None else ctx.get(HOST)


class HostClock:
    """A host's ``tether`` clock: monotonic time is the loop's, wall time the loop's plus the
    host's offset (a skew, a drift, a jump), sleeping is the loop's."""

    def __init__(self, loop: SimLoop, host: Host) -> None:
        self.loop, self.host = loop, host

    def now(self) -> float:
        return self.loop.time()

    def wall(self) -> float:
        t = self.loop.time()
        return WALL0 + t + self.host.offset(t)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class _NoSelector(selectors.BaseSelector):
    """What ``BaseEventLoop._run_once`` polls: never blocks, registers nothing. Its ``select``
    is where virtual time moves and the ready callbacks are ordered."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise self._loop.refuse(f"real I/O (a file descriptor: {fileobj!r})")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise KeyError(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self._loop._advance(timeout)
        return []

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return {}

    def close(self) -> None:
        pass


class SimLoop(asyncio.BaseEventLoop):
    """An event loop on virtual time; see the module's docstring."""

    def __init__(self, rng: random.Random, *, trace: list[str] | None = None,
                 max_steps: int | None = None) -> None:
        super().__init__()
        self._now = 0.0
        self._rng = rng
        self._selector = _NoSelector(self)
        # A timer due now must count as due (``_run_once`` takes those before now + this).
        self._clock_resolution = 1e-9
        self.trace = trace
        self.steps = 0  # callbacks run (the trace's lines, traced or not)
        self.max_steps = max_steps
        self.errors: list[str] = []  # exceptions no one retrieved, as the handler saw them
        self.refused: list[str] = []  # the real I/O and threads production code reached for
        self.set_exception_handler(self._unhandled)
        # Ready callbacks are put in a canonical order before they are shuffled: a task's by
        # when the task was made, any other by when it was scheduled. Their order as queued
        # may follow the iteration of a set of tasks or futures (by memory address), which
        # would make the seeded shuffle differ from one run of the seed to the next.
        # Keyed by id: a handle's entry is written when it is made, so a live one never reads
        # a dead one's (and TimerHandles that compare equal stay apart). One loop per trial.
        self._made: dict[int, int] = {}
        self._counter = itertools.count()

    # BaseEventLoop's queues, typed: ready callbacks, and the timer heap.
    @property
    def _queue(self) -> collections.deque[asyncio.Handle]:
        return self._ready  # type: ignore[attr-defined,no-any-return]

    @property
    def _timers(self) -> list[asyncio.TimerHandle]:
        return self._scheduled  # type: ignore[attr-defined,no-any-return]

    # -- time -----------------------------------------------------------------------------
    def time(self) -> float:
        return self._now

    def _advance(self, timeout: float | None) -> None:
        """Called by ``_run_once`` before it takes due timers: jump to the next timer if
        nothing is ready, then take what is due, set each host's share aside, and shuffle."""
        if timeout is None:
            raise Stalled("nothing is ready and no timer is set: every task waits for ever")
        if timeout > 0:
            self._now += timeout
        scheduled = self._timers
        while scheduled and scheduled[0].when() <= self._now:
            timer = heapq.heappop(scheduled)
            timer._scheduled = False  # type: ignore[attr-defined]
            if not timer.cancelled():
                self._queue.append(timer)
        ready: list[asyncio.Handle] = []
        for handle in self._queue:
            host = _host_of(handle)
            if host is None:
                ready.append(handle)
            elif not host.alive:
                handle.cancel()  # a crashed host's: never runs
            elif host.paused_until > self._now:
                if not host.deferred:
                    self.call_at(host.paused_until, self._resume, host,
                                 context=contextvars.Context())
                host.deferred.append(handle)
            else:
                ready.append(handle)
        if len(ready) > 1:  # one alone (most steps) has one order, and draws nothing
            ready.sort(key=self._canonical)
            self._rng.shuffle(ready)
        self._queue.clear()
        self._queue.extend(ready)
        self.steps += len(ready)
        if self.max_steps is not None and self.steps > self.max_steps:
            raise StepBudget(f"more than {self.max_steps} callbacks")
        if self.trace is not None:
            for handle in ready:
                host = _host_of(handle)
                self.trace.append(f"{self._now:.6f} {host.name if host else '-'} "
                                  f"{_name(handle)}")

    def _canonical(self, handle: asyncio.Handle) -> tuple[int, int]:
        owner = getattr(getattr(handle, "_callback", None), "__self__", None)
        made = self._made.get(id(owner), -1) if isinstance(owner, asyncio.Task) else -1
        return made, self._made.get(id(handle), -1)

    def _call_soon(self, callback: Any, args: Any, context: Any) -> asyncio.Handle:
        handle: asyncio.Handle = super()._call_soon(callback, args, context)  # type: ignore[misc]
        self._made[id(handle)] = next(self._counter)
        return handle

    def call_at(self, when: float,  # type: ignore[override]
                callback: Callable[..., object], *args: Any,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        handle = super().call_at(when, callback, *args, context=context)
        self._made[id(handle)] = next(self._counter)
        return handle

    def _resume(self, host: Host) -> None:
        if host.paused_until > self._now:  # paused again meanwhile
            self.call_at(host.paused_until, self._resume, host, context=contextvars.Context())
            return
        deferred, host.deferred = host.deferred, []
        self._queue.extend(deferred)

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        raise self.refuse("another thread's wake-up (call_soon_threadsafe)")

    # -- hosts ----------------------------------------------------------------------------
    def create_task(self, coro: Any, *, name: Any = None,
                    context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = super().create_task(coro, name=name, context=context)
        self._made[id(task)] = next(self._counter)
        host = (context or contextvars.copy_context()).get(HOST)
        if host is not None:
            host.tasks.append(task)
        return task

    def start(self, host: Host, coro: Coroutine[Any, Any, T],
              name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task of ``host`` (and everything it starts, so on down)."""
        ctx = contextvars.Context()
        ctx.run(HOST.set, host)
        return self.create_task(coro, name=name or host.name, context=ctx)

    def crash(self, host: Host) -> None:
        """Kill the host: none of its callbacks runs again; its tasks' coroutines are closed
        where they stand (under the dead host, so whatever their ``finally`` tries to
        schedule is dropped too)."""
        host.alive = False
        host.deferred.clear()
        for handle in [*self._queue, *self._timers]:
            if _host_of(handle) is host:
                handle.cancel()
        dead = contextvars.Context()
        dead.run(HOST.set, host)
        for task in host.tasks:
            if task.done():
                continue
            task._log_destroy_pending = False  # type: ignore[attr-defined]
            _close(dead, task.get_coro())
        host.tasks.clear()

    def pause(self, host: Host, until: float) -> None:
        """Defer every callback of the host due before ``until``."""
        host.paused_until = max(host.paused_until, until)
        host.pauses.append((self._now, until))

    # -- what the simulation refuses ------------------------------------------------------
    def run_in_executor(self, executor: Any, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        raise self.refuse(f"threads (run_in_executor of {func!r})")

    def call_soon_threadsafe(self, callback: Callable[..., object],  # type: ignore[override]
                             *args: Any,
                             context: contextvars.Context | None = None) -> asyncio.Handle:
        # Production code calls this from the threads that bring it news (a journal's
        # listener); a simulation brings that news on the loop itself, which is no thread.
        if threading.get_ident() != self._thread_id:  # type: ignore[attr-defined]
            raise self.refuse(f"another thread's callback ({callback!r})")
        return self.call_soon(callback, *args, context=context)

    def add_signal_handler(self, sig: int,  # type: ignore[override]
                           callback: Callable[..., object],
                           *args: Any) -> None:
        raise self.refuse("signal handlers")

    def refuse(self, what: str) -> RealIO:
        """Record what production code reached for (the trial's judge sees it, even where a
        broad ``except`` in that code swallows the exception) and make the exception."""
        self.refused.append(what)
        return RealIO(f"the simulation refuses {what}")

    @contextlib.contextmanager
    def no_threads(self) -> Iterator[None]:
        """While the loop runs a trial: a thread started from the loop's thread is refused."""
        start = threading.Thread.start
        loop_thread = threading.get_ident()

        def refused(thread: threading.Thread) -> None:
            if threading.get_ident() == loop_thread:
                raise self.refuse(f"threads (a thread {thread.name!r} started)")
            start(thread)

        threading.Thread.start = refused  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, GeneratorExit):
            # A crash closes a dead host's coroutines where they stand (``crash``): a future
            # one of them awaited is left holding the GeneratorExit. The process is gone; no
            # code of it could have retrieved it.
            return
        self.errors.append(f"{context.get('message')}: {exc!r}" if exc is not None
                           else str(context.get("message")))


def _close(ctx: contextvars.Context, coro: Any) -> None:
    """Close a dead task's coroutine, and every coroutine it awaits, for good. A ``finally``
    or ``async with`` that awaits while it closes makes ``close`` raise (the coroutine ignored
    GeneratorExit) and leaves it suspended further on; the chain is closed again, innermost
    first, until nothing of it is left for the garbage collector to resume later."""
    for _ in range(1000):
        chain: list[Any] = []
        link = coro
        while link is not None and _suspended(link):
            chain.append(link)
            link = getattr(link, "cr_await", None) or getattr(link, "gi_yieldfrom", None)
        if not chain:
            return
        for link in reversed(chain):
            with contextlib.suppress(BaseException):
                ctx.run(link.close)


def _suspended(link: Any) -> bool:
    if hasattr(link, "cr_frame"):
        return link.cr_frame is not None
    if hasattr(link, "gi_frame"):
        return link.gi_frame is not None
    return False  # a future's iterator: nothing of ours runs in it


class StepBudget(RuntimeError):
    """The trial ran more callbacks than it may (a livelock, or a trial far too busy)."""


def _name(handle: asyncio.Handle) -> str:
    cb = getattr(handle, "_callback", None)
    owner = getattr(cb, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return f"step {getattr(coro, '__qualname__', '?')}"
    return str(getattr(cb, "__qualname__", type(cb).__name__))


def run(loop: SimLoop, main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on ``loop`` (made the running loop meanwhile) and close it."""
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


__all__ = ["HOST", "WALL0", "Host", "HostClock", "RealIO", "SimLoop", "Stalled", "StepBudget",
           "run"]
