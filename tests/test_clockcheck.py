"""The clock check against the journal server's clock (``_runtime.clockcheck``)."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest

import tether
from tether._journal.journal import Journal
from tether._runtime.clock import SystemClock
from tether._runtime.clockcheck import check_clock


class SlowServer:
    """A journal whose server clock reads ``skew`` seconds behind this host's, and whose
    read takes at least ``takes`` seconds (a server restarting)."""

    def __init__(self, skew: float, takes: float) -> None:
        self.skew, self.takes = skew, takes

    async def server_time(self) -> float:
        read = time.time() - self.skew
        await asyncio.sleep(self.takes)
        return read + self.takes / 2


def journal(skew: float, takes: float) -> Journal:
    return cast(Journal, SlowServer(skew, takes))


async def test_a_slow_read_of_a_true_clock_stops_nothing() -> None:
    # Half the round trip (0.3 s) is more than the limit (0.2 s) on its own: before, that
    # "may be off" stopped the process, though nothing says its clock is wrong.
    await check_clock(journal(0.0, 0.6), SystemClock(), 0.2, "test")


async def test_a_clock_surely_off_is_found_however_slow_the_read() -> None:
    with pytest.raises(tether.errors.ClockSkew):
        await check_clock(journal(5.0, 0.6), SystemClock(), 0.2, "test")


async def test_a_quick_read_that_may_be_off_stops_the_process() -> None:
    with pytest.raises(tether.errors.ClockSkew):
        await check_clock(journal(0.25, 0.0), SystemClock(), 0.2, "test")
