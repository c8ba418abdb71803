"""Test doubles for the outside world: a virtual clock and a simulated payment provider.

Both are shipped so that users can test their own agents the way tether tests itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import sqlite3
from dataclasses import dataclass
from typing import Any

from tether._core.model import ProbeOutcome
from tether._journal.writer import busy as journal_busy
from tether._runtime.tools import ProbeResult

_IDLE_POLL = 0.0005  # real seconds between looks at whether every task waits
def _runnable(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether asyncio has a callback to run now or a real timer already due (this clock's
    own poll, which is running, is neither). Reads the loop's queues: asyncio has no public
    way to ask whether every task waits. A task waiting on a real timer still to come (a
    poll, a timeout) waits, as a task on Trio's clock does."""
    if getattr(loop, "_ready", None):
        return True
    now = loop.time()
    return any(not h.cancelled() and h.when() <= now for h in getattr(loop, "_scheduled", ()))


class VirtualClock:
    """Time that moves only when a test says so. ``sleep`` parks until ``advance`` passes its
    deadline; ``sleeping`` lets a test wait, without a real sleep, until someone is parked."""

    # Not this host's clock: nothing checks it against a journal server's (``clockcheck``).
    virtual = True

    def __init__(self, start: float = 0.0, wall_start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._wall0 = wall_start - start
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._changed = asyncio.Event()
        self._jump_after: float | None = None
        self._jump_pending = False
        self._idle_since: float | None = None

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall0 + self._now

    def sleepers(self, at_least: float = 0.0) -> int:
        """How many coroutines are parked with at least ``at_least`` seconds left."""
        return sum(1 for d, _, f in self._heap if not f.done() and d - self._now >= at_least)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self._now + seconds, next(self._seq), fut))
        self._changed.set()
        self._schedule_jump()
        await fut

    def autojump(self, threshold: float | None = 0.0) -> None:
        """Trio's autojump: from now on, whenever every task waits (nothing ready to run on the
        loop, no journal work on a thread) for ``threshold`` real seconds in a row, jump to the
        earliest deadline. ``None`` turns it off. Useful where a test no longer choreographs
        timers (a supervisor closing, say). The loop cannot see other processes or sockets: a
        test that waits on one keeps autojump off (or a threshold above the wait) meanwhile."""
        self._jump_after = threshold
        self._idle_since = None
        self._schedule_jump()

    def _schedule_jump(self) -> None:
        if self._jump_after is None or self._jump_pending or not self._heap:
            return
        self._jump_pending = True
        asyncio.get_running_loop().call_later(_IDLE_POLL, self._jump)

    def _jump(self) -> None:
        self._jump_pending = False
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)
        if not self._heap or self._jump_after is None:
            self._idle_since = None
            return
        loop = asyncio.get_running_loop()
        if _runnable(loop) or journal_busy():
            self._idle_since = None
        else:
            since = self._idle_since = self._idle_since or loop.time()
            if loop.time() - since >= self._jump_after:
                self._idle_since = None
                self.advance(max(0.0, self._heap[0][0] - self._now))
        self._schedule_jump()

    async def sleeping(self, count: int = 1, *, at_least: float = 0.0) -> None:
        """Return once ``count`` coroutines are parked on this clock with at least
        ``at_least`` seconds to go (so a test can tell one timer from another)."""
        while self.sleepers(at_least) < count:
            self._changed.clear()
            await self._changed.wait()

    def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline has come, in order."""
        target = self._now + seconds
        while self._heap and self._heap[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._heap)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
        self._now = target


@dataclass(frozen=True)
class LedgerEntry:
    key: str
    order_id: str
    cents: int
    kind: str
    ref: str


class PaymentService:
    """A payment provider with latency and its own ledger, keyed by idempotency key, as the
    real ones are. ``path`` keeps the ledger in a SQLite file another process can read."""

    def __init__(self, clock: Any = None, *, latency: float = 0.05, reply_delay: float = 0.0,
                 path: str = ":memory:") -> None:
        from tether._runtime.clock import SystemClock

        self.clock = clock or SystemClock()
        self.latency = latency
        self.reply_delay = reply_delay  # time between applying and the reply reaching us
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS ledger (key TEXT PRIMARY KEY, order_id TEXT, "
            "cents INTEGER, kind TEXT, ref TEXT)")
        self._changed = asyncio.Event()
        self._inflight: set[asyncio.Future[str]] = set()
        self.requests = 0  # requests that reached the provider
        self.applications = 0  # ledger entries written
        self._seen = (0, 0)

    def close(self) -> None:
        self._db.close()

    def _apply(self, key: str, order_id: str, cents: int, kind: str) -> str:
        row = self._db.execute("SELECT ref FROM ledger WHERE key = ?", (key,)).fetchone()
        if row is not None:  # a real provider answers a repeated key with the first result
            return str(row[0])
        ref = f"{kind[:2]}_{hashlib.sha256(f'{kind}:{key}'.encode()).hexdigest()[:10]}"
        self._db.execute("INSERT INTO ledger VALUES (?, ?, ?, ?, ?)",
                         (key, order_id, cents, kind, ref))
        self.applications += 1
        self._changed.set()
        return ref

    def mark(self) -> None:
        """Forget what was sent and applied so far: ``sent``/``applied`` wait for new ones."""
        self._seen = (self.requests, self.applications)

    async def _wait_for(self, index: int) -> None:
        while (self.requests, self.applications)[index] <= self._seen[index]:
            self._changed.clear()
            await self._changed.wait()
        self.mark()

    async def sent(self) -> None:
        """Wait until a request sent after the last ``mark`` reached the provider."""
        await self._wait_for(0)

    async def applied(self) -> None:
        """Wait until an entry applied after the last ``mark`` is in the ledger."""
        await self._wait_for(1)

    async def settle(self) -> None:
        """Wait until the provider has finished every request it received."""
        while self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def refund(self, order_id: str, cents: int, *, idempotency_key: str) -> str:
        """Once sent, a request is processed whatever the caller does: cancelling the caller
        only loses the reply, as with a real provider."""
        self.requests += 1
        self._changed.set()
        work = asyncio.ensure_future(self._process(idempotency_key, order_id, cents))
        self._inflight.add(work)
        work.add_done_callback(self._inflight.discard)
        ref = await asyncio.shield(work)
        await self.clock.sleep(self.reply_delay)
        return ref

    async def _process(self, key: str, order_id: str, cents: int) -> str:
        await self.clock.sleep(self.latency)
        return self._apply(key, order_id, cents, "refund")

    async def reverse(self, order_id: str, cents: int, *, idempotency_key: str) -> str:
        await self.clock.sleep(self.latency)
        return self._apply(idempotency_key, order_id, -cents, "reversal")

    async def lookup(self, order_id: str, cents: int, *, idempotency_key: str) -> ProbeResult:
        """A probe: ask the provider's ledger about one idempotency key."""
        row = self._db.execute("SELECT ref, cents FROM ledger WHERE key = ?",
                               (idempotency_key,)).fetchone()
        if row is None:
            return ProbeResult(ProbeOutcome.NOT_APPLIED, {"provider": "no entry for key"})
        return ProbeResult(ProbeOutcome.COMPLETED, {"provider_ref": row[0], "cents": row[1]},
                           result=row[0])

    def entries(self, order_id: str | None = None) -> list[LedgerEntry]:
        sql = "SELECT key, order_id, cents, kind, ref FROM ledger"
        rows = (self._db.execute(sql + " WHERE order_id = ?", (order_id,)) if order_id
                else self._db.execute(sql)).fetchall()
        return [LedgerEntry(*r) for r in rows]

    def refunded(self, order_id: str) -> int:
        """Net cents refunded to the customer for one order (refunds minus reversals)."""
        return sum(e.cents for e in self.entries(order_id))

    def refund_count(self, order_id: str) -> int:
        return sum(1 for e in self.entries(order_id) if e.kind == "refund")
