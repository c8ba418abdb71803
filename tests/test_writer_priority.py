"""A control intent never waits behind a backlog of writes in the journal's writer: a busy
supervisor may have thousands of receipts and events queued when a recall comes, and its
fence must not wait for all of them (issue 24, item 2): an urgent operation goes into the
batch after the one running when it is queued, whatever the backlog. (A recall without a
sequence reads it first, itself urgent: then the fence waits for at most two batches.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import tether
from tests.conftest import until
from tests.journal_helpers import writer_held
from tether._journal.runner import MAX_BATCH, Backlog, Op

BACKLOG = 4 * MAX_BATCH


async def test_a_recall_is_journaled_ahead_of_a_backlog_of_writes(journal_url: str) -> None:
    async with tether.Supervisor(journal_url) as sup:
        stop = asyncio.Event()

        async def waits(ctx: tether.Context) -> None:
            await stop.wait()

        child = await sup.delegate(tether.Agent("idle", waits))
        runner: Any = sup.journal._runner
        submit, queued = runner.submit, asyncio.Event()

        def watched(fn: Any, **kw: Any) -> Any:
            future = submit(fn, **kw)
            if kw.get("wait", True):  # the recall's intent (the backlog is posted)
                queued.set()
            return future

        blocker, hold = await writer_held(runner)
        for _ in range(BACKLOG):
            sup.journal.event(time.time(), "backlog", child.id)
        runner.submit = watched
        # The sequence given: one operation, queued while the writer is held, so the batch
        # it goes into is the first after the hold, whatever the machine's timing.
        recall = asyncio.ensure_future(child.recall(grace=5, seq=1))
        await queued.wait()
        runner.submit = submit
        hold.set()
        await blocker
        report = await recall
        assert report.outcome is tether.DelegationState.RECALLED
        rows = await sup.journal._read(lambda db: db.execute(
            "SELECT id, kind FROM events WHERE delegation_id = ? AND kind IN "
            "('backlog', 'control') ORDER BY id", (child.id,)).fetchall())
        kinds = [kind for _, kind in rows]
        assert kinds.count("backlog") == BACKLOG and kinds.count("control") == 1
        behind = len(kinds) - 1 - kinds.index("control")  # backlog journaled after the fence
        waited = BACKLOG - behind
        assert waited < MAX_BATCH, f"the fence waited for {waited} queued writes"


async def test_an_urgent_operation_runs_after_what_was_submitted_before_it_in_its_batch(
        journal_url: str) -> None:
    """Urgent operations skip the backlog into the next batch, but within that batch every
    operation runs in the order it was submitted (as the simulator's inline runner runs
    them): a write queued before an intent, such as a call's intent or receipt, still runs
    before it, and the rest of the backlog after."""
    async with tether.Journal(journal_url) as j:
        runner: Any = j._runner
        ran: list[str] = []

        def note(name: str) -> Any:
            def op(db: Any) -> None:
                ran.append(name)
            return op

        blocker, hold = await writer_held(runner)
        earlier = runner.submit(note("earlier"), write=True)
        for i in range(2 * MAX_BATCH):
            runner.submit(note(f"backlog-{i}"), write=True, wait=False)
        urgent = runner.submit(note("urgent"), write=True, urgent=True)
        hold.set()
        await blocker
        await asyncio.gather(earlier, urgent)
        await j.flush()
        assert ran.index("earlier") < ran.index("urgent") < MAX_BATCH + 1, ran[:3]
        assert ran.index("urgent") > ran.index(f"backlog-{MAX_BATCH - 3}")  # order kept
        assert len(ran) == 2 * MAX_BATCH + 2


async def test_a_storm_of_urgent_operations_keeps_batches_capped_and_queued_writes_moving(
        journal_url: str) -> None:
    """A storm of recalls (thousands of intents at once) behind a backlog: no batch is
    longer than MAX_BATCH (one that were would outlast the watchdog on PostgreSQL and run
    again for ever), and the writes queued before the storm still get their share of each
    batch: all of them commit within the first two batches, not after the whole storm."""
    async with tether.Journal(journal_url) as j:
        runner: Any = j._runner
        sizes: list[tuple[int, int]] = []  # (urgent, others) per batch
        run = runner._run

        def counted(batch: list[Any]) -> Any:
            urgent = sum(op.urgent for op in batch)
            sizes.append((urgent, len(batch) - urgent))
            return run(batch)

        blocker, hold = await writer_held(runner)
        runner._run = counted
        noop: Any = lambda db: None  # noqa: E731
        writes = [runner.submit(noop, write=True) for _ in range(MAX_BATCH)]
        storm = [runner.submit(noop, write=True, urgent=True) for _ in range(3 * MAX_BATCH)]
        hold.set()
        await blocker
        await asyncio.gather(*writes, *storm)
    assert all(u + o <= MAX_BATCH for u, o in sizes), sizes
    assert sum(o for _, o in sizes[:2]) == MAX_BATCH, sizes[:3]
    assert sum(u for u, _ in sizes) == 3 * MAX_BATCH


async def test_a_recall_never_overtakes_its_childs_queued_end(journal_url: str) -> None:
    """A child whose code returned has its end queued behind a backlog when it is recalled:
    the recall waits its turn behind that end instead of skipping it, so the child is
    reported finished with its result, not recalled with its result dropped. (The fence
    skips the backlog of every delegation but one whose end this process already queued.)"""
    async with tether.Supervisor(journal_url) as sup:
        go = asyncio.Event()

        async def answers(ctx: tether.Context) -> str:
            await go.wait()
            return "done"

        child = await sup.delegate(tether.Agent("answers", answers))
        runner: Any = sup.journal._runner
        blocker, hold = await writer_held(runner)
        for _ in range(BACKLOG):
            sup.journal.event(time.time(), "backlog", child.id)
        go.set()
        await until(lambda: sup.journal.moving([child.id]), "the child's end queued")
        recall = asyncio.ensure_future(child.recall(grace=5, seq=1))
        await asyncio.sleep(0)
        hold.set()
        await blocker
        report = await recall
        assert report.outcome is tether.DelegationState.SUCCEEDED
        assert await child.result() == "done"


def test_the_backlog_takes_urgent_operations_first_within_their_share_in_submission_order(
        ) -> None:
    """The choice of each batch, as both runners make it: urgent operations first but at most
    half of a batch others wait for, the rest filled in order, the batch in submission
    order; with nobody else waiting, urgent ones fill a batch."""
    backlog = Backlog(cap=4)
    ops = [Op(lambda db: None, True, None, urgent=n in (2, 5, 6, 7)) for n in range(8)]
    for op in ops:
        backlog.add(op)
    assert [ops.index(op) for op in backlog.take()] == [0, 1, 2, 5]
    assert [ops.index(op) for op in backlog.take()] == [3, 4, 6, 7]
    assert len(backlog) == 0
    for op in ops[:3]:
        backlog.add(op)
    assert [ops.index(op) for op in backlog.drain()] == [0, 1, 2]
    # More urgent operations than their share, then another: the later one never goes past
    # the urgent ones left for the next batch (a flush waits for all before it).
    later = [Op(lambda db: None, True, None, urgent=n < 4) for n in range(5)]
    for op in later:
        backlog.add(op)
    assert [later.index(op) for op in backlog.take()] == [0, 1, 2, 3]
    assert [later.index(op) for op in backlog.take()] == [4]


async def test_a_terminate_never_overtakes_an_ancestors_queued_settle(journal_url: str) -> None:
    """R's recall has settled and its drain queued the settle of R's tree behind a backlog
    when R's child D is terminated: the intent waits its turn behind that settle instead of
    skipping it, so D stays as R's drain settled it, with no intent accepted after R's
    report concluded."""
    forever = asyncio.Event()
    handles: list[tether.Handle] = []

    async def leaf(ctx: tether.Context) -> None:
        await forever.wait()

    leaf_agent = tether.Agent("leaf", leaf)

    async def root(ctx: tether.Context) -> None:
        handles.append(await ctx.delegate(leaf_agent))
        await forever.wait()

    async with tether.Supervisor(journal_url) as sup:
        r = await sup.delegate(tether.Agent("root", root, tools=(leaf_agent,)))
        await until(lambda: bool(handles), "the child started")
        d = handles[0]
        runner: Any = sup.journal._runner
        settle = sup.journal.settle_tree
        terminated: list[asyncio.Future[tether.Report]] = []

        async def held(root_id: str, *args: Any, **kw: Any) -> None:
            if root_id != r.id or terminated:
                return await settle(root_id, *args, **kw)
            blocker, hold = await writer_held(runner)
            for _ in range(BACKLOG):
                sup.journal.event(time.time(), "backlog", r.id)
            settled = asyncio.ensure_future(settle(root_id, *args, **kw))
            await until(lambda: sup.journal.moving([r.id]), "R's settle queued")
            submit, queued = runner.submit, asyncio.Event()

            def watched(fn: Any, **how: Any) -> Any:
                future = submit(fn, **how)
                if how.get("write") and how.get("wait", True):  # the terminate's intent
                    queued.set()
                return future

            runner.submit = watched
            terminated.append(asyncio.ensure_future(d.terminate("stop the child")))
            await queued.wait()
            runner.submit = submit
            hold.set()
            await blocker
            return await settled

        sup.journal.settle_tree = held  # type: ignore[method-assign]
        report = await r.recall(grace=0.2)
        assert terminated, "R's drain settled its tree"
        await asyncio.gather(*terminated, return_exceptions=True)
        assert await sup.journal.controls(d.id) == []
        assert [c.outcome for c in report.children] == [tether.DelegationState.RECALLED]


async def test_a_flush_waits_for_every_operation_queued_before_it(journal_url: str) -> None:
    """More urgent operations than their share of a batch, then writes and a flush: the
    flush returns only once everything queued before it committed, the urgent operations
    left for the next batch included (none of the later writes goes past them)."""
    async with tether.Journal(journal_url) as j:
        runner: Any = j._runner
        blocker, hold = await writer_held(runner)
        noop: Any = lambda db: None  # noqa: E731
        urgent = [runner.submit(noop, write=True, urgent=True) for _ in range(MAX_BATCH)]
        for _ in range(MAX_BATCH // 4):
            runner.submit(noop, write=True, wait=False)
        flushed = asyncio.ensure_future(j.flush())
        hold.set()
        await blocker
        await flushed
        assert sum(f.done() for f in urgent) == MAX_BATCH
