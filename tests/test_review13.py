"""Faults and inputs beyond those the reconnection and input work chose (issue 13's review):
each test here failed before its fix."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

import psycopg
import pytest

import tether
from tests.conftest import PG_URL
from tests.test_reconnect import CutAroundCommit
from tether._chaos.pgserver import PrivateServer, terminate
from tether._core.errors import JournalError
from tether._journal import postgres, schema
from tether._journal.journal import Journal
from tether._journal.rows import OwnerRow

WITHIN = 20.0  # seconds: a test that has not ended by then hangs, and fails


def named(url: str) -> tuple[str, str]:
    name = f"tether-test-{uuid.uuid4().hex[:12]}"
    return f"{url}&application_name={name}", name


def schema_of(url: str) -> str:
    return dict(parse_qsl(urlparse(url).query))["schema"]


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
                await asyncio.wait_for(journal.register_owner(owner), WITHIN)
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
                await asyncio.wait_for(journal.flush(), WITHIN)
        finally:
            await asyncio.to_thread(private_pg.resume)
        await asyncio.wait_for(journal.flush(), WITHIN)  # and it recovers


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
        await asyncio.wait_for(Journal(pg_url).open(), WITHIN)
    monkeypatch.setattr(postgres, "migrate", real)
    async with Journal(pg_url) as journal:
        await journal.register_owner(OwnerRow("o-after", 1, "host", 1.0, 1.0))
        assert [o.id for o in await journal.owners()] == ["o-after"]


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
async def test_a_journal_whose_write_ahead_log_is_deleted_stops_its_writes(
        tmp_path: Path, suffix: str) -> None:
    """Only the journal's -wal (or -shm) file removed under a running process (a clean-up by
    hand): the file check saw the journal itself unchanged, and the process went on committing
    into a log no other process reads, which a crash then lost along with everything it held
    (the journal read back empty). Now the next transaction stops with a clear error."""
    path = tmp_path / "j.db"
    async with Journal(f"sqlite:///{path}") as journal:
        await journal.register_owner(OwnerRow("before", 1, "host", 1.0, 1.0))
        os.unlink(f"{path}{suffix}")
        with pytest.raises(JournalError, match=f"{suffix} was deleted"):
            await journal.register_owner(OwnerRow("after", 1, "host", 1.0, 1.0))


async def test_a_second_process_opening_the_journal_leaves_its_sidecars_alone(
        tmp_path: Path) -> None:
    """No false alarm: another connection opening and closing the journal while this one
    has it open (``tether ls`` beside a supervisor) keeps its -wal and -shm."""
    path = tmp_path / "j.db"
    async with Journal(f"sqlite:///{path}") as journal:
        await journal.register_owner(OwnerRow("first", 1, "host", 1.0, 1.0))
        for n in range(3):
            async with Journal(f"sqlite:///{path}", create=False) as other:
                await other.register_owner(OwnerRow(f"other-{n}", 1, "host", 1.0, 1.0))
        await journal.register_owner(OwnerRow("last", 1, "host", 1.0, 1.0))
        assert len(await journal.owners()) == 5


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
            WITHIN)
        assert answer == 1
        count = await journal._read(lambda db: db.execute("SELECT count(*) FROM hits")
                                    .fetchone()[0])
        assert count == 1


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
            await asyncio.wait_for(journal.flush(), WITHIN)
        attempts["n"] = 0
        for _ in range(3):
            with pytest.raises(JournalError, match="could not reconnect"):
                await asyncio.wait_for(journal.flush(), WITHIN)
        assert attempts["n"] == 3  # one each
        attempts["down"] = False  # back: the next write reconnects
        await asyncio.wait_for(journal.flush(), WITHIN)


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
        deadline = loop.time() + WITHIN
        while not down["now"]:
            assert loop.time() < deadline
            await asyncio.sleep(0.01)  # polling the child's progress, with a deadline
        with pytest.raises(JournalError):  # queued after the receipt: it has failed too
            await asyncio.wait_for(sup.journal.flush(), WITHIN)
        down["now"] = False
        restored.set()
        assert await asyncio.wait_for(child.result(), WITHIN) == "paid o-1"
        report = await sup.report(child.id)
    assert [a.state for a in report.actions] == [tether.ActionState.COMPLETED], report.actions


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
    """Issue 13's first case, made exact: the connection breaks on the savepoint statements
    between a batch's operations (where the writer thread used to die with futures pending).
    Both operations of the batch commit exactly once; nothing waits for ever."""

    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        runner = journal._runner
        real_connect = runner.connect
        cut = {"once": True}

        def connect() -> Any:
            conn = real_connect()
            return CutAt(conn, statement) if cut.pop("once", False) else conn

        runner.connect = connect  # type: ignore[method-assign]
        runner._conn.close()  # the next batch reconnects, on a connection that will break
        hold = threading.Event()
        blocker = journal._write(lambda db: hold.wait(WITHIN))  # keeps the writer busy ...
        writes = [journal._write(lambda db, n=n: db.execute(
            "INSERT INTO hits VALUES (?) RETURNING n", (n,)).fetchone()[0]) for n in (1, 2)]
        hold.set()  # ... so that these two make one batch
        assert await asyncio.wait_for(asyncio.gather(blocker, *writes), WITHIN) == [True, 1, 2]
        rows = await journal._read(lambda db: db.execute(
            "SELECT n FROM hits ORDER BY n").fetchall())
        assert [r[0] for r in rows] == [1, 2]
        assert runner.reconnects == 2  # once for the close, once for the cut
