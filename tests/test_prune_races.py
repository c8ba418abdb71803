"""A prune of a task's epochs while another epoch of the task lives, as a root or as a child
of another tree (a Temporal workflow id that runs on its own and as a child workflow), and
while its live epoch is recalled: the prune keeps what a live epoch replays by key, and its
locks never deadlock with the hot path's (a delegation's row before its task's)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from tests import remote_agents
from tests.test_read_races import _blocked_by, after_statement, supervisor
from tether._journal import retention
from tether._runtime.tools import Agent


async def test_an_abandoned_child_workflow_opens_its_next_epoch_as_a_run(
        journal_url: str) -> None:
    """A child workflow's first run is a child delegation (its parent hosted here); its
    workflow id runs again on its own once the parent closed (Temporal: an abandoned child, or
    a child whose parent is hosted elsewhere): ``open_run`` moves the task from the child's
    epoch to a root at the next one. The check that the epoch moved from is still there
    (not pruned) must find it among the children too."""
    from tether._integrations.temporal_runs import open_child, open_run
    from tether._integrations.temporal_task import task_of

    release = asyncio.Event()

    async def parent_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        await release.wait()
        return "parent"

    async def child_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        return "child"

    p_agent, c_agent = Agent("temporal:Parent", parent_body), Agent("temporal:Child", child_body)
    async with supervisor(journal_url) as host:
        parent = await open_run(host, "wf-par", "p1", p_agent)
        child = await open_child(host, parent.id, "wf-kid", "k1", c_agent)
        await child.wait()
        release.set()
        await parent.wait()
        again = await open_run(host, "wf-kid", "k2", c_agent)
        await again.wait()
        await host.journal.flush()
        rows = [r for r in await host.journal.delegations() if r.task_id == task_of("wf-kid")]
    assert sorted((r.epoch, r.parent_id is None) for r in rows) == [(0, False), (1, True)]


async def test_a_prune_keeps_a_child_task_epoch_a_live_run_replays(journal_url: str) -> None:
    """The child workflow's task lives on as a root at epoch 1 (live, replaying epoch 0's calls
    by key); a prune of the parent's tree must keep epoch 0 (a node of that tree), or its
    receipts go under a live epoch."""
    from tether._integrations.temporal_runs import open_child, open_run
    from tether._integrations.temporal_task import task_of

    release, hold = asyncio.Event(), asyncio.Event()

    async def parent_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        await release.wait()
        return "parent"

    async def child_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        if run_id == "k2":
            await hold.wait()
        return "child"

    p_agent, c_agent = Agent("temporal:Parent", parent_body), Agent("temporal:Child", child_body)
    async with supervisor(journal_url) as host:
        parent = await open_run(host, "wf-par", "p1", p_agent)
        child = await open_child(host, parent.id, "wf-kid", "k1", c_agent)
        await child.wait()
        release.set()
        await parent.wait()
        again = await open_run(host, "wf-kid", "k2", c_agent)  # live at epoch 1
        now = time.time()
        summary = await host.journal.prune([parent.id], now + 1, now + 1, None)
        hold.set()
        await again.wait()
        rows = [r for r in await host.journal.delegations() if r.task_id == task_of("wf-kid")]
    assert summary["delegations"] == 0, summary
    assert sorted(r.epoch for r in rows) == [0, 1]


async def test_a_prune_keeps_a_root_epoch_a_live_child_epoch_replays(journal_url: str) -> None:
    """A workflow id first runs on its own (a root, epoch 0 of task C, settled); it runs again
    as a child workflow under a parent hosted here (``open_child``: a child at epoch 1 of task
    C, live, replaying epoch 0's calls by key). A prune of the old root must keep it: listed
    among roots alone, epoch 0 read as superseded and went under a live epoch 1 (its receipts
    gone: refunds run again; epoch_gaps then named epoch 0 deleted by hand: Tampered)."""
    from tether._integrations.temporal_runs import open_child, open_run

    release = asyncio.Event()

    async def parent_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        await release.wait()
        return "parent"

    async def child_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        if run_id == "k2":
            await release.wait()
        return "child"

    p_agent, c_agent = Agent("temporal:Parent", parent_body), Agent("temporal:Child", child_body)
    async with supervisor(journal_url) as host:
        first = await open_run(host, "wf-kid", "k1", c_agent)  # a root, epoch 0
        await first.wait()
        parent = await open_run(host, "wf-par", "p1", p_agent)
        child = await open_child(host, parent.id, "wf-kid", "k2", c_agent)  # epoch 1, live
        now = time.time()
        summary = await host.journal.prune([first.id], now + 1, now + 1, None)
        gaps = await host.journal.epoch_gaps([child.id])
        release.set()
        await child.wait()
        await parent.wait()
    assert summary["delegations"] == 0 and gaps == {}, (summary, gaps)


async def test_a_prune_and_a_recall_of_the_tasks_live_epoch_never_deadlock(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune of a task's settled epoch 0 while epoch 1 lives, and a recall of epoch 1 at the
    same moment: a recall takes its delegation's row (``before``), then the task's row (its
    cancel generation); a prune that took the task's row before the delegations' would
    deadlock with it (PostgreSQL aborts one after deadlock_timeout, and it runs again)."""
    from tether._journal import postgres

    deadlocks: list[str] = []
    real_map = postgres.PostgresRunner.map_error

    def map_error(self: Any, exc: Exception) -> Exception:
        if isinstance(exc, psycopg.errors.DeadlockDetected):
            deadlocks.append(str(exc))
        return real_map(self, exc)

    monkeypatch.setattr(postgres.PostgresRunner, "map_error", map_error)
    loop = asyncio.get_running_loop()
    async with supervisor(pg_url) as a, supervisor(pg_url) as b:
        old = await a.delegate(remote_agents.refunder, "R-9", remote=True)
        await old.recall(grace=5, reason="re-plan")  # epoch 0: settled, never started
        new = await old.redelegate()  # epoch 1: queued, live
        rival: list[Any] = []
        real = retention.tree_prunable

        def recall(db: Any) -> None:
            pid = db.execute("SELECT pg_backend_pid()").fetchone()[0]
            rival.append(asyncio.run_coroutine_threadsafe(
                b.handle_for(new.id).recall(grace=5, reason="stop"), loop))
            deadline = time.monotonic() + 30
            while not rival[0].done() and not _blocked_by(pid):
                assert time.monotonic() < deadline
                time.sleep(0.01)

        def judged(db: Any, *args: Any) -> Any:
            return real(after_statement(db, "FROM delegations WHERE task_id = ?", recall), *args)

        monkeypatch.setattr(retention, "tree_prunable", judged)
        now = time.time()
        summary = await a.journal.prune([old.id], now + 1, now + 1, None)
        monkeypatch.setattr(retention, "tree_prunable", real)
        await asyncio.wrap_future(rival[0])
    assert summary["delegations"] in (0, 2)  # kept, or both epochs once the recall settled
    assert deadlocks == []
