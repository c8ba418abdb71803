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

import tether
from tests import remote_agents
from tests.test_read_races import Rows, _blocked_by, after_statement, supervisor
from tether._journal import retention
from tether._runtime.tools import Agent


def _workflows(release: asyncio.Event,
               hold: asyncio.Event | None = None) -> tuple[Agent, Agent]:
    """A parent workflow's agent, whose run ends once ``release`` is set, and a child
    workflow's, whose run "k2" first waits for ``hold`` (if given)."""

    async def parent_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        await release.wait()
        return "parent"

    async def child_body(ctx: Any, workflow_id: str, run_id: str) -> str:
        if hold is not None and run_id == "k2":
            await hold.wait()
        return "child"

    return Agent("temporal:Parent", parent_body), Agent("temporal:Child", child_body)


async def test_an_abandoned_child_workflow_opens_its_next_epoch_as_a_run(
        journal_url: str) -> None:
    """A child workflow's first run is a child delegation (its parent hosted here); its
    workflow id runs again on its own once the parent closed (Temporal: an abandoned child, or
    a child whose parent is hosted elsewhere): ``open_run`` moves the task from the child's
    epoch to a root at the next one. The check that the epoch moved from is still there
    (not pruned) must find it among the children too."""
    from tether._integrations.temporal_task import task_of

    async with supervisor(journal_url) as host:
        await _cross_tree(host)  # its last step opens the run on its own
        rows = [r for r in await host.journal.delegations() if r.task_id == task_of("wf-kid")]
    assert sorted((r.epoch, r.parent_id is None) for r in rows) == [(0, False), (1, True)]


async def test_a_prune_keeps_a_child_task_epoch_a_live_run_replays(journal_url: str) -> None:
    """The child workflow's task lives on as a root at epoch 1 (live, replaying epoch 0's calls
    by key); a prune of the parent's tree must keep epoch 0 (a node of that tree), or its
    receipts go under a live epoch."""
    from tether._integrations.temporal_runs import open_child, open_run
    from tether._integrations.temporal_task import task_of

    release, hold = asyncio.Event(), asyncio.Event()
    p_agent, c_agent = _workflows(release, hold)
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
    p_agent, c_agent = _workflows(release, release)
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
    deadlocks = _deadlock_counter(monkeypatch)
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
            return real(after_statement(db, "WITH RECURSIVE up(", recall), *args)

        monkeypatch.setattr(retention, "tree_prunable", judged)
        now = time.time()
        summary = await a.journal.prune([old.id], now + 1, now + 1, None)
        monkeypatch.setattr(retention, "tree_prunable", real)
        await asyncio.wrap_future(rival[0])
    assert summary["delegations"] in (0, 2)  # kept, or both epochs once the recall settled
    assert deadlocks == []


async def test_a_child_run_never_opens_an_epoch_over_a_pruned_one(journal_url: str) -> None:
    """A workflow id ran on its own (root, epoch 0), settled and was pruned; it runs again as
    a child workflow: its next epoch would replay none of the pruned calls' receipts, and the
    journal would read its own prune as an epoch deleted by hand. Refused, as ``open_run``
    refuses it."""
    from tether._integrations.temporal_runs import open_child, open_run
    release = asyncio.Event()

    async def body(ctx: Any, workflow_id: str, run_id: str) -> str:
        if workflow_id == "wf-par":
            await release.wait()
        return "ok"

    agent = Agent("temporal:X", body)
    async with supervisor(journal_url) as host:
        first = await open_run(host, "wf-kid", "k1", agent)
        await first.wait()
        await host.journal.flush()
        now = time.time() + 3600
        summary = await host.journal.prune([first.id], now, now, None)
        assert summary["delegations"] == 1
        parent = await open_run(host, "wf-par", "p1", agent)
        with pytest.raises(tether.errors.NotFound, match="pruned"):
            await open_child(host, parent.id, "wf-kid", "k2", agent)
        release.set()
        await parent.wait()


async def _cross_tree(host: tether.Supervisor) -> tuple[tether.Handle, tether.Handle]:
    """A child workflow's run (epoch 0 of its task, a child in its parent's tree) that ran
    again on its own (epoch 1, a root): one task across two trees, all of it settled."""
    from tether._integrations.temporal_runs import open_child, open_run

    release = asyncio.Event()
    p_agent, c_agent = _workflows(release)
    parent = await open_run(host, "wf-par", "p1", p_agent)
    child = await open_child(host, parent.id, "wf-kid", "k1", c_agent)
    await child.wait()
    release.set()
    await parent.wait()
    again = await open_run(host, "wf-kid", "k2", c_agent)
    await again.wait()
    await host.journal.flush()
    return parent, again


