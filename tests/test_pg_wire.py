"""PostgreSQL's wire (issue 24, item 3): an action's round trips, and what waits to go with the
next statement (``postgres.Wire``) without changing what a batch does or how it fails."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import psycopg
import pytest

import tether
from tether._core.errors import JournalError
from tether._journal.journal import Journal
from tether._journal.postgres import Wire

WITHIN = 30.0


@tether.tool(effect=tether.Effect.EXTERNAL)
async def noop(i: int, *, idempotency_key: str) -> int:
    return i


async def actor(ctx: tether.Context, n: int) -> None:
    for i in range(n):
        await ctx.call(noop, i=i)


class Messages:
    """Messages the journal's writer sends on its connection (each a round trip)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = psycopg.Cursor.execute

        def execute(cur: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(cur.connection, Wire) and \
                    threading.current_thread().name == "tether-journal":
                self.count += 1
            return real(cur, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, "execute", execute)


async def test_a_journaled_action_makes_at_most_eight_round_trips(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One child's back-to-back EXTERNAL calls: each is one batch (its intent, with the last
    call's receipt), whose gate, key, row and chain statements once took eleven messages."""
    messages = Messages(monkeypatch)
    async with tether.Supervisor(pg_url, keys=tether.KeyRing.ephemeral()) as sup:
        await (await sup.delegate(actor, 5, tools=[noop])).result()
        counts = []
        for n in (10, 50):
            await sup.journal.flush()
            start = messages.count
            await (await sup.delegate(actor, n, tools=[noop])).result()
            await sup.journal.flush()
            counts.append(messages.count - start)
    per_action = (counts[1] - counts[0]) / 40
    assert per_action <= 8.5, (counts, per_action)


def test_a_rollback_before_the_begin_went_sends_nothing(pg_url: str) -> None:
    """A batch whose operations all failed before any statement: the server never saw its
    transaction, and the connection is ready for the next batch."""
    conn = Wire.connect(pg_url.split("?")[0], autocommit=True)
    try:
        conn.later("BEGIN")
        conn.execute("SAVEPOINT op")
        conn.execute("ROLLBACK TO SAVEPOINT op")
        conn.execute("RELEASE SAVEPOINT op")
        conn.execute("ROLLBACK")
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
    real = psycopg.ClientCursor.execute
    cut = {"armed": False}

    def execute(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if cut["armed"] and isinstance(query, str) and query.endswith("; COMMIT"):
            cut["armed"] = False
            if after:
                real(cur, query, *args, **kwargs)
            cur.connection.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(cur, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", execute)
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))

        def op(db: Any) -> int:
            n: int = db.execute("INSERT INTO hits VALUES (1) RETURNING n").fetchone()[0]
            db.send([("UPDATE hits SET n = n WHERE n = ?", (1,), False)], last=True)
            return n

        cut["armed"] = True
        answer = await asyncio.wait_for(journal._write(op), WITHIN)
        assert not cut["armed"]  # the cut happened
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
    await held
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


async def test_an_operation_that_swallowed_an_error_never_passes_for_committed(
        pg_url: str) -> None:
    """PostgreSQL answers the COMMIT of a transaction an error aborted with ROLLBACK, and no
    error: an operation that caught a statement's error and went on must not be reported
    done, nor anything of its batch."""
    async with Journal(pg_url) as journal:
        await journal._write(lambda db: db.execute("CREATE TABLE hits (n INTEGER)"))

        def swallows(db: Any) -> str:
            db.execute("INSERT INTO hits VALUES (1)")
            with contextlib.suppress(psycopg.Error):
                db.execute("SELECT 1 / 0")
            return "done"

        with pytest.raises(JournalError):
            await journal._write(swallows)
        rows = await journal._read(lambda db: db.execute("SELECT n FROM hits").fetchall())
        assert rows == []
        assert await journal._write(lambda db: "next") == "next"  # the connection goes on
