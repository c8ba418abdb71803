"""The writer thread's life at its edges: a close that gave up on a writer stuck on its
server, and the posted writes an outage left behind. One connection is written by one thread,
and no batch is longer than ``MAX_BATCH`` (a longer one could outlast the watchdog on
PostgreSQL and be cut, then run again, for ever)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import tether
from tests.journal_helpers import writer_held
from tether._journal.runner import MAX_BATCH, Op
from tether.errors import JournalError

WITHIN = 30.0  # seconds: a test that has not ended by then hangs, and fails


async def test_a_journal_closed_on_a_stuck_writer_reopens_only_once_that_writer_ended(
        journal_url: str) -> None:
    """Closing never waits past ``stop_wait`` for a writer stuck in a call its server does not
    answer. Opening the same journal again while that writer still holds its connection would
    put two threads on one queue (each batch on whichever connection the runner holds last):
    it is refused with a JournalError. Once the stuck call returns, the old writer ends, and
    the journal opens again with nothing left counted against it."""
    journal = await tether.Journal(journal_url).open()
    runner: Any = journal._runner
    runner.stop_wait = 0.2
    stuck, release = threading.Event(), threading.Event()

    def hang(db: Any) -> None:
        stuck.set()
        release.wait(WITHIN)

    hung = runner.submit(hang, write=True)
    await asyncio.to_thread(stuck.wait, WITHIN)
    old = runner._thread
    later = runner.submit(lambda db: None, write=True)  # queued behind it
    await asyncio.wait_for(journal.close(), WITHIN)
    for future in (hung, later):
        with pytest.raises(JournalError):
            await future
    try:
        with pytest.raises(JournalError, match="still held"):
            await journal.open()
    finally:
        release.set()
    await asyncio.to_thread(old.join, WITHIN)
    assert not old.is_alive()  # it ended once its call returned, serving nothing more
    await journal.open()
    try:
        assert runner._thread is not old
        assert runner.outstanding == 0  # nothing of the last opening counted as waiting
        await journal.flush()
    finally:
        await journal.close()


async def test_posted_writes_held_through_an_outage_never_make_a_batch_past_its_cap(
        journal_url: str) -> None:
    """Receipts an outage held (nobody waits for them, so nobody would write them again) go
    first once the connection is back, but they share the cap with what waited meanwhile:
    every batch is at most MAX_BATCH, and each of them, held or queued, commits."""
    async with tether.Journal(journal_url) as journal:
        runner: Any = journal._runner
        ran: list[str] = []

        def note(name: str) -> Any:
            return lambda db: ran.append(name)

        sizes: list[int] = []
        run_batch = runner._run_batch

        def counted(conn: Any, batch: list[Op], careful: bool = False) -> Any:
            sizes.append(len(batch))
            return run_batch(conn, batch, careful)

        blocker, hold = await writer_held(runner)
        runner._held = [Op(note(f"held-{i}"), True, None) for i in range(MAX_BATCH + 10)]
        runner._run_batch = counted
        waits = [runner.submit(note(f"queued-{i}"), write=True) for i in range(MAX_BATCH)]
        hold.set()
        await blocker
        await asyncio.wait_for(asyncio.gather(*waits), WITHIN)
        await journal.flush()
    assert sizes and max(sizes) <= MAX_BATCH, sizes
    assert sorted(ran) == sorted([f"held-{i}" for i in range(MAX_BATCH + 10)]
                                 + [f"queued-{i}" for i in range(MAX_BATCH)])
    assert ran.index("held-0") < ran.index("queued-0")  # what the outage left goes first
