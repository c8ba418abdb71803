"""A commit only this process's crash must not lose (``Journal.flush(durable=False)``, the MCP
proxy's receipt before it answers) skips waiting for the disk; any batch in which someone waits
for a durable commit (an intent) stays durable."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.journal_helpers import writer_held
from tether._journal.runner import Op, relaxed_batch


def _op(*, relaxed: bool = False, waits: bool = True) -> Op:
    future: asyncio.Future[Any] | None = None
    if waits:
        future = asyncio.get_running_loop().create_future()
    return Op(lambda db: None, True, future, relaxed)


async def test_a_batch_is_relaxed_only_when_nobody_waiting_needs_durability() -> None:
    assert relaxed_batch([_op(relaxed=True)])
    assert relaxed_batch([_op(waits=False), _op(relaxed=True)])  # a posted receipt rides it
    assert not relaxed_batch([_op(relaxed=True), _op()])  # an intent in the batch: durable
    assert not relaxed_batch([_op(waits=False)])  # posted writes alone: durable, as before
    assert not relaxed_batch([_op()])


async def test_a_relaxed_flush_commits_without_waiting_for_the_disk(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with tether.Journal(journal_url) as j:
        runner: Any = j._runner
        seen: list[str] = []
        begin = runner.begin
        sqlite = journal_url.startswith("sqlite")

        def watched(conn: Any, write: bool) -> None:
            begin(conn, write)
            query = "PRAGMA synchronous" if sqlite else "SHOW synchronous_commit"
            seen.append(str(conn.execute(query).fetchone()[0]))

        monkeypatch.setattr(runner, "begin", watched)
        await j.flush(durable=False)
        await j.flush()
        await j.flush(durable=False)
    # SQLite: 1 is NORMAL, 2 FULL. PostgreSQL: the transaction's synchronous_commit.
    assert seen == (["1", "2", "1"] if sqlite else ["off", "on", "off"])


async def test_relaxed_posts_ride_a_commit_that_does_not_wait_for_the_disk(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal whose posted writes are relaxed (the MCP proxy's): a batch of posted writes
    alone commits without waiting for the disk, and one with a durable waiter stays durable."""
    async with tether.Journal(journal_url) as j:
        j.relaxed_posts = True
        runner: Any = j._runner
        relaxed: list[bool] = []
        relax = runner.relax

        def watched(conn: Any, value: bool) -> None:
            relaxed.append(value)
            relax(conn, value)

        monkeypatch.setattr(runner, "relax", watched)
        j.event(0.0, "posted")
        await j.flush(durable=False)
        await j.flush()
    assert relaxed[-1] is False  # the durable flush
    assert set(relaxed[:-1]) == {True}  # the post, alone or with the relaxed flush


