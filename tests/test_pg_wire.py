"""PostgreSQL's wire (issue 24, item 3): an action's round trips, and what waits to go with the
next statement (``wire.Wire``) without changing what a batch does or how it fails."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import tether
from tether._core.errors import JournalError
from tether._journal.journal import Journal
from tether._journal.wire import Wire

WITHIN = 30.0


@tether.tool(effect=tether.Effect.EXTERNAL)
async def noop(i: int, *, idempotency_key: str) -> int:
    return i


async def actor(ctx: tether.Context, n: int) -> None:
    for i in range(n):
        await ctx.call(noop, i=i)


class Messages:
    """Messages sent on a ``Wire`` (each a round trip): the journal's writer's, or any."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, thread: str | None = "tether-journal"
                 ) -> None:
        self.count = 0
        real = psycopg.Cursor.execute

        def execute(cur: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(cur.connection, Wire) and \
                    thread in (None, threading.current_thread().name):
                self.count += 1
            return real(cur, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", execute)


class Cut:
    """The writer's connection lost under the first message ``matches`` picks once armed:
    after the server received it (``after``), or before."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, matches: Callable[[str], bool],
                 after: bool) -> None:
        self.armed = False
        self.seen: list[str] = []
        real = psycopg.Cursor.execute

        def execute(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed and isinstance(query, str) and matches(query) \
                    and threading.current_thread().name == "tether-journal":
                self.armed = False
                self.seen.append(query)
                if after:
                    real(cur, query, *args, **kwargs)
                cur.connection.close()
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return real(cur, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", execute)


async def test_a_journaled_action_makes_at_most_eight_round_trips(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One child's back-to-back EXTERNAL calls: each is one batch (its intent, with the last
    call's receipt), whose gate, key, row and chain statements once took eleven messages."""
    messages = Messages(monkeypatch)
    # No poll for other processes' intents while it counts: a poll's messages come with
    # time, not with actions, and a slower or faster run would count more or fewer.
    async with tether.Supervisor(pg_url, keys=tether.KeyRing.ephemeral(),
                                 control_poll=3600.0) as sup:
        await (await sup.delegate(actor, 5, tools=[noop])).result()
        counts = []
        for n in (10, 50):
            await sup.journal.flush()
            start = messages.count
            await (await sup.delegate(actor, n, tools=[noop])).result()
            await sup.journal.flush()
            counts.append(messages.count - start)
    per_action = (counts[1] - counts[0]) / 40
    assert 1 <= per_action <= 8.5, (counts, per_action)  # (counted at all)


def test_a_rollback_before_the_begin_went_sends_nothing(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose operations all failed before any statement: the server never saw its
    transaction, nothing is sent to undo it, and the connection is ready for the next."""
    conn = Wire.connect(pg_url.split("?")[0], autocommit=True)
    messages = Messages(monkeypatch, thread=None)
    try:
        conn.later("BEGIN")
        conn.execute("SAVEPOINT op")
        conn.execute("ROLLBACK TO SAVEPOINT op")
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("ROLLBACK")
        assert messages.count == 0
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn._later == []
        assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        conn.close()


def test_savepoints_that_wait_undo_exactly_what_a_savepoint_sent_at_once_would(
        pg_url: str) -> None:
    """The runner's careful run (each operation in a savepoint): an operation that failed is
    undone alone, whether its savepoint went to the server or still waited; one that
    succeeded is kept."""
    conn = Wire.connect(pg_url.split("?")[0], autocommit=True)
    try:
        conn.execute("CREATE TEMP TABLE t (n INTEGER PRIMARY KEY)")
        conn.later("BEGIN")
        conn.execute("SAVEPOINT op")
        conn.execute("INSERT INTO t VALUES (1)")  # kept
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("SAVEPOINT op")  # failed before any statement: never sent
        conn.execute("ROLLBACK TO SAVEPOINT op")
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("SAVEPOINT op")
        conn.execute("INSERT INTO t VALUES (2)")
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("INSERT INTO t VALUES (1)")  # failed on the server
        conn.execute("ROLLBACK TO SAVEPOINT op")
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("SAVEPOINT op")
        conn.execute("INSERT INTO t VALUES (3)")  # kept
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("SAVEPOINT op")
        conn.execute("INSERT INTO t VALUES (4)")  # the savepoint reached the server with it
        conn.later("INSERT INTO t VALUES (5)")  # and this waits after it
        conn.execute("ROLLBACK TO SAVEPOINT op")  # both undone: sent, and dropped unsent
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("COMMIT")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert [r[0] for r in conn.execute("SELECT n FROM t ORDER BY n")] == [1, 3]
    finally:
        conn.close()


def test_a_session_that_sent_what_waited_is_idle_in_its_transaction(pg_url: str) -> None:
    """What waited goes in one simple query with the next statement: once it ran, the server
    waits idle in the transaction, where ``idle_in_transaction_session_timeout`` ends a
    session whose process was paused (a pipeline without a Sync would leave it active,
    holding its locks, with no timeout)."""
    url = pg_url.split("?")[0]
    conn = Wire.connect(url, autocommit=True)
    try:
        conn.later("BEGIN")
        conn.execute("SELECT 1").fetchone()
        with psycopg.connect(url, autocommit=True) as other:
            state = other.execute("SELECT state FROM pg_stat_activity WHERE pid = %s",
                                  (conn.info.backend_pid,)).fetchone()
        assert state == ("idle in transaction",)
    finally:
        conn.close()


def test_an_error_in_what_waited_for_the_commit_fails_the_batch_and_commits_nothing(
        pg_url: str) -> None:
    conn = Wire.connect(pg_url.split("?")[0], autocommit=True)
    try:
        conn.execute("CREATE TEMP TABLE t (n INTEGER PRIMARY KEY)")
        conn.later("BEGIN")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.later("INSERT INTO t VALUES (1)")  # the seal's last statements: a conflict
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("COMMIT")
        conn.execute("ROLLBACK")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
    finally:
        conn.close()


@pytest.mark.parametrize("after", [True, False], ids=["committed", "not-committed"])
async def test_a_batch_lost_at_a_commit_sent_with_what_waited_is_read_back(
        pg_url: str, monkeypatch: pytest.MonkeyPatch, after: bool) -> None:
    """The seal's last statements go in one message with the COMMIT: the connection lost
    under that message is a loss at the commit, settled by reading the marker back (never by
    running the batch again blindly, never by guessing). Exactly one row either way."""
    cut = Cut(monkeypatch, lambda query: query.endswith("; COMMIT"), after)
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))

        def op(db: Any) -> int:
            n: int = db.execute("INSERT INTO hits VALUES (1) RETURNING n").fetchone()[0]
            db.send([("UPDATE hits SET n = n WHERE n = ?", (1,), False)], last=True)
            return n

        cut.armed = True
        answer = await asyncio.wait_for(journal._write(op), WITHIN)
        assert cut.seen  # the cut happened
        assert answer == 1
        count = await journal._read(lambda db: db.execute("SELECT count(*) FROM hits")
                                    .fetchone()[0])
        assert count == 1
        assert journal._runner.reconnects >= 1


async def _one_batch(journal: Journal, *ops: Any) -> list[Any]:
    """Run ``ops`` as one write batch (the writer held busy while they are submitted)."""
    busy, release = threading.Event(), threading.Event()

    def hold(db: Any) -> None:
        busy.set()
        release.wait(WITHIN)

    held = asyncio.ensure_future(journal._write(hold))
    await asyncio.to_thread(busy.wait, WITHIN)
    futures = [asyncio.ensure_future(journal._write(op)) for op in ops]
    await asyncio.sleep(0)  # submitted behind the held batch
    release.set()
    await asyncio.wait([held])  # (a device: its own outcome is not the test's)
    return await asyncio.gather(*futures, return_exceptions=True)


async def test_an_operation_whose_notification_fails_fails_alone(pg_url: str) -> None:
    """An operation's notification refused by the server (a payload over its limit) fails
    that operation, never the next one in its batch: an error met by another operation's
    statement would undo that one's savepoint and leave the first reported as done with
    nothing of it committed."""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))

        def noisy(db: Any) -> str:
            db.execute("INSERT INTO hits VALUES (1)")
            db.notify("x" * 9000)  # pg_notify takes at most 8,000 bytes
            return "noisy"

        def quiet(db: Any) -> str:
            db.execute("INSERT INTO hits VALUES (2)")
            return "quiet"

        first, second = await _one_batch(journal, noisy, quiet)
        assert isinstance(first, JournalError), first
        assert second == "quiet"
        rows = await journal._read(lambda db: db.execute("SELECT n FROM hits").fetchall())
        assert [r[0] for r in rows] == [2]


def swallows(db: Any) -> str:
    """An operation that writes, then catches a statement's error and goes on."""
    db.execute("INSERT INTO hits VALUES (1)")
    with contextlib.suppress(psycopg.Error):
        db.execute("SELECT 1 / 0")
    return "swallowed"


async def test_an_operation_that_swallowed_an_error_never_passes_for_committed(
        pg_url: str) -> None:
    """PostgreSQL answers the COMMIT of a transaction an error aborted with ROLLBACK, and no
    error: an operation that caught a statement's error and went on must not be reported
    done, nor anything of its batch."""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        with pytest.raises(JournalError):
            await journal._write(swallows)
        rows = await journal._read(lambda db: db.execute("SELECT n FROM hits").fetchall())
        assert rows == []
        assert await journal._write(lambda db: "next") == "next"  # the connection goes on


async def test_an_operation_that_swallowed_an_error_fails_alone_in_its_batch(
        pg_url: str) -> None:
    """Beside another operation: the one that caught a statement's error fails, and it alone
    (its savepoint undone, not the next one's), and what the other was told is what
    committed. (Its savepoint's release waits for the next operation's first message, which
    would otherwise meet the error and be undone in its place.)"""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))

        def quiet(db: Any) -> str:
            db.execute("INSERT INTO hits VALUES (2)")
            return "quiet"

        first, second = await _one_batch(journal, swallows, quiet)
        assert isinstance(first, JournalError) and "division by zero" in str(first), first
        assert second == "quiet"
        rows = await journal._read(lambda db: db.execute("SELECT n FROM hits").fetchall())
        assert [r[0] for r in rows] == [2]


async def test_a_server_that_refuses_every_write_is_named_to_every_operation(
        pg_url: str) -> None:
    """The commit marker's update waits for the batch's first message; a server that
    refuses it (a standby after a failover, a revoked grant) fails every operation of the
    batch with what it said, not with a bare "aborted"."""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        await journal._write(lambda db: db.execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"))

        def insert(n: int) -> Any:
            return lambda db: db.replies([("SELECT ?", (n,))])[0].rows

        outcomes = await _one_batch(journal, insert(1), insert(2), insert(3))
        assert all(isinstance(o, JournalError) and "read-only" in str(o) for o in outcomes), (
            outcomes)
        journal._runner._conn.close()  # back to a server that takes writes: a new session
        assert await journal._write(insert(4)) == [(4,)]


@pytest.mark.parametrize("merged", ["RELEASE SAVEPOINT op; SAVEPOINT op", "BEGIN; UPDATE"])
@pytest.mark.parametrize("after", [True, False], ids=["received", "not-received"])
async def test_a_connection_lost_under_what_waited_runs_the_batch_once(
        pg_url: str, monkeypatch: pytest.MonkeyPatch, merged: str, after: bool) -> None:
    """The connection lost under a message that carried what waited (a batch's BEGIN and
    marker; one operation's savepoint release with the next one's savepoint), before or
    after the server had it: nothing of the batch committed, it runs again, and each
    operation's write is there exactly once."""
    cut = Cut(monkeypatch, lambda query: query.startswith(merged), after)
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))
        first_run = {"once": True}

        def insert(db: Any, n: int) -> int:
            if n == 1 and first_run.pop("once", False):
                raise RuntimeError("failed on its first run")  # the batch runs again, careful
            return int(db.execute("INSERT INTO hits VALUES (?) RETURNING n", (n,)).fetchone()[0])

        cut.armed = True
        out = await asyncio.wait_for(_one_batch(
            journal, lambda db: insert(db, 1), lambda db: insert(db, 2)), WITHIN)
        rows = await journal._read(lambda db: db.execute(
            "SELECT n FROM hits ORDER BY n").fetchall())
        assert cut.seen, "the connection was never cut"
        assert out == [1, 2] and [r[0] for r in rows] == [1, 2]
