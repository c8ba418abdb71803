"""Judgments made from several reads while other processes write. On PostgreSQL each statement
sees what committed before it (READ COMMITTED), and separate read transactions see different
moments on either backend: a legitimate write committing between two reads must not make a
judgment come out wrong. Each test puts a real rival's commit exactly between the two reads
(the first read's operation runs it before returning), and fails on the code before its fix."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tether
from tests import remote_agents
from tests.conftest import PG_URL
from tests.operator_world import stuck_payment
from tether._cli.render import collect
from tether._journal import ops, retention, trustops
from tether._runtime.audit import verify_journal


def supervisor(url: str, **kw: Any) -> tether.Supervisor:
    return tether.Supervisor(url, tools=remote_agents.TOOLS, recover=False, **kw)


class Rows:
    """A read's rows, fetched already (the rival commits after the statement ran)."""

    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def fetchall(self) -> list[Any]:
        return self._rows

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None


def after_statement(db: Any, marker: str, rival: Callable[[Any], None]) -> Any:
    """``db``, but the first statement containing ``marker`` runs ``rival`` right after it."""
    fired: list[bool] = []

    class Db:
        def __getattr__(self, name: str) -> Any:
            return getattr(db, name)

        def execute(self, statement: str, params: Any = ()) -> Any:
            cursor = db.execute(statement, params)
            if marker in statement and not fired:
                fired.append(True)
                rows = cursor.fetchall()
                rival(db)
                return Rows(rows)
            return cursor

    return Db()


async def recall_by_new_operator(url: str, root: tether.Supervisor, operator: tether.KeyRing,
                                 delegation_id: str) -> tether.Report:
    """The root key trusts ``operator``'s key, then ``operator`` recalls the delegation."""
    await root.journal.change_trust(
        root.keys.signer, root.keys.trusted, "trust", operator.signer.key_id,
        operator.signer.public_b64(), "new operator", time.time())
    async with supervisor(url, keys=operator) as c:
        return await c.handle_for(delegation_id).recall(grace=5, reason="r")


async def _orphaned_queued_task(url: str) -> tether.Handle:
    """A task queued by an orchestrator that has since died (its heartbeat long past)."""
    async with supervisor(url) as orchestrator:
        handle = await orchestrator.delegate(remote_agents.refunder, "R-1", remote=True)
        orchestrator.journal.heartbeat(orchestrator.owner_id, 0.0)
        await orchestrator.journal.flush()
        return handle


async def test_recovery_leaves_alone_a_task_a_live_worker_claimed_meanwhile(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery lists the live delegations, finds the queued task's owner (the orchestrator
    that queued it) dead, and terminates it. A worker that claims the task right after the
    listing owns it now, alive: recovery must leave it to that worker, never terminate its
    fresh work (``OwnerChanged``: the terminate holds only while the owner judged gone
    still owns it)."""
    handle = await _orphaned_queued_task(journal_url)
    loop = asyncio.get_running_loop()
    async with supervisor(journal_url) as worker, supervisor(journal_url) as rec:
        assert await worker.journal.renew_lease(worker.owner_id, time.time(), 600.0)
        claimed: list[Any] = []
        real = ops.list_delegations

        def listed(db: Any, live_only: bool = False) -> Any:
            rows = real(db, live_only)
            if live_only and not claimed:
                claimed.extend(asyncio.run_coroutine_threadsafe(worker.journal.claim(
                    worker.owner_id, (remote_agents.refunder.name,), time.time(), 1),
                    loop).result(timeout=30))
            return rows

        monkeypatch.setattr(ops, "list_delegations", listed)
        reports = await rec.recover()
        row = await rec.journal.get(handle.id)
    assert [r.id for r in claimed] == [handle.id]
    assert reports == [] and row.owner_id == worker.owner_id
    assert row.state is tether.DelegationState.RUNNING and not row.fenced


def _blocked_by(pid: int) -> bool:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                           "WHERE %s = ANY(pg_blocking_pids(pid))", (pid,)).fetchone()
    return bool(row and row[0])


async def test_a_redelegation_racing_a_prune_never_loses_the_epoch_it_replays(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune judges a task's epochs and deletes them together; a re-delegation moves the
    task to a new epoch that replays the old one's receipts by their keys. The re-delegation
    either commits before the prune lists the epochs (and the live new epoch keeps them all),
    or waits and finds its epoch pruned: never a new epoch over a pruned one (its receipts
    gone, its payments run again; the journal reads as tampered)."""
    loop = asyncio.get_running_loop()
    async with supervisor(pg_url) as a, supervisor(pg_url) as b:
        handle = await a.delegate(remote_agents.refunder, "R-2", remote=True)
        await handle.recall(grace=5, reason="re-plan")  # settled, never started: prunable
        rival: list[Any] = []
        real = retention.tree_prunable

        def redelegate(db: Any) -> None:
            # The rival starts right after the prune listed the task's epochs, and the prune
            # goes on once the rival committed or waits on the prune's locks.
            pid = db.execute("SELECT pg_backend_pid()").fetchone()[0]
            rival.append(asyncio.run_coroutine_threadsafe(
                b.handle_for(handle.id).redelegate(), loop))
            deadline = time.monotonic() + 30
            while not rival[0].done() and not _blocked_by(pid):
                assert time.monotonic() < deadline, "the rival neither committed nor waited"
                time.sleep(0.01)

        def judged(db: Any, *args: Any) -> Any:
            return real(after_statement(db, "WITH RECURSIVE up(", redelegate),
                        *args)

        monkeypatch.setattr(retention, "tree_prunable", judged)
        now = time.time()
        summary = await a.journal.prune([handle.id], now + 1, now + 1, None)
        monkeypatch.setattr(retention, "tree_prunable", real)
        try:
            new: tether.Handle | None = await asyncio.wrap_future(rival[0])
        except tether.errors.NotFound:
            new = None
        rows = [r for r in await a.journal.delegations() if r.task_id == handle.task_id]
        if new is not None:  # it won: the prune kept every epoch of the task
            assert summary["delegations"] == 0
            assert sorted(r.epoch for r in rows) == [0, 1]
            await a.journal.untampered([new.id], a.keys.trusted, "check")
        else:  # it waited: the task went as a whole, and no epoch came after
            assert summary["delegations"] == 1 and rows == []


