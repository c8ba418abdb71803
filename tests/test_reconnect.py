"""A lost database connection is an ordinary event (PostgreSQL): the writer, the listener and the
pooled reads reconnect; a batch lost around its COMMIT is settled by reading back what was
committed, a commit marker lost with a failover is made again, and a batch cut at a savepoint
is ridden through; a reconnection does not wait on the schema's startup lock; a connection
lost while the schema is created is a JournalError; once the reconnection window is over each
write fails at once; a receipt that failed for want of a connection is written once it is
back; nothing waits for ever, not even on a server that stops answering while a connection is
set up. Restarts and pauses run on a private server of the tests' own; on the shared server
only this test's own backends are terminated (by application name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

import psycopg
import pytest

import tether
from tests import remote_agents
from tests.conftest import PG_URL
from tether._chaos.pgserver import PrivateServer, terminate
from tether._core.errors import JournalError
from tether._core.report import ActionRecord
from tether._journal import postgres, schema
from tether._journal.journal import Journal
from tether._journal.rows import OwnerRow

WITHIN = 60.0  # seconds: a test that has not ended by then hangs, and fails
SOON = 20.0  # the same, for the tests whose waits end within a reconnection window or two


def named(url: str) -> tuple[str, str]:
    """The URL with an application name of its own, so that only its backends are ended."""
    name = f"tether-test-{uuid.uuid4().hex[:12]}"
    return f"{url}&application_name={name}", name


def end_backends(name: str) -> int:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return terminate(conn, name)


def schema_of(url: str) -> str:
    return dict(parse_qsl(urlparse(url).query))["schema"]


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
    owner then polls) and hears the next ones. It says so when it first listens too: what
    committed between the journal's opening and its LISTEN was never heard."""
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
        # Said before anything it heard (one thread, in order), so set by now.
        assert event("reconnected").is_set()
        del heard["reconnected"]
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
    # A restart on a loaded machine can hold an intent's commit past the shared tool's 3 s
    # deadline, and the call is then rightly never sent: this test is of the ride-through.
    refund = dataclasses.replace(remote_agents.refund, dispatch_deadline=WITHIN)
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


async def test_a_reconnection_does_not_wait_on_the_schema_lock(pg_url: str) -> None:
    """Another process holds the schema's startup lock for as long as it likes (a process
    stopped in the middle of its first start, a long migration on another host). A journal
    already open whose connection is cut must reconnect to its existing schema without waiting
    on that lock: before, every reconnection took the lock, so the write hung for as long as
    the lock was held, far past the reconnection window, instead of committing or failing."""
    url, name = named(pg_url)
    async with Journal(url) as journal:
        await journal.flush()
        journal.reconnect_within = 2.0
        with psycopg.connect(PG_URL, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                           (f"tether.schema.{schema_of(pg_url)}",))
            try:
                with psycopg.connect(PG_URL, autocommit=True) as conn:
                    assert terminate(conn, name) >= 1
                owner = OwnerRow("o-locked", 1, "host", 1.0, 1.0)
                await asyncio.wait_for(journal.register_owner(owner), SOON)
            finally:
                holder.execute("ROLLBACK")
        assert "o-locked" in {o.id for o in await journal.owners()}


async def test_a_server_that_stops_answering_while_a_connection_is_set_up_fails_in_time(
        private_pg: PrivateServer, private_url: str) -> None:
    """The server pauses (a frozen host) after a reconnection's socket is open but before the
    schema check on it has answered. The watchdog only watched batches, and the connection
    being set up was nobody's: the write waited for ever. Now the check is cut after the stall
    bound like a batch, and the write fails once the reconnection window is over."""
    async with Journal(private_url) as journal:
        await journal.flush()
        runner = journal._runner
        assert isinstance(runner, postgres.PostgresRunner)
        journal.reconnect_within = 1.0
        real = runner._check_or_init
        paused = {"once": True}

        def check_or_init(conn: Any) -> None:
            if paused.pop("once", False):
                private_pg.pause()
            real(conn)

        runner._check_or_init = check_or_init  # type: ignore[method-assign]
        runner._conn.close()  # the connection breaks; the next write reconnects
        try:
            with pytest.raises(JournalError, match="could not reconnect"):
                await asyncio.wait_for(journal.flush(), SOON)
        finally:
            await asyncio.to_thread(private_pg.resume)
        await asyncio.wait_for(journal.flush(), SOON)  # and it recovers


