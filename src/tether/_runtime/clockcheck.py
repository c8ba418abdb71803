"""Every process on a shared journal keeps its wall clock near the journal server's.

A call's dispatch deadline is written on its executor's clock and judged on whichever process
probes it (``_core.outcome.may_still_apply``): judged passed only ``clock_tolerance`` (T) after
it. That is sound only if any two processes' clocks are within T of each other, so each one
checks that its clock is within T/2 of the server's: when it opens (an orchestrator, ``tether
reconcile``, a worker) and at each heartbeat or lease renewal. On SQLite every process shares
this host's clock: nothing to check.
"""

from __future__ import annotations

import time

from tether._core.errors import ClockSkew
from tether._journal.journal import Journal
from tether._runtime.clock import Clock, SystemClock

# A read whose round trip is within this share of the limit can tell "may be off" from "on time".
PRECISE = 0.25


def is_virtual(clock: Clock) -> bool:
    """A clock that says it is not this host's (``tether.testing.VirtualClock``, a
    simulation's): its times are its caller's to keep consistent, and nothing is checked."""
    return bool(getattr(clock, "virtual", False))


async def clock_offset(journal: Journal, clock: Clock) -> tuple[float, float] | None:
    """This clock's offset from the journal server's, and how uncertain that is (half the
    round trip of the read), or None where there is no server (SQLite)."""
    before, sent = clock.wall(), time.monotonic()
    server = await journal.server_time()
    if server is None:
        return None
    after = clock.wall()
    middle = before + (after - before) / 2  # the server read its clock in between
    return middle - server, (time.monotonic() - sent) / 2


async def check_clock(journal: Journal, clock: Clock, limit: float, what: str) -> None:
    """Raise ClockSkew if this clock may be more than ``limit`` seconds off the server's."""
    if is_virtual(clock):
        return
    found = await clock_offset(journal, clock)
    if found is None:
        return
    offset, uncertain = found
    if abs(offset) - uncertain > limit:  # off, however long the read took
        raise ClockSkew(offset, limit, what)
    if abs(offset) + uncertain > limit and uncertain <= limit * PRECISE:
        raise ClockSkew(offset, limit, what)  # read precisely enough to say it may be off
    # Else within the limit, or the read took too long to tell (a server restarting, a host
    # under load): a slow round trip is no evidence of a wrong clock, and stopping for it
    # would stop a healthy process whenever a restart outlasted the limit. Checked again at
    # the next heartbeat.


async def check_host_clock(journal: Journal, what: str) -> None:
    """For a command that judges deadlines on this host's clock without a supervisor (``tether
    resolve``, ``tether prune``): within half the journal's clock tolerance of the server's."""
    await check_clock(journal, SystemClock(), journal.clock_tolerance / 2, what)


__all__ = ["check_clock", "check_host_clock", "clock_offset", "is_virtual"]