async def test_a_task_across_two_settled_trees_is_pruned_with_both(journal_url: str) -> None:
    """Trees that share a task go together, once all of them may: settled long before the
    cut-off, the dry run lists both for either root (what goes, and what an archive must
    hold), and both are pruned (each kept the other before: never pruned, for ever, with every
    other child of the parent). Listed alone, a tree that goes only with another is kept."""
    async with supervisor(journal_url) as host:
        parent, again = await _cross_tree(host)
        now = time.time() + 3600
        assert await host.journal.prunable([parent.id], now, now) == sorted(
            [parent.id, again.id], key=lambda r: r != parent.id)
        assert set(await host.journal.prunable([again.id], now, now)) == {parent.id, again.id}
        alone = await host.journal.prune([parent.id], now, now, None)
        assert alone["delegations"] == 0 and alone["kept"] == [parent.id]
        summary = await host.journal.prune([parent.id, again.id], now, now, None)
        left = await host.journal.delegations()
    assert summary["delegations"] == 3 and summary["roots"] == 2 and left == [], summary


def _deadlock_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every deadlock PostgreSQL broke in this test's batches (each ran again)."""
    from tether._journal import postgres

    deadlocks: list[str] = []
    real_map = postgres.PostgresRunner.map_error

    def map_error(self: Any, exc: Exception) -> Exception:
        if isinstance(exc, psycopg.errors.DeadlockDetected):
            deadlocks.append(str(exc))
        return real_map(self, exc)

    monkeypatch.setattr(postgres.PostgresRunner, "map_error", map_error)
    return deadlocks


async def test_a_child_task_reopened_apart_while_its_parent_is_recalled_never_deadlocks(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child workflow's task (child C of P, epoch 0) reopened apart (a re-delegation to a
    root at epoch 1: C share-locked, then the task's row) while P is recalled: the recall
    takes P, then C, then the subtree's tasks' rows (a delegation's row before its task's, as
    every writer), never the task's row before C's (a deadlock: PostgreSQL aborts one after a
    second, and its batch runs again)."""
    from tests.test_read_races import _blocked_by
    from tether._journal import ops
    from tether._journal.rows import NewDelegation

    deadlocks = _deadlock_counter(monkeypatch)
    loop = asyncio.get_running_loop()
    args: dict[str, Any] = {"args": [], "kwargs": {}}
    async with supervisor(pg_url) as a, supervisor(pg_url) as b:
        await a.journal.create_delegation(NewDelegation(
            id="d_parent", task_id="TP", parent_id=None, attempt=1, agent="x", surface=(),
            args=args, owner_id=a.owner_id, now=a.clock.wall()))
        await a.journal.create_delegation(NewDelegation(
            id="d_kid0", task_id="TC", parent_id="d_parent", attempt=1, agent="y",
            surface=(), args=args, owner_id=a.owner_id, now=a.clock.wall(), parent_epoch=0))
        await a.journal.flush()
        recalling: list[Any] = []
        real = ops.create_delegation

        def create(db: Any, new: NewDelegation) -> Any:
            if new.redelegate_from_epoch is None or recalling:
                return real(db, new)
            pid = db.execute("SELECT pg_backend_pid()").fetchone()[0]

            class Db:
                def __getattr__(self, name: str) -> Any:
                    return getattr(db, name)

                def execute(self, statement: str, params: Any = ()) -> Any:
                    cursor = db.execute(statement, params)
                    if "/*LOCK d*/" in statement and not recalling:
                        rows = cursor.fetchall()
                        recalling.append(asyncio.run_coroutine_threadsafe(
                            b.handle_for("d_parent").recall(0.1, "stop"), loop))
                        deadline = time.monotonic() + 30
                        while not recalling[0].done() and not _blocked_by(pid):
                            assert time.monotonic() < deadline
                            time.sleep(0.01)
                        return Rows(rows)
                    return cursor

            return real(Db(), new)

        monkeypatch.setattr(ops, "create_delegation", create)
        row = await a.journal.create_delegation(NewDelegation(
            id="d_apart1", task_id="TC", parent_id=None, attempt=1, agent="y", surface=(),
            args=args, owner_id=a.owner_id, now=a.clock.wall(), redelegate_from_epoch=0))
        monkeypatch.setattr(ops, "create_delegation", real)
        await asyncio.wait_for(asyncio.gather(asyncio.wrap_future(recalling[0]),
                                              return_exceptions=True), 30)
    assert row.epoch == 1
    assert deadlocks == [], deadlocks
