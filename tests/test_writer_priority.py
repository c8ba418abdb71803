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
from tests.journal_helpers import writer_held
from tether._journal.runner import MAX_BATCH

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
