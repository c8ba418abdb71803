"""PostgreSQL only: processes racing on one delegation, and bad servers or schemas."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import tether
from tether._journal.journal import Journal
from tether._journal.rows import NewDelegation
from tether.errors import JournalError, NotAJournal, SchemaTooNew
from tether.protocol import ControlIntent, ControlKind, SigningKey

ROOT = Path(__file__).resolve().parent.parent


async def hammer(url: str, role: str, delegation: str, n: int) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.pg_hammer", url, role, delegation, str(n), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


async def seeded(url: str) -> None:
    async with Journal(url) as j:
        await j.create_delegation(NewDelegation("d1", "t1", None, 1, "a", (), {}, "o", 1.0))


async def test_no_action_commits_after_the_fence_across_processes(pg_url: str) -> None:
    """I2 across processes: four processes start actions as fast as they can while a fifth
    closes the fence. Every action the journal ever holds was there when the fence committed:
    the drain that reads right after the fence misses none."""
    await seeded(pg_url)
    results = await asyncio.gather(
        hammer(pg_url, "fence", "d1", 40), *(hammer(pg_url, "act", "d1", 0) for _ in range(4)))
    seen_at_fence = int(results[0])
    async with Journal(pg_url, create=False) as j:
        total = len(await j.actions(["d1"]))
    assert seen_at_fence >= 40
    assert total == seen_at_fence == sum(int(r) for r in results[1:])


async def test_sequences_and_epochs_have_one_winner_across_processes(pg_url: str) -> None:
    """I4 across processes: racing intents and re-delegations; each number is won once."""
    await seeded(pg_url)
    control = await asyncio.gather(*(hammer(pg_url, "control", "d1", 3) for _ in range(4)))
    won = sorted(int(s) for line in control for s in line.split())
    async with Journal(pg_url, create=False) as j:
        seqs = [c.seq for c in await j.controls("d1")]
    assert won == seqs == [1, 2]  # RECALL then TERMINATE; a third move is invalid
    epochs = await asyncio.gather(*(hammer(pg_url, "redelegate", "d1", 5) for _ in range(4)))
    won_epochs = sorted(int(s) for line in epochs for s in line.split())
    assert won_epochs == [0, 1, 2, 3, 4]


async def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(JournalError, match="cannot connect to the journal"):
        await Journal("postgresql://postgres@127.0.0.1:1/test").open()


async def test_wrong_credentials_are_a_clear_error(pg_url: str) -> None:
    url = pg_url.replace("postgres@", "no_such_role_tether@", 1)
    with pytest.raises(JournalError, match="cannot connect") as info:
        await Journal(url).open()
    assert "no_such_role_tether" in str(info.value)


async def test_a_schema_that_is_not_a_journal_is_refused_untouched(pg_url: str) -> None:
    conninfo = pg_url.split("?")[0]
    schema = pg_url.split("schema=")[1].split("&")[0]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("CREATE TABLE {}.users (id int)").format(sql.Identifier(schema)))
    with pytest.raises(NotAJournal, match="not a tether journal"):
        await Journal(pg_url).open()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        tables = conn.execute("SELECT table_name FROM information_schema.tables WHERE "
                              "table_schema = %s", (schema,)).fetchall()
    assert tables == [("users",)]


async def test_a_newer_schema_is_refused(pg_url: str) -> None:
    await seeded(pg_url)
    conninfo = pg_url.split("?")[0]
    schema = pg_url.split("schema=")[1].split("&")[0]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {}.tether_meta SET value = '99' WHERE key = "
                             "'schema_version'").format(sql.Identifier(schema)))
    with pytest.raises(SchemaTooNew):
        await Journal(pg_url).open()


def test_a_fence_waits_for_an_action_insert_in_flight(pg_url: str) -> None:
    """I2, deterministically: an action insert that read 'not fenced' holds a share lock, so
    the fence cannot commit until it does, and the fence's transaction then sees the action.
    Without the lock, the fence would commit first and the action would appear after it."""
    from tether._journal.postgres import split_url

    asyncio.run(seeded(pg_url))
    conninfo, schema, _ = split_url(pg_url)

    def connection() -> psycopg.Connection[tuple[object, ...]]:
        conn = psycopg.connect(conninfo, autocommit=True)
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        return conn

    actor, fencer, watcher = connection(), connection(), connection()
    try:
        fence_waits_for_insert(actor, fencer, watcher)
    finally:
        for conn in (actor, fencer, watcher):
            conn.close()


def fence_waits_for_insert(actor: psycopg.Connection[tuple[object, ...]],
                           fencer: psycopg.Connection[tuple[object, ...]],
                           watcher: psycopg.Connection[tuple[object, ...]]) -> None:
    import hashlib
    import threading

    from tether._journal import ops
    from tether._journal.postgres import PgDb
    from tether._journal.rows import Begin, NewAction

    args = '{"x":1}'
    actor.execute("BEGIN")
    begun = ops.begin_action(PgDb(actor, "tether_test"), NewAction(
        "a1", "d1", 0, 0, "pay", tether.Effect.EXTERNAL, args,
        hashlib.sha256(args.encode()).hexdigest(), "k1", 2.0, 32.0), 5.0)
    assert begun.status is Begin.STARTED  # not committed yet
    key = SigningKey.from_raw(bytes(32))
    intent = ControlIntent(ControlKind.RECALL, "d1", 0, 1, 5.0, "r", 3.0)
    seen: list[int] = []

    def fence() -> None:
        db = PgDb(fencer, "tether_test")
        fencer.execute("BEGIN")
        ops.accept_control(db, key.sign(intent), intent, "fencer", 3.0)
        fencer.execute("COMMIT")
        seen.append(len(ops.actions(db, ["d1"])))

    thread = threading.Thread(target=fence, daemon=True)
    thread.start()
    pid = fencer.info.backend_pid
    while thread.is_alive():  # synchronise on the server's own view: is the fence waiting?
        row = watcher.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                              (pid,)).fetchone()
        if row is not None and row[0] == "Lock":
            break
    assert thread.is_alive(), "the fence committed while an action insert was in flight"
    actor.execute("COMMIT")
    thread.join()
    assert seen == [1]
