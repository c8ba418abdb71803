"""Virtual time for the simulator: hosts, processes as generators, and one seeded scheduler.

A process is a generator. Everything it does between two ``yield``s is one atomic step; what
it yields says when it runs again:

- ``yield 0.25``: sleep 0.25 virtual seconds;
- ``yield future``: wait until the future is done, then get its value (or its error, raised);
- ``yield (waitable, timeout)``: wait for a future or a signal at most ``timeout`` seconds,
  then get True (it fired) or False (timed out);
- ``yield (futures, timeout)`` with a list: the first of several.

Every choice the scheduler makes comes from one ``random.Random``: the order of processes ready
at the same instant is a random tie-break drawn when each wake-up is scheduled. So a trial
replays step for step from its seed.
"""

from __future__ import annotations

import contextlib
import heapq
import random
from collections.abc import Callable, Generator
from typing import Any, TypeAlias

Step: TypeAlias = Generator[Any, Any, Any]


class Cancelled(BaseException):
    """Thrown into a process at its current ``yield``, like asyncio's CancelledError."""


class OutOfSteps(Exception):
    """The trial used its step budget without quiescing."""


class Future:
    """A one-shot result. Waiting on a done future returns at once."""

    __slots__ = ("done", "error", "value", "waiters")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.waiters: list[tuple[Proc, int, bool]] = []  # (process, token, wants the value)

    def resolve(self, sched: Sched, value: Any = None, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.done, self.value, self.error = True, value, error
        waiters, self.waiters = self.waiters, []
        for proc, token, wants in waiters:
            sched.wake(proc, token, self if wants else True)


class Signal:
    """An edge: wakes whoever waits on it now; nobody later."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[tuple[Proc, int, bool]] = []

    def fire(self, sched: Sched) -> None:
        waiters, self.waiters = self.waiters, []
        for proc, token, _ in waiters:
            sched.wake(proc, token, True)


class Clock:
    """A host's wall clock: true time plus an offset that drifts and jumps, always within
    ``bound`` of the true (journal server's) time. ``mono`` is the host's monotonic clock."""

    __slots__ = ("bound", "drift", "jumps", "offset")

    def __init__(self, offset: float = 0.0, drift: float = 0.0, bound: float = 0.0) -> None:
        self.offset = offset
        self.drift = drift
        self.bound = bound
        self.jumps: list[tuple[float, float]] = []  # (true time, step), in time order

    def wall(self, t: float) -> float:
        if not self.bound:
            return t
        off = self.offset + self.drift * t
        for at, step in self.jumps:
            if at > t:
                break
            off += step
        b = self.bound
        return t + (b if off > b else -b if off < -b else off)


class Host:
    """A process of the real world (an orchestrator, a worker, a reconciler): crashing or
    pausing it crashes or pauses every simulated process running on it."""

    __slots__ = ("alive", "clock", "name", "notify", "paused_until", "procs", "steps")

    def __init__(self, name: str, clock: Clock | None = None) -> None:
        self.name = name
        self.clock = clock or Clock()
        self.alive = True
        self.paused_until = 0.0
        self.procs: list[Proc] = []
        self.steps = 0
        self.notify = Signal()  # the journal's notifications to this host


class Proc:
    __slots__ = ("daemon", "done", "gen", "host", "name", "token")

    def __init__(self, host: Host, name: str, gen: Step, daemon: bool) -> None:
        self.host = host
        self.name = name
        self.gen = gen
        self.token = 0  # the wake-up it waits for; stale wake-ups are skipped
        self.done = Future()
        self.daemon = daemon

    @property
    def alive(self) -> bool:
        return not self.done.done and self.host.alive


_RESUME, _THROW, _CALL = 0, 1, 2
# The timers' resolution: a wait shorter than this still lets this much time pass (as a real
# timer does), so that a deadline computed as "now + tiny" is reached instead of spun on.
TICK = 1e-6


def _delay(seconds: float) -> float:
    return 0.0 if seconds <= 0 else max(seconds, TICK)



class Sched:
    def __init__(self, rng: random.Random, trace: list[str] | None = None,
                 budget: int = 50_000) -> None:
        self.rng = rng
        self.now = 0.0
        self._heap: list[tuple[float, float, int, int, Any, Any, Any]] = []
        self._n = 0
        self.steps = 0
        self.budget = budget
        self.trace = trace
        self.errors: list[str] = []
        self.current: Proc | None = None
        self.on_step: Callable[[Host], None] | None = None

    # -- scheduling ---------------------------------------------------------------------------
    def _push(self, at: float, kind: int, target: Any, token: Any, value: Any) -> None:
        self._n += 1
        heapq.heappush(self._heap, (at, self.rng.random(), self._n, kind, target, token, value))

    def wake(self, proc: Proc, token: int, value: Any, delay: float = 0.0) -> None:
        if proc.token == token:
            self._push(self.now + delay, _RESUME, proc, token, value)

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """A callback outside any host (the network, a provider): it runs whatever happens to
        the processes that caused it."""
        self._push(max(at, self.now), _CALL, fn, 0, None)

    def spawn(self, host: Host, name: str, gen: Step, *, daemon: bool = False) -> Proc:
        proc = Proc(host, name, gen, daemon)
        host.procs.append(proc)
        self._push(self.now, _RESUME, proc, 0, None)
        return proc

    def cancel(self, proc: Proc) -> None:
        if proc.alive:
            proc.token += 1
            self._push(self.now, _THROW, proc, proc.token, None)

    def kill(self, host: Host) -> None:
        """The host's processes stop where they are, running nothing more (like SIGKILL)."""
        host.alive = False
        for proc in host.procs:
            proc.token += 1
        host.procs = []

    def note(self, text: str) -> None:
        if self.trace is not None:
            who = self.current
            name = f"{who.host.name}/{who.name}" if who is not None else "world"
            self.trace.append(f"{self.now:10.4f} {name:<22} {text}")

    # -- running ------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None, horizon: float = float("inf")) -> bool:
        """Run until ``until()`` holds (checked after each step), nothing is left to run, or
        virtual time reaches ``horizon``. True if ``until()`` held or the world quiesced."""
        heap = self._heap
        while heap:
            if until is not None and until():
                return True
            at = heap[0][0]
            if at > horizon:
                self.now = horizon
                return until is None
            _, _, _, kind, target, token, value = heapq.heappop(heap)
            if kind == _CALL:
                self.now = at
                self.current = None
                target()
                continue
            proc: Proc = target
            if proc.token != token or not proc.alive:
                continue
            host = proc.host
            if host.paused_until > at:
                self._push(host.paused_until, kind, proc, token, value)
                continue
            self.now = at
            self.steps += 1
            if self.steps > self.budget:
                raise OutOfSteps(f"{self.steps} steps")
            host.steps += 1
            if self.on_step is not None:
                self.on_step(host)
                if not proc.alive:
                    continue
            self._step(proc, kind, value)
        return until is None or until()

    def _step(self, proc: Proc, kind: int, value: Any) -> None:
        self.current = proc
        proc.token += 1
        if self.trace is not None:
            self.trace.append(f"{self.now:10.4f} {proc.host.name}/{proc.name:<16} step")
        try:
            if kind == _THROW:
                cmd = proc.gen.throw(Cancelled())
            elif isinstance(value, Future):
                cmd = proc.gen.throw(value.error) if value.error is not None \
                    else proc.gen.send(value.value)
            else:
                cmd = proc.gen.send(value)
        except StopIteration as stop:
            self._finish(proc, stop.value, None)
            return
        except BaseException as exc:
            self._finish(proc, None, exc)
            return
        finally:
            self.current = None
        self._wait(proc, cmd)

    def _finish(self, proc: Proc, value: Any, error: BaseException | None) -> None:
        if error is not None and proc.daemon and not isinstance(error, Cancelled):
            self.errors.append(f"{proc.host.name}/{proc.name} raised {error!r}")
        with contextlib.suppress(ValueError):
            proc.host.procs.remove(proc)
        proc.done.resolve(self, value, error)

    def _wait(self, proc: Proc, cmd: Any) -> None:
        token = proc.token
        if cmd is None:
            self._push(self.now, _RESUME, proc, token, None)
        elif isinstance(cmd, float | int):
            self._push(self.now + _delay(float(cmd)), _RESUME, proc, token, None)
        elif isinstance(cmd, Future):
            if cmd.done:
                self._push(self.now, _RESUME, proc, token, cmd)
            else:
                cmd.waiters.append((proc, token, True))
        else:
            what, timeout = cmd
            items = what if isinstance(what, list) else [what]
            for item in items:
                if isinstance(item, Future) and item.done:
                    self._push(self.now, _RESUME, proc, token, True)
                    return
            for item in items:
                item.waiters.append((proc, token, False))
            self._push(self.now + _delay(timeout), _RESUME, proc, token, False)
