"""A lost database connection is an ordinary event (PostgreSQL): the writer, the listener and the
pooled reads reconnect; a batch lost around its COMMIT is settled by reading back what was
committed; nothing waits for ever. Restarts and pauses run on a private server of the tests'
own; on the shared server only this test's own backends are terminated (by application name).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tether
from tests import remote_agents
from tests.conftest import PG_URL
from tether._chaos.pgserver import PrivateServer, terminate
from tether._core.errors import JournalError
from tether._core.report import ActionRecord
from tether._journal.journal import Journal
from tether._journal.rows import OwnerRow

WITHIN = 60.0  # seconds: a test that has not ended by then hangs, and fails


def named(url: str) -> tuple[str, str]:
    """The URL with an application name of its own, so that only its backends are ended."""
    name = f"tether-test-{uuid.uuid4().hex[:12]}"
    return f"{url}&application_name={name}", name


def end_backends(name: str) -> int:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return terminate(conn, name)


async def test_a_terminated_backend_is_reconnected_and_the_next_write_commits(
        pg_url: str) -> None:
    url, name = named(pg_url)
    async with Journal(url) as journal:
        await journal.flush()
        assert await asyncio.to_thread(end_backends, name) >= 1
        owner = OwnerRow("o-after-cut", 1, "host", 1.0, 1.0)
        await asyncio.wait_for(journal.register_owner(owner), WITHIN)
        assert owner.id in {o.id for o in await journal.owners()}
        assert journal._runner.reconnects >= 1


async def test_pooled_reads_ride_through_terminated_backends(pg_url: str) -> None:
    url, name = named(pg_url)
    async with Journal(url) as journal:
        await journal.register_owner(OwnerRow("o1", 1, "host", 1.0, 1.0))
        assert await journal.liveness("o1") != (None, None)  # the pool has a connection now
        assert await asyncio.to_thread(end_backends, name) >= 1
        row, _ = await asyncio.wait_for(journal.liveness("o1"), WITHIN)
        assert row is not None and row.id == "o1"


async def test_the_listener_reconnects_and_says_so(pg_url: str) -> None:
    """Notifications sent while the listener was cut are lost: it says "reconnected" (its
    owner then polls) and hears the next ones."""
    url, name = named(pg_url)
    loop = asyncio.get_running_loop()
    heard: dict[str, asyncio.Event] = {}

    def on(payload: str) -> None:
        loop.call_soon_threadsafe(heard.setdefault(payload, asyncio.Event()).set)

    def event(payload: str) -> asyncio.Event:
        return heard.setdefault(payload, asyncio.Event())

    async with Journal(url) as journal:
        assert journal.on_notify(on)
        loop_deadline = loop.time() + WITHIN
        while not event("first").is_set():  # the listener's LISTEN may not have run yet
            assert loop.time() < loop_deadline, "the listener never heard anything"
            await journal._write(lambda db: db.notify("first"))
            await asyncio.wait([asyncio.ensure_future(event("first").wait())], timeout=0.2)
        assert await asyncio.to_thread(end_backends, name) >= 1
        await asyncio.wait_for(event("reconnected").wait(), WITHIN)
        await journal._write(lambda db: db.notify("second"))
        await asyncio.wait_for(event("second").wait(), WITHIN)


class CutAroundCommit:
    """A connection whose network fails at its next COMMIT: after the server received it
    (``after``: it committed, the reply is lost) or before (nothing committed)."""

    def __init__(self, conn: psycopg.Connection[Any], after: bool) -> None:
        self._conn = conn
        self._after = after

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "COMMIT":
            if self._after:
                self._conn.execute(query)
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return self._conn.execute(query, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.parametrize("after", [True, False], ids=["committed", "not-committed"])
async def test_a_batch_lost_around_its_commit_is_read_back_never_guessed(
        pg_url: str, after: bool) -> None:
    """Committed: the caller gets the batch's own answer, and the batch is not run again.
    Not committed: it runs again on a new connection. Either way exactly one row."""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        runner = journal._runner
        real_connect = runner.connect
        cut = {"once": True}

        def connect() -> Any:
            conn = real_connect()
            if cut.pop("once", False):
                return CutAroundCommit(conn, after)
            return conn

        # The connection breaks; the next batch runs on a new one that fails at its COMMIT.
        runner._conn.close()
        runner.connect = connect  # type: ignore[method-assign]
        answer = await asyncio.wait_for(journal._write(
            lambda db: db.execute("INSERT INTO hits VALUES (1) RETURNING n").fetchone()[0]),
            WITHIN)
        assert answer == 1
        count = await journal._read(lambda db: db.execute("SELECT count(*) FROM hits")
                                    .fetchone()[0])
        assert count == 1
        assert runner.reconnects >= 1


async def test_without_a_server_what_waits_fails_in_time_then_the_journal_recovers(
        private_pg: PrivateServer, private_url: str) -> None:
    """No hang: while the server is down, a write fails with a JournalError once the
    reconnection window is over; once it is back, the next write reconnects and commits."""
    async with Journal(private_url) as journal:
        await journal.flush()
        journal._runner.reconnect_within = 0.5
        await asyncio.to_thread(private_pg.down, "fast")
        try:
            with pytest.raises(JournalError, match="could not reconnect"):
                await asyncio.wait_for(journal.flush(), WITHIN)
        finally:
            await asyncio.to_thread(private_pg.up)
        journal._runner.reconnect_within = WITHIN
        await asyncio.wait_for(journal.register_owner(OwnerRow("o2", 1, "h", 1.0, 1.0)), WITHIN)


async def test_closing_never_waits_for_a_paused_server(
        private_pg: PrivateServer, private_url: str) -> None:
    """A paused server (SIGSTOP) answers nothing and breaks nothing. Closing the journal
    still returns, and the write stuck on the server fails with a JournalError."""
    journal = await Journal(private_url).open()
    await journal.flush()
    journal._runner.stop_wait = 0.5
    await asyncio.to_thread(private_pg.pause)
    stuck = asyncio.ensure_future(journal.flush())
    await asyncio.wait_for(journal.close(), WITHIN)
    with pytest.raises(JournalError):
        await asyncio.wait_for(stuck, WITHIN)


async def test_a_write_to_a_paused_server_fails_in_time(
        private_pg: PrivateServer, private_url: str) -> None:
    """A paused server breaks no connection: the watchdog cuts the one that has waited too
    long, and the write fails with a JournalError instead of waiting for ever (reads too)."""
    async with Journal(private_url) as journal:
        await journal.register_owner(OwnerRow("o3", 1, "h", 1.0, 1.0))
        journal._runner.reconnect_within = 0.5
        await asyncio.to_thread(private_pg.pause)
        try:
            with pytest.raises(JournalError):
                await asyncio.wait_for(journal.flush(), WITHIN)
            with pytest.raises(JournalError):
                await asyncio.wait_for(journal.liveness("o3"), WITHIN)
        finally:
            await asyncio.to_thread(private_pg.resume)
        journal._runner.reconnect_within = WITHIN
        await asyncio.wait_for(journal.flush(), WITHIN)  # and it recovers


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_payments_keep_flowing_through_a_server_restart(
        private_pg: PrivateServer, private_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """An orchestrator rides through ``pg_ctl restart``: payments made before, during and
    after it all complete, and the provider's ledger and the journal agree, key for key."""
    monkeypatch.setenv("TETHER_TEST_LEDGER", str(tmp_path / "ledger.db"))
    remote_agents.ledger.cache_clear()
    refund = remote_agents.refund
    n = 12
    first_done = asyncio.Semaphore(0)
    go = asyncio.Event()

    @tether.agent(tools=[refund])
    async def three_payments(ctx: tether.Context, order: str) -> list[str]:
        refs = [await ctx.call(refund, order_id=f"{order}-1", cents=100)]
        first_done.release()
        await go.wait()
        refs.append(await ctx.call(refund, order_id=f"{order}-2", cents=200))
        refs.append(await ctx.call(refund, order_id=f"{order}-3", cents=300))
        return refs

    async def run() -> tuple[list[list[str]], list[ActionRecord]]:
        async with tether.Supervisor(private_url, tools=[refund], recover=False) as sup:
            handles = [await sup.delegate(three_payments, f"o{i}") for i in range(n)]
            for _ in range(n):
                await first_done.acquire()
            restart = asyncio.ensure_future(asyncio.to_thread(private_pg.restart, mode))
            go.set()  # the second payments race the restart
            await restart
            results = [await h.result() for h in handles]
            assert sup.journal._runner.reconnects >= 1
            ids = [h.id for h in handles]
            return results, await sup.journal.actions(ids)

    results, actions = await asyncio.wait_for(run(), WITHIN)
    assert all(len(refs) == 3 for refs in results)
    ledger = {e.key for e in remote_agents.ledger().entries()}
    assert len(ledger) == 3 * n
    assert {a.idempotency_key for a in actions} == ledger
    assert {a.state for a in actions} == {tether.ActionState.COMPLETED}
    remote_agents.ledger.cache_clear()
