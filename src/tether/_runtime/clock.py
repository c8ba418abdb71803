"""Time, injected. Deadlines use ``now()``; records use ``wall()``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds, for deadlines."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, for the journal's records."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


async def first_of(clock: Clock, seconds: float, *waits: Awaitable[object]) -> bool:
    """Wait until any of ``waits`` is done or ``seconds`` pass on ``clock``; True if one was.

    Futures passed in are never cancelled (an in-flight tool keeps running); coroutines passed
    in are wrapped, and the wrappers are cancelled when the wait ends."""
    owned = [w for w in waits if asyncio.iscoroutine(w)]
    futs = [asyncio.ensure_future(w) for w in waits]
    wrappers = [f for f, w in zip(futs, waits, strict=True) if w in owned]
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        if any(f.done() for f in futs):
            return True
        done, _ = await asyncio.wait({timer, *futs}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        for f in wrappers:
            f.cancel()
    return any(f in done for f in futs)
