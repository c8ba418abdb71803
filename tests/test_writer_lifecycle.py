"""The writer thread's life at its edges: a close that gave up on a writer stuck on its
server, and the posted writes an outage left behind. One connection is written by one thread,
and no batch is longer than ``MAX_BATCH`` (a longer one could outlast the watchdog on
PostgreSQL and be cut, then run again, for ever)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import pytest

import tether
from tests.conftest import until
from tests.journal_helpers import pay_action, root_delegation, writer_held
from tether._journal import writer
from tether._journal.runner import MAX_BATCH, Lost, Op
from tether.errors import JournalError

WITHIN = 30.0  # seconds: a test that has not ended by then hangs, and fails


async def stuck_writer(runner: Any) -> tuple[asyncio.Future[Any], threading.Event]:
    """A write the writer runs and that does not return (a server that does not answer)
    until the returned event is set: its future, and the event."""
    stuck, release = threading.Event(), threading.Event()

    def hang(db: Any) -> None:
        stuck.set()
        release.wait(WITHIN)

    hung = runner.submit(hang, write=True)
    await asyncio.to_thread(stuck.wait, WITHIN)
    return hung, release


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
    hung, release = await stuck_writer(runner)
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


async def test_an_end_of_queue_the_last_writer_never_read_does_not_end_the_next_one(
        journal_url: str) -> None:
    """A writer that took a close's end of queue with its last batch, then got stuck in it:
    the close gives up, leaves it a second end of queue, but the writer, answered just then,
    ends without reading it. The next opening has a queue of its own: its writer serves, and
    a posted write is written."""
    journal = await tether.Journal(journal_url).open()
    runner: Any = journal._runner
    runner.stop_wait = 0.2
    stuck, release = threading.Event(), threading.Event()

    def hang(db: Any) -> None:
        stuck.set()
        release.wait(WITHIN)

    blocker, hold = await writer_held(runner)
    hung = runner.submit(hang, write=True)
    closing = asyncio.ensure_future(journal.close())
    await until(lambda: runner._queue.qsize() == 2, "the close's end queued behind the call")
    old = runner._thread
    drain, loop_thread = runner._drain, threading.current_thread()

    def drain_then_the_writer_ends() -> list[Any]:
        ops: list[Any] = drain()
        if threading.current_thread() is loop_thread:  # the close's drain, not the writer's
            release.set()  # the server answers now: the writer ends before the close's end
            old.join(WITHIN)
        return ops

    runner._drain = drain_then_the_writer_ends
    hold.set()  # the writer takes the call and the end of queue as one batch
    await blocker
    await asyncio.to_thread(stuck.wait, WITHIN)
    await asyncio.wait_for(closing, WITHIN)
    del runner._drain
    with pytest.raises(JournalError):
        await hung
    assert not old.is_alive()
    await journal.open()
    try:
        runner.submit(lambda db: db.execute("CREATE TABLE posted (n INTEGER)"), write=True,
                      wait=False)
        await asyncio.wait_for(journal.flush(), WITHIN)
        assert await journal._read(lambda db: db.execute(
            "SELECT count(*) FROM posted").fetchone()[0]) == 0  # the table exists
    finally:
        await journal.close()


async def test_a_cancelled_close_still_closes_and_a_reopen_waits_for_its_writer(
        journal_url: str) -> None:
    """A close cancelled while it waits for a stuck writer (``wait_for``, a task group,
    Ctrl-C) has closed the journal all the same: opening it again is refused while that
    writer lives (it would be a second one on the same connection), and works once it ended;
    opening a journal open already is refused too."""
    journal = await tether.Journal(journal_url).open()
    runner: Any = journal._runner
    with pytest.raises(JournalError, match="open already"):
        await journal.open()
    hung, release = await stuck_writer(runner)
    old = runner._thread
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(journal.close(), 0.2)  # well before stop_wait
    # Its writer still answers this loop: a test clock must not jump while it does.
    assert writer.busy()
    try:
        with pytest.raises(JournalError, match="still held"):
            await journal.open()
    finally:
        release.set()
    await hung  # its writer finished what it held, then ended at the end of its queue
    await asyncio.to_thread(old.join, WITHIN)
    assert not old.is_alive()
    await journal.open()
    try:
        await asyncio.wait_for(journal.flush(), WITHIN)
    finally:
        await journal.close()


async def test_a_read_queued_after_held_receipts_sees_every_one_of_them(
        journal_url: str) -> None:
    """Receipts an outage held were posted before anything queued since: however many there
    are, a read (a drain's facts) or a flush queued later answers only once all of them are
    written, never with some still to come."""
    async with tether.Journal(journal_url) as journal:
        runner: Any = journal._runner
        ran: list[int] = []
        blocker, hold = await writer_held(runner)
        def note(i: int) -> Any:
            return lambda db: ran.append(i)

        runner._held = [Op(note(i), True, None) for i in range(MAX_BATCH - 24)]
        waits = [runner.submit(lambda db: None, write=True) for _ in range(MAX_BATCH // 8)]
        seen = runner.submit(lambda db: len(ran), write=False)
        hold.set()
        await blocker
        await asyncio.wait_for(asyncio.gather(*waits), WITHIN)
        assert await seen == MAX_BATCH - 24


async def test_a_fence_skips_the_receipts_an_outage_held_as_it_skips_a_backlog(
        journal_url: str) -> None:
    """Receipts an outage held go before anything queued since, but an urgent operation (a
    recall's fence) skips them as it skips any backlog: after an outage that left more of
    them than a batch holds, a storm of fences takes its share of each batch and commits
    before all of them are written, while a read queued with it still waits for every one."""
    async with tether.Journal(journal_url) as journal:
        runner: Any = journal._runner
        ran: list[int] = []
        fenced_after: list[int] = []

        def note(i: int) -> Any:
            return lambda db: ran.append(i)

        blocker, hold = await writer_held(runner)
        held = 2 * MAX_BATCH + 10
        runner._held = [Op(note(i), True, None) for i in range(held)]
        seen = runner.submit(lambda db: len(ran), write=False)
        storm = [runner.submit(lambda db: fenced_after.append(len(ran)), write=True,
                               urgent=True) for _ in range(MAX_BATCH // 2 + 100)]
        hold.set()
        await blocker
        await asyncio.wait_for(asyncio.gather(seen, *storm), WITHIN)
        assert max(fenced_after) < held  # the storm took its share of each batch
        assert await seen == held


async def test_with_the_server_down_what_waits_behind_held_receipts_fails_in_time(
        pg_url: str) -> None:
    """An outage held more receipts than a batch holds, and the server is still down: a
    flush queued behind them fails once the reconnection window is over, as any write then
    does, instead of waiting for a connection for ever while the writer retries in a loop."""
    async with tether.Journal(pg_url) as journal:
        await journal.flush()
        runner: Any = journal._runner
        journal.reconnect_within = 0.3
        attempts = [0]

        def refused() -> Any:
            attempts[0] += 1
            raise JournalError("cannot connect to the journal: connection refused")

        connect, runner.connect = runner.connect, refused
        runner._conn.close()
        try:
            for _ in range(MAX_BATCH + 10):  # their batch fails for want of a connection
                runner.submit(lambda db: None, write=True, wait=False)
            for _ in range(2):  # within the window, then past it
                with pytest.raises(JournalError, match="could not reconnect"):
                    await asyncio.wait_for(journal.flush(), WITHIN)
            assert attempts[0] < 1000  # a bounded backoff, not a loop
        finally:
            runner.connect = connect


async def test_a_connection_back_under_a_batch_writes_the_held_receipts_before_it(
        pg_url: str) -> None:
    """The connection comes back while a batch waits for it, with more held receipts than fit
    before that batch: they are written first, in batches of their own, and a read in the
    batch sees every one of them."""
    async with tether.Journal(pg_url) as journal:
        await journal.flush()
        runner: Any = journal._runner
        ran: list[int] = []

        def note(i: int) -> Any:
            return lambda db: ran.append(i)

        # The writer is idle (after the flush): its connection lost, the next batch
        # connects again, under it.
        runner._drop()
        runner._held = [Op(note(i), True, None) for i in range(MAX_BATCH + 10)]
        seen = runner.submit(lambda db: len(ran), write=False)
        assert await asyncio.wait_for(seen, WITHIN) == MAX_BATCH + 10
        assert runner.reconnects == 1


async def test_a_close_writes_the_receipts_an_outage_held_once_the_connection_is_back(
        journal_url: str) -> None:
    """Held receipts are written before what comes after them; with nothing after them, a
    close with the connection back writes them, rather than leave each call they finish for
    reconciliation to probe."""
    journal = await tether.Journal(journal_url).open()
    runner: Any = journal._runner
    await journal._write(lambda db: db.execute("CREATE TABLE receipts (n INTEGER)"))

    def receipt(i: int) -> Any:
        return lambda db: db.execute("INSERT INTO receipts VALUES (?)", (i,))

    runner._held = [Op(receipt(i), True, None) for i in range(MAX_BATCH + 10)]  # writer idle
    await journal.close()
    async with tether.Journal(journal_url) as again:
        assert await again._read(lambda db: db.execute(
            "SELECT count(*) FROM receipts").fetchone()[0]) == MAX_BATCH + 10


def _refused() -> Any:
    raise JournalError("cannot connect to the journal: connection refused")


async def test_receipts_held_when_a_close_cannot_write_them_are_dropped_as_at_a_crash(
        pg_url: str) -> None:
    """A close in an outage cannot write what the outage held: those receipts are dropped as
    at a crash (reconciliation settles their calls), never written by a later opening of the
    same journal (old receipts, old heartbeats, long after)."""
    journal = await tether.Journal(pg_url).open()
    runner: Any = journal._runner
    await journal._write(lambda db: db.execute("CREATE TABLE receipts (n INTEGER)"))
    journal.reconnect_within = 0.3
    connect, runner.connect = runner.connect, _refused
    runner._conn.close()

    def receipt(i: int) -> Any:
        return lambda db: db.execute("INSERT INTO receipts VALUES (?)", (i,))

    for i in range(5):  # posted during the outage: their batch fails, they are held
        runner.submit(receipt(i), write=True, wait=False)
    with pytest.raises(JournalError, match="could not reconnect"):
        await asyncio.wait_for(journal.flush(), WITHIN)
    assert len(runner._held) == 5
    await journal.close()  # the server still down
    runner.connect = connect
    journal.reconnect_within = WITHIN
    async with journal:
        await journal.flush()
        assert await journal._read(lambda db: db.execute(
            "SELECT count(*) FROM receipts").fetchone()[0]) == 0


async def test_held_receipts_keep_the_order_they_were_posted_in_through_a_second_outage(
        pg_url: str) -> None:
    """A fence's batch carries the oldest held receipts, and fails for want of a connection:
    they are held again before the later ones, so once the server is back a later heartbeat
    is not overwritten by an earlier one."""
    journal = await tether.Journal(pg_url).open()
    runner: Any = journal._runner
    await journal._write(lambda db: db.execute("CREATE TABLE hb (v INTEGER)"))
    await journal._write(lambda db: db.execute("INSERT INTO hb VALUES (0)"))

    def beat(v: int) -> Any:
        return lambda db: db.execute("UPDATE hb SET v = ?", (v,))

    def nothing(db: Any) -> None:
        db.execute("SELECT 1")

    held = [beat(1), *([nothing] * (MAX_BATCH + 50)), beat(2)]
    runner._held = [Op(fn, True, None, order=i + 1) for i, fn in enumerate(held)]
    journal.reconnect_within = 0.3
    connect, runner.connect = runner.connect, _refused
    runner._conn.close()
    fence = runner.submit(nothing, write=True, urgent=True)
    with pytest.raises(JournalError):
        await asyncio.wait_for(fence, WITHIN)
    runner.connect = connect
    journal.reconnect_within = WITHIN
    try:
        await asyncio.wait_for(journal.flush(), WITHIN)
        assert await journal._read(lambda db: db.execute("SELECT v FROM hb").fetchone()[0]) == 2
    finally:
        await journal.close()


async def test_a_writer_a_close_gave_up_on_keeps_no_test_clock_from_moving(
        journal_url: str) -> None:
    """Once a close gave up on a stuck writer, every caller is answered: nothing on that
    writer answers the loop any more, so it does not count as busy (a test clock's autojump
    would stop for the whole process while the stuck call lasts)."""
    journal = await tether.Journal(journal_url).open()
    runner: Any = journal._runner
    runner.stop_wait = 0.2
    hung, release = await stuck_writer(runner)
    later = runner.submit(lambda db: None, write=True)
    await asyncio.wait_for(journal.close(), WITHIN)
    try:
        assert hung.done() and later.done()
        assert not writer.busy()
    finally:
        release.set()
        await asyncio.to_thread(runner._abandoned.join, WITHIN)
    for future in (hung, later):
        with pytest.raises(JournalError):
            await future


async def test_a_batch_lost_every_time_it_runs_fails_within_the_window(pg_url: str) -> None:
    """A server that takes connections but breaks every batch (or a batch the watchdog cuts
    each time it runs): the batch runs again on a new connection within the reconnection
    window, then fails with a JournalError, instead of being run again for ever."""
    async with tether.Journal(pg_url) as journal:
        await journal.flush()
        runner: Any = journal._runner
        journal.reconnect_within = 0.5
        runs = [0]

        def lost(conn: Any, batch: list[Op], careful: bool = False) -> Any:
            runs[0] += 1
            raise Lost(ConnectionError("server closed the connection"), at_commit=False)

        run_batch, runner._run_batch = runner._run_batch, lost
        try:
            with pytest.raises(JournalError, match="under this batch"):
                await asyncio.wait_for(journal._write(lambda db: None), 10.0)
        finally:
            runner._run_batch = run_batch
        assert 1 < runs[0] < 100  # run again, with a backoff, not in a tight loop
        journal.reconnect_within = WITHIN
        await journal.flush()  # and the journal goes on


def _lost_each_time(at_commit: bool) -> Any:
    def lost(conn: Any, batch: list[Op], careful: bool = False) -> Any:
        raise Lost(ConnectionError("server closed the connection"), at_commit=at_commit)

    return lost


async def test_a_server_that_breaks_every_batch_is_down_for_each_batch_after_the_window(
        pg_url: str) -> None:
    """A server that takes connections but breaks every batch is down, as one that refuses
    them is: the first write waits the reconnection window, and each one after it fails at
    once (a supervisor settling its children would otherwise wait a window for each), until
    a batch goes through again."""
    async with tether.Journal(pg_url) as journal:
        await journal.flush()
        runner: Any = journal._runner
        journal.reconnect_within = 0.5
        run_batch, runner._run_batch = runner._run_batch, _lost_each_time(False)
        took = []
        try:
            loop = asyncio.get_running_loop()
            for _ in range(4):
                began = loop.time()
                with pytest.raises(JournalError):
                    await asyncio.wait_for(journal._write(lambda db: None), WITHIN)
                took.append(loop.time() - began)
        finally:
            runner._run_batch = run_batch
        assert took[0] >= 0.5 and sum(took[1:]) < 0.5, took
        await journal.flush()  # a batch goes through: the outage is over
        assert runner._lost_at is None


async def test_held_receipts_written_apart_and_lost_every_time_fail_their_batch_in_time(
        pg_url: str) -> None:
    """More receipts held than fit before a batch go first in batches of their own; if each
    of those is lost as well, the batch behind them fails once the window is over, instead
    of their being run again for ever."""
    async with tether.Journal(pg_url) as journal:
        await journal.flush()
        runner: Any = journal._runner
        journal.reconnect_within = 0.5
        runner._held = [Op(lambda db: None, True, None) for _ in range(MAX_BATCH + 50)]
        run_batch, runner._run_batch = runner._run_batch, _lost_each_time(False)
        runner._drop()  # the writer is idle: the next batch is taken with no connection
        try:
            with pytest.raises(JournalError):
                await asyncio.wait_for(journal._write(lambda db: None), WITHIN)
        finally:
            runner._run_batch = run_batch
        journal.reconnect_within = WITHIN
        await journal.flush()


async def test_a_read_back_lost_every_time_fails_within_the_window(pg_url: str) -> None:
    """A batch lost at its COMMIT is read back on a new connection; a read-back lost again
    and again (a COMMIT hung on a standby that is not there holds the lock the read waits
    on, until the watchdog cuts it) fails the batch once the window is over, with a backoff
    between attempts, instead of reconnecting for ever."""
    async with tether.Journal(pg_url) as journal:
        await journal.flush()
        runner: Any = journal._runner
        journal.reconnect_within = 0.5
        reads = [0]

        def committed(conn: Any) -> bool:
            reads[0] += 1
            conn.close()
            raise ConnectionError("server closed the connection unexpectedly")

        run_batch, runner._run_batch = runner._run_batch, _lost_each_time(True)
        runner.committed, is_lost = committed, runner.is_lost
        runner.is_lost = lambda conn, exc: isinstance(exc, ConnectionError) or is_lost(conn, exc)
        try:
            with pytest.raises(JournalError, match="could not read back"):
                await asyncio.wait_for(journal._write(lambda db: None), WITHIN)
        finally:
            runner._run_batch = run_batch
            del runner.committed, runner.is_lost
        assert 1 < reads[0] < 100, reads
        journal.reconnect_within = WITHIN
        await journal.flush()


async def test_a_drains_reads_see_every_receipt_posted_before_them(journal_url: str) -> None:
    """The drain reads the journal's facts and the calls in doubt without a flush first: a
    read goes through the writer, behind every receipt posted before it, and answers once its
    batch committed. A read beside the writer (``peek``, a pooled connection on PostgreSQL)
    would not see a receipt still queued."""
    async with tether.Journal(journal_url) as journal:
        await journal.create_delegation(root_delegation("d1", "t1"))
        for i in range(2):
            await journal.begin_action(dataclasses.replace(
                pay_action(f"a{i}", "d1", 1.0), ordinal=i, idem_key=f"k{i}"))
        runner: Any = journal._runner
        blocker, hold = await writer_held(runner)  # the receipts wait in its queue
        journal.finish_action("a0", tether.ActionState.COMPLETED, 2.0)  # posted
        journal.finish_action("a1", tether.ActionState.IN_DOUBT, 2.0)
        reads: list[bool] = []
        submit = runner.submit

        def counted(fn: Any, **kw: Any) -> Any:
            reads.append(not kw["write"])
            return submit(fn, **kw)

        runner.submit = counted
        facts = asyncio.ensure_future(journal.facts("d1"))
        unsettled = asyncio.ensure_future(journal.unsettled("d1"))
        await asyncio.sleep(0)  # each read task runs to its first wait: its submission
        runner.submit = submit
        assert reads == [True, True]  # both queued on the writer, behind the receipts
        hold.set()
        await blocker
        assert (await facts).pending == frozenset()
        assert [a.id for a in await unsettled] == ["a1"]