async def test_an_intent_in_one_batch_with_relaxed_writes_commits_durably(
        journal_url: str, keys: tether.KeyRing, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MCP proxy's journal (relaxed posts, a relaxed flush before each answer): a relaxed
    receipt and a relaxed flush queued with the next call's write-ahead intent ride its batch,
    and the batch waits for the disk (I1). Read inside the intent's own transaction."""
    from tether._journal import ops

    sqlite = journal_url.startswith("sqlite")
    seen: list[str] = []
    begin_action = ops.begin_action

    def watched(db: Any, *args: Any) -> Any:
        seen.append(str(db.execute("PRAGMA synchronous" if sqlite
                                   else "SHOW synchronous_commit").fetchone()[0]))
        return begin_action(db, *args)

    monkeypatch.setattr(ops, "begin_action", watched)

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def echo(n: int, idempotency_key: str) -> int:
        return n

    async with tether.Supervisor(journal_url, keys=keys) as sup:
        sup.journal.relaxed_posts = True
        runner: Any = sup.journal._runner
        submit = runner.submit
        intent_queued = asyncio.Event()

        def watch(fn: Any, *, write: bool, wait: bool = True, relaxed: bool = False,
                  **kw: Any) -> Any:
            future = submit(fn, write=write, wait=wait, relaxed=relaxed, **kw)
            if write and wait and not relaxed:
                intent_queued.set()
            return future

        async def agent(ctx: tether.Context) -> None:
            # The writer busy with a batch, while a relaxed receipt, a relaxed flush and an
            # intent are queued behind it: they are drained as one batch.
            running, hold = threading.Event(), threading.Event()

            def blocker(db: Any) -> None:
                running.set()
                hold.wait(30)

            busy = submit(blocker, write=True)
            await asyncio.to_thread(running.wait, 30)  # the batch before is on the writer
            sup.journal.event(sup.clock.wall(), "receipt-like")
            flushed = asyncio.ensure_future(sup.journal.flush(durable=False))
            monkeypatch.setattr(runner, "submit", watch)
            call = asyncio.ensure_future(ctx.call(echo, n=1))
            await intent_queued.wait()
            monkeypatch.setattr(runner, "submit", submit)
            hold.set()
            await busy
            await flushed
            assert await call == 1

        child = await sup.delegate(agent, tools=[echo])
        await child.result()
    assert seen == (["2"] if sqlite else ["on"]), seen


class _Trickle:
    """A writer's queue that always has one more posted write, each arriving 0.3 ms after
    the one before on the runner's clock: a steady trickle of receipts and events."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def get(self, timeout: float) -> Op:
        assert timeout > 0
        self.clock[0] += 0.0003
        return Op(lambda db: None, True, None)

    def get_nowait(self) -> Op:
        import queue

        raise queue.Empty


def test_posted_writes_wait_for_company_until_a_deadline_not_one_wait_each() -> None:
    """A batch of posted writes alone waits a moment for the operation behind them (a child's
    next intent rides the same transaction), but only until POSTED_WAIT after the first: a
    trickle of posted writes never holds the first back for more."""
    from tether._journal import runner as runner_module
    from tether._journal.writer import ThreadRunner

    clock = [100.0]
    writer = ThreadRunner()
    writer._queue = _Trickle(clock)  # type: ignore[assignment]
    writer.monotonic = lambda: clock[0]  # type: ignore[method-assign]
    writer._backlog.add(Op(lambda db: None, True, None))
    stopping = writer._gather()
    batch = writer._backlog.take()
    assert not stopping
    assert clock[0] - 100.0 <= runner_module.POSTED_WAIT + 0.0003
    assert 1 < len(batch) <= 5, len(batch)


@pytest.mark.parametrize("path", ["riding-the-flush", "read-back-at-the-flush"])
async def test_a_head_a_relaxed_commit_sealed_is_remembered_only_once_it_is_durable(
        journal_url: str, keys: tether.KeyRing, path: str) -> None:
    """The configuration remembers chain heads to name a rollback (docs/security.md). A head
    sealed by a commit that did not wait for the disk can still be lost: by the machine
    (SQLite ``synchronous=NORMAL``) or by a PostgreSQL server crash (``synchronous_commit =
    off``). Remembered then, the configuration would read its own journal as rolled back by
    hand and refuse to extend that delegation from then on. Remembered once a later durable
    commit that sealed heads synced the log instead. Either way a relaxed head could reach
    the memory: a posted write riding the relaxed flush's own batch, or one committed relaxed
    before it and read back by the flush."""
    from tether._journal import ops

    async with tether.Supervisor(journal_url, keys=keys) as sup:
        handle = await sup.delegate(_quiet)
        await handle.result()
        await sup.journal.flush()
        witness: Any = keys.trusted.heads
        durable = witness.seen(handle.id)
        assert durable is not None
        runner: Any = sup.journal._runner
        if path == "riding-the-flush":
            blocker, hold = await writer_held(runner)
            submit, queued = runner.submit, asyncio.Event()

            def watched(fn: Any, *, write: bool, wait: bool = True,
                        **kw: Any) -> Any:
                future = submit(fn, write=write, wait=wait, **kw)
                if wait:
                    queued.set()
                return future

            runner.submit = watched
            sup.journal.relaxed_posts = True
            sup.journal.event(0.0, "note", handle.id)  # posted, queued behind the blocker
            flushed = asyncio.ensure_future(sup.journal.flush(durable=False))
            await queued.wait()  # the flush queued behind the post: one batch
            runner.submit = submit
            hold.set()
            await blocker
            await flushed
        else:
            await runner.submit(lambda db: ops.event(db, 0.0, "note", handle.id, None),
                                write=True, relaxed=True)
            await sup.journal.flush(durable=False)
        length = await sup.journal._read(lambda db: db.execute(
            "SELECT length FROM chain_heads WHERE delegation_id = ?",
            (handle.id,)).fetchone()[0])
        assert length == durable.length + 1
        assert witness.seen(handle.id) == durable, "a head not yet durable was remembered"
        await sup.journal.flush()  # promotes nothing: only a durable commit that sealed
        assert witness.seen(handle.id) == durable, "a head not yet durable was remembered"
        other = await sup.delegate(_quiet)  # commits that seal, and wait for the disk
        await other.result()
        await sup.journal.flush()
        seen = witness.seen(handle.id)
        assert seen is not None and seen.length == length


async def _quiet(ctx: tether.Context) -> str:
    return "ok"


async def test_a_durable_flush_after_relaxed_commits_syncs_them_on_sqlite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flush()`` waits until everything queued before it survives the machine. On SQLite a
    transaction that writes nothing syncs nothing, so a flush after relaxed commits (the MCP
    proxy's receipts, at its close) returned with them still in the log's unsynced pages. It
    syncs the log itself then, and only then: a flush with nothing relaxed before it, or a
    durable commit that wrote (SQLite syncs that one), adds no sync."""

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)  # the one the backend calls
    path = tmp_path / "journal.db"
    async with tether.Journal(f"sqlite:///{path}") as j:
        runner: Any = j._runner

        async def relaxed_write() -> None:  # a commit that does not wait for the disk
            await runner.submit(lambda db: db.execute(
                "INSERT INTO events (at, kind, detail) VALUES (0, 'relaxed', '{}')"),
                write=True, relaxed=True)

        await j.flush()
        assert synced == []  # nothing relaxed before it
        await relaxed_write()
        await j.flush(durable=False)
        assert synced == []
        await j.flush()
        assert synced == [f"{path}-wal"], synced
        await j.flush()
        assert synced == [f"{path}-wal"], synced  # synced already
        await relaxed_write()
        await j._write(lambda db: db.execute("INSERT INTO events (at, kind, detail) "
                                             "VALUES (0, 'durable', '{}')"))
        await j.flush()
        assert synced == [f"{path}-wal"], synced  # the commit that wrote synced the log