async def test_verify_under_a_prune_names_no_problem(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tether verify` lists the delegations, then reads each one's intents and parents: a
    prune committing in between is no tampering (a settled tree gone as a whole)."""
    loop = asyncio.get_running_loop()
    async with supervisor(journal_url) as a, supervisor(journal_url) as pruner:
        handle = await a.delegate(remote_agents.refunder, "R-3", remote=True)
        await handle.recall(grace=5, reason="done with it")
        real = ops.list_delegations
        pruned: list[Any] = []

        def listed(db: Any, live_only: bool = False) -> Any:
            rows = real(db, live_only)
            if not pruned:
                now = time.time()
                pruned.append(asyncio.run_coroutine_threadsafe(pruner.journal.prune(
                    [handle.id], now + 1, now + 1, None), loop).result(timeout=30))
            return rows

        monkeypatch.setattr(ops, "list_delegations", listed)
        during = await verify_journal(a.journal, a.keys, None)
    assert pruned[0]["delegations"] == 1
    assert during["problems"] == [] and during["ok"]


async def test_a_key_trusted_and_used_during_a_chain_check_is_no_tampering(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain check reads the key registry, then the chains: an operator's key trusted, and
    its recall sealed with that key, both committed in between, are no tampering."""
    loop = asyncio.get_running_loop()
    operator = tether.KeyRing.init(tmp_path / "operator")
    async with supervisor(journal_url) as a, supervisor(journal_url) as root, \
            supervisor(journal_url) as checker:  # a process apart: the owner drains meanwhile
        operator.pin(root.keys.signer.key_id, root.keys.signer.public_b64())
        handle = await a.delegate(remote_agents.refunder, "R-4", remote=True)
        real = trustops.registry
        recalled: list[Any] = []
        fired: list[bool] = []

        async def rival() -> None:
            recalled.append(await recall_by_new_operator(journal_url, root, operator,
                                                         handle.id))

        def registry(db: Any, pins: Any) -> Any:
            found = real(db, pins)
            if not fired:  # the rival's own reads of the registry go through here too
                fired.append(True)
                asyncio.run_coroutine_threadsafe(rival(), loop).result(timeout=30)
            return found

        monkeypatch.setattr(trustops, "registry", registry)
        bad = [v for v in await checker.journal.chain_verdicts([handle.id],
                                                                checker.keys.trusted)
               if not v.ok]
    assert recalled[0].outcome is tether.DelegationState.RECALLED
    assert bad == []


async def test_show_under_a_prune_says_the_tree_is_gone_not_tampered(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tether show` and the console read the tree, then its chain, actions, intents and
    events: a prune committing in between took a settled tree as a whole. What is shown is
    that it is gone (NotFound, as for any delegation not in the journal), never its records
    as tampered or missing."""
    loop = asyncio.get_running_loop()
    async with supervisor(journal_url) as a, supervisor(journal_url) as pruner:
        handle = await a.delegate(remote_agents.refunder, "R-5", remote=True)
        await handle.recall(grace=5, reason="done with it")
        real = ops.subtree
        pruned: list[Any] = []

        def subtree(db: Any, root_id: str) -> Any:
            rows = real(db, root_id)
            if not pruned:
                now = time.time()
                pruned.append(asyncio.run_coroutine_threadsafe(pruner.journal.prune(
                    [handle.id], now + 1, now + 1, None), loop).result(timeout=30))
            return rows

        monkeypatch.setattr(ops, "subtree", subtree)
        with pytest.raises(tether.errors.NotFound):
            await collect(a.journal, handle.id, a.keys.trusted)
    assert pruned[0]["delegations"] == 1


async def test_show_of_a_recall_signed_by_a_key_trusted_meanwhile_verifies_it(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tether show` reads the tree, then its intents: an operator's key trusted, and a recall
    signed with it, both committed in between, verify (the console's view reads the same
    way): the key registry is read after the intents, never before."""
    loop = asyncio.get_running_loop()
    operator = tether.KeyRing.init(tmp_path / "operator")
    async with supervisor(journal_url) as a, supervisor(journal_url) as root, \
            supervisor(journal_url) as viewer:  # a process apart: the owner drains meanwhile
        operator.pin(root.keys.signer.key_id, root.keys.signer.public_b64())
        handle = await a.delegate(remote_agents.refunder, "R-6", remote=True)
        real = ops.subtree
        recalled: list[Any] = []

        async def rival() -> None:
            recalled.append(await recall_by_new_operator(journal_url, root, operator,
                                                         handle.id))

        def subtree(db: Any, root_id: str) -> Any:
            rows = real(db, root_id)
            if not recalled:  # the rival's own reads of a tree go through here too
                recalled.append(None)
                asyncio.run_coroutine_threadsafe(rival(), loop).result(timeout=30)
            return rows

        monkeypatch.setattr(ops, "subtree", subtree)
        shown = await collect(viewer.journal, handle.id, viewer.keys.trusted)
    assert recalled[1].outcome is tether.DelegationState.RECALLED
    recall = [i for i in shown["intents"] if i["kind"] == "RECALL"]
    assert [i["key_id"] for i in recall] == [operator.signer.key_id]
    assert {i["verified"] for i in shown["intents"]} == {"ok"}
    assert shown["chain"] == "ok" and shown["tampered"] == []


async def test_show_of_a_decision_recorded_meanwhile_shows_it_signed(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A person's decision is its signed document and its event, committed together: one
    recorded while `tether show` reads (after the documents) is shown as signed, never as a
    decision that no verified document says."""
    stuck = await stuck_payment(journal_url)
    loop = asyncio.get_running_loop()
    async with tether.Supervisor(journal_url, recover=False) as decider, \
            tether.Supervisor(journal_url, recover=False) as viewer:
        real = ops.documents
        fired: list[bool] = []

        def documents(db: Any, delegation_id: str) -> Any:
            rows = real(db, delegation_id)
            if not fired:
                fired.append(True)
                asyncio.run_coroutine_threadsafe(decider.resolve(
                    stuck.action, "COMPLETED", "the bank says paid", operator="Ada"),
                    loop).result(timeout=30)
            return rows

        monkeypatch.setattr(ops, "documents", documents)
        shown = await collect(viewer.journal, stuck.delegation, viewer.keys.trusted)
        later = await collect(viewer.journal, stuck.delegation, viewer.keys.trusted)

    def signed(view: dict[str, Any]) -> list[Any]:
        return [d.get("signed") for d in view["decisions"] if d["kind"] == "resolved"]

    assert signed(shown) in ([], ["ok"])  # not read yet, or read whole
    assert signed(later) == ["ok"]


async def test_show_with_nothing_changing_reads_its_view_once(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that a view held (the tree still there, the registry the same) costs one
    read of each when nothing changed, not a second view."""
    async with supervisor(journal_url) as a:
        handle = await a.delegate(remote_agents.refunder, "R-7", remote=True)
        await handle.recall(grace=5, reason="done with it")
        real = ops.subtree
        reads: list[str] = []

        def subtree(db: Any, root_id: str) -> Any:
            reads.append(root_id)
            return real(db, root_id)

        monkeypatch.setattr(ops, "subtree", subtree)
        shown = await collect(a.journal, handle.id, a.keys.trusted)
    assert reads == [handle.id, handle.id]
    assert {i["verified"] for i in shown["intents"]} == {"ok"} and shown["chain"] == "ok"


async def test_a_lease_renewed_between_the_clock_and_the_row_is_alive(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner is judged alive from its row and a clock (the server's on PostgreSQL, the
    host's on SQLite). A renewal that commits just before the old lease runs out is in the
    row if the clock is read first; read the other way round, the old lease meets a later
    clock and a live worker is presumed dead (and its work reconciled away from it)."""
    from tether._journal import queue
    from tether._runtime.remote import owner_alive

    loop = asyncio.get_running_loop()
    async with supervisor(journal_url) as worker, supervisor(journal_url) as observer:
        server = await observer.journal.peek(queue.server_time)
        start = server if server is not None else time.time()
        assert await worker.journal.renew_lease(worker.owner_id, start, 0.5)
        real = queue.owner
        renewed: list[bool] = []

        def owner(db: Any, owner_id: str) -> Any:
            row = real(db, owner_id)
            if owner_id == worker.owner_id and not renewed:
                assert row is not None and row.lease_until is not None
                # The worker renews in time; then the old lease runs out on the clock the
                # judgment uses (a renewal can only land before it does).
                renewed.append(asyncio.run_coroutine_threadsafe(worker.journal.renew_lease(
                    worker.owner_id, time.time(), 60.0), loop).result(timeout=30))
                while (db.server_time() or time.time()) <= row.lease_until:
                    time.sleep(0.02)
            return row

        monkeypatch.setattr(queue, "owner", owner)
        alive = await owner_alive(observer, worker.owner_id)
    assert renewed == [True] and alive