async def test_a_connection_lost_while_the_schema_is_created_is_a_journal_error(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server restart or a terminated backend while a first start creates the schema: the
    open fails with a JournalError (one line on the command line), not a raw psycopg
    exception, and nothing half-made is left: the next open creates the journal."""
    real = schema.migrate

    def migrate_then_cut(conn: Any, found: int, dialect: str) -> None:
        real(conn, found, dialect)
        conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    monkeypatch.setattr(postgres, "migrate", migrate_then_cut)
    with pytest.raises(JournalError):
        await asyncio.wait_for(Journal(pg_url).open(), SOON)
    monkeypatch.setattr(postgres, "migrate", real)
    async with Journal(pg_url) as journal:
        await journal.register_owner(OwnerRow("o-after", 1, "host", 1.0, 1.0))
        assert [o.id for o in await journal.owners()] == ["o-after"]


async def test_a_commit_marker_lost_with_a_failover_is_made_again(pg_url: str) -> None:
    """A failover to a standby that had not yet received the runner's commit marker (or a
    restore from a backup) leaves no marker row; the runner still believed it had one, so its
    stamp updated nothing and locked nothing, and a batch later lost after its COMMIT read back
    "not committed" and ran twice. Each new connection now makes sure its marker is there."""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        runner = journal._runner
        with psycopg.connect(PG_URL, autocommit=True) as conn:  # what the failover lost
            conn.execute(f'DELETE FROM "{schema_of(pg_url)}".tether_meta '
                         "WHERE key LIKE 'commit:%%'")
        real_connect = runner.connect
        cut = {"once": True}

        def connect() -> Any:
            conn = real_connect()
            if cut.pop("once", False):
                return CutAroundCommit(conn, after=True)
            return conn

        runner._conn.close()  # the failover: the connection breaks
        runner.connect = connect  # type: ignore[method-assign]
        answer = await asyncio.wait_for(journal._write(
            lambda db: db.execute("INSERT INTO hits VALUES (1) RETURNING n").fetchone()[0]),
            SOON)
        assert answer == 1
        count = await journal._read(lambda db: db.execute("SELECT count(*) FROM hits")
                                    .fetchone()[0])
        assert count == 1


class CutAt:
    """A connection whose network fails at its first ``statement`` (mid-batch)."""

    def __init__(self, conn: psycopg.Connection[Any], statement: str) -> None:
        self._conn = conn
        self._statement = statement
        self._cut = False

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == self._statement and not self._cut:
            self._cut = True
            self._conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return self._conn.execute(query, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.parametrize("statement", ["SAVEPOINT op", "RELEASE SAVEPOINT op"])
async def test_a_connection_lost_at_a_savepoint_mid_batch_is_ridden_through(
        pg_url: str, statement: str) -> None:
    """The connection breaks exactly on the savepoint statements between a batch's operations
    (where the writer thread used to die with futures pending). A batch takes savepoints once
    one of its operations failed (it then runs again, each operation undone alone): here the
    first fails on its first run only. Both operations of the batch commit exactly once;
    nothing waits for ever."""

    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        runner = journal._runner
        real_connect = runner.connect
        cut = {"once": True}

        def connect() -> Any:
            conn = real_connect()
            return CutAt(conn, statement) if cut.pop("once", False) else conn

        runner.connect = connect  # type: ignore[method-assign]
        runner._conn.close()
        # Reconnected here, on a connection that will break: the batch below must meet its
        # failure on that one (its BEGIN waits for its first statement, so on the closed
        # connection its first operation would fail before anything was sent).
        await journal._write(lambda db: db.execute("SELECT 1").fetchone())
        hold = threading.Event()
        blocker = journal._write(lambda db: hold.wait(SOON))  # keeps the writer busy ...
        first_run = {"once": True}

        def insert(db: Any, n: int) -> int:
            if n == 1 and first_run.pop("once", False):
                raise JournalError("failed on its first run")
            return int(db.execute("INSERT INTO hits VALUES (?) RETURNING n", (n,)).fetchone()[0])

        writes = [journal._write(lambda db, n=n: insert(db, n)) for n in (1, 2)]
        hold.set()  # ... so that these two make one batch
        assert await asyncio.wait_for(asyncio.gather(blocker, *writes), SOON) == [True, 1, 2]
        rows = await journal._read(lambda db: db.execute(
            "SELECT n FROM hits ORDER BY n").fetchall())
        assert [r[0] for r in rows] == [1, 2]
        assert runner.reconnects == 2  # once for the close, once for the cut


async def test_once_the_reconnection_window_is_over_each_write_fails_at_once(
        pg_url: str) -> None:
    """The server stays down. The first write waits the reconnection window and fails; the
    ones after it made a window of their own each (a supervisor settling five children on
    SIGTERM with its server down was still running 100 s later). The window now runs from the
    loss: later writes try to connect once and fail at once, until the server is back."""
    async with Journal(pg_url) as journal:
        await journal.flush()
        runner = journal._runner
        journal.reconnect_within = 0.5
        real_connect = runner.connect
        attempts = {"n": 0, "down": True}

        def connect() -> Any:
            attempts["n"] += 1
            if attempts["down"]:
                raise JournalError("cannot connect to the journal: connection refused")
            return real_connect()

        runner.connect = connect  # type: ignore[method-assign]
        runner._conn.close()
        with pytest.raises(JournalError, match="could not reconnect"):
            await asyncio.wait_for(journal.flush(), SOON)
        attempts["n"] = 0
        for _ in range(3):
            with pytest.raises(JournalError, match="could not reconnect"):
                await asyncio.wait_for(journal.flush(), SOON)
        assert attempts["n"] == 3  # one each
        attempts["down"] = False  # back: the next write reconnects
        await asyncio.wait_for(journal.flush(), SOON)


async def test_a_receipt_lost_to_an_outage_does_not_leave_a_finished_child_pending(
        pg_url: str) -> None:
    """The journal goes away right after a tool applied; its receipt (a write posted without
    waiting) fails with its batch once the reconnection window is over, and is gone. The
    journal comes back before the child ends: the child ended SUCCEEDED with its action
    PENDING for ever, which nothing reconciles (every action ends COMPLETED, FAILED or
    IN_DOUBT). Receipts failed for want of a connection now run first once it is back."""
    down = {"now": False}
    restored = asyncio.Event()

    @tether.tool(dispatch_deadline=600.0)
    async def pay(order: str, *, idempotency_key: str) -> str:
        runner = sup.journal._runner
        down["now"] = True
        runner._conn.close()  # the server goes away as the provider answers
        return "paid " + order

    async def agent(ctx: tether.Context) -> str:
        paid: str = await ctx.call(pay, order="o-1")
        await restored.wait()
        return paid

    async with tether.Supervisor(pg_url, tools=[pay], keys=tether.KeyRing.ephemeral()) as sup:
        runner = sup.journal._runner
        sup.journal.reconnect_within = 0.3
        real_connect = runner.connect

        def connect() -> Any:
            if down["now"]:
                raise JournalError("cannot connect to the journal: connection refused")
            return real_connect()

        runner.connect = connect  # type: ignore[method-assign]
        child = await sup.delegate(agent, tools=[pay])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SOON
        while not down["now"]:
            assert loop.time() < deadline
            await asyncio.sleep(0.01)  # polling the child's progress, with a deadline
        with pytest.raises(JournalError):  # queued after the receipt: it has failed too
            await asyncio.wait_for(sup.journal.flush(), SOON)
        down["now"] = False
        restored.set()
        assert await asyncio.wait_for(child.result(), SOON) == "paid o-1"
        report = await sup.report(child.id)
    assert [a.state for a in report.actions] == [tether.ActionState.COMPLETED], report.actions