async def test_a_relaxed_head_a_reader_of_this_process_accepts_is_not_remembered_either(
        journal_url: str, keys: tether.KeyRing) -> None:
    """A chain check (a report's, reconciliation's, re-delegation's, `verify`'s) of this
    process accepts a head it sealed in a relaxed commit: it must not remember it either. The
    commit is then lost (a server crash, a power loss: the journal as it was before it), and
    the process goes on extending its delegation, with no false alarm."""
    from tests.test_trust import raw
    from tether._journal import ops

    head_of = ("SELECT length, hash, legacy, seal, signer, signature, seal_id, proof FROM "
               "chain_heads WHERE delegation_id = ?")
    async with tether.Supervisor(journal_url, keys=keys) as sup:
        journal: Any = sup.journal
        handle = await sup.delegate(_quiet)
        await handle.result()
        await journal.flush()
        before = await journal._read(lambda db: tuple(db.execute(
            head_of, (handle.id,)).fetchone()))
        seal = await journal._read(lambda db: db.execute(
            "SELECT id, seal, signer, signature FROM chain_seals WHERE id = ?",
            (before[6],)).fetchone())
        runner: Any = journal._runner
        await runner.submit(lambda db: ops.event(db, 0.0, "note", handle.id, None),
                            write=True, relaxed=True)
        (verdict,) = await journal.chain_verdicts([handle.id], keys.trusted)
        assert verdict.ok
        # Lost with the server (or the machine): the journal as it was before that commit.
        await raw(journal, "DELETE FROM chain WHERE delegation_id = ? AND seq > ?",
                  handle.id, before[0])
        await raw(journal, "DELETE FROM events WHERE delegation_id = ? AND kind = 'note'",
                  handle.id)
        await raw(journal, "UPDATE chain_heads SET length = ?, hash = ?, legacy = ?, seal = ?, "
                  "signer = ?, signature = ?, seal_id = ?, proof = ? WHERE delegation_id = ?",
                  *before, handle.id)
        if seal is not None:  # and the commit's seal it names, if not in its own row
            await raw(journal, "DELETE FROM chain_seals WHERE id = ?", seal[0])
            await raw(journal, "INSERT INTO chain_seals (id, seal, signer, signature) "
                      "VALUES (?, ?, ?, ?)", *seal)
        await journal._write(lambda db: ops.event(db, 0.0, "after", handle.id, None))
        length = await journal._read(lambda db: db.execute(
            "SELECT length FROM chain_heads WHERE delegation_id = ?",
            (handle.id,)).fetchone()[0])
        assert length == before[0] + 1, "the writer refused to extend its own delegation"
        await journal.untampered([handle.id], keys.trusted, "no false alarm")
