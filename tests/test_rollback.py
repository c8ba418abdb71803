"""Rollback of a whole delegation (docs/security.md, "Rollback"): an intruder with write access
to the journal but no trusted key saves a delegation's rows, chain entries and sealed head, and
later writes them all back together. Every record and seal is then genuine, so only a witness
outside the journal can tell: each configuration remembers the latest head it wrote or
accepted per delegation. A worker of that configuration does not run a completed task again,
`tether reconcile` refuses a rolled-back delegation and `tether verify` names it, and a running
process does not seal over a head older than one it sealed. Both backends."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tether
from tests.conftest import until
from tests.test_cli import tether_cli
from tests.test_signed_work import served
from tether._cli.app import app
from tether._core.chain import Entry, Head, judge
from tether._core.headmark import HeadMark
from tether._journal import access, chainops
from tether._journal.journal import Journal
from tether._runtime import keys as keyfiles
from tether._runtime.keys import HEADS

# What the provider applied, per order: one that does not deduplicate by idempotency key (or
# whose key window has passed), so that a payment made again is applied again.
APPLIED: collections.Counter[str] = collections.Counter()


@tether.tool(effect=tether.Effect.EXTERNAL)
async def pay(order_id: str, cents: int, *, idempotency_key: str) -> str:
    APPLIED[order_id] += 1
    return f"paid {cents} for {order_id}"


@tether.agent(tools=[pay])
async def payer(ctx: tether.Context, order_id: str, cents: int) -> str:
    ref: str = await ctx.call(pay, order_id=order_id, cents=cents)
    return ref


# A delegation's records, and the rows they depend on (its task, its queue entry), as the
# intruder saves them: everything the chain covers, the chain and its head.
_WHERE = {
    "tasks": "id = (SELECT task_id FROM delegations WHERE id = ?)",
    "delegations": "id = ?",
    "events": "delegation_id = ? OR action_id IN (SELECT id FROM actions WHERE "
              "delegation_id = ?)",
}
_CHILDREN = ("events", "actions", "controls", "documents", "chain", "chain_heads", "queue")
Saved = dict[str, tuple[list[str], list[tuple[Any, ...]]]]


def _where(table: str) -> str:
    return _WHERE.get(table, "delegation_id = ?")


async def save(j: Journal, delegation_id: str) -> Saved:
    def read(db: Any) -> Saved:
        saved: Saved = {}
        for table in ("tasks", "delegations", *_CHILDREN):
            where = _where(table)
            cur = db.execute(f"SELECT * FROM {table} WHERE {where}",
                             (delegation_id,) * where.count("?"))
            rows = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                    for r in cur.fetchall()]
            saved[table] = ([d[0] for d in cur.description], rows)
        return saved

    return await j._read(read)


async def restore(j: Journal, delegation_id: str, saved: Saved) -> None:
    """Write the saved state back, as a whole, in one transaction."""

    def write(db: Any) -> None:
        for table in _CHILDREN:  # events first: they name the actions about to go
            where = _where(table)
            db.execute(f"DELETE FROM {table} WHERE {where}", (delegation_id,) * where.count("?"))
        for table in ("tasks", "delegations"):
            cols, (row,) = saved[table]
            db.execute(f"UPDATE {table} SET {', '.join(f'{c} = ?' for c in cols)} "
                       "WHERE id = ?", (*row, row[0]))
        for table in _CHILDREN:
            cols, rows = saved[table]
            for r in rows:
                db.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
                           f"({', '.join('?' * len(cols))})", r)

    await j._write(write)


async def head_length(j: Journal, delegation_id: str) -> int:
    return int(await j._read(lambda db: db.execute(
        "SELECT length FROM chain_heads WHERE delegation_id = ?",
        (delegation_id,)).fetchone()[0]))


async def verify_json(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = await tether_cli("verify", *args, "--journal", url, "--json")
    assert code in (0, 1), out + err
    return code, json.loads(out)


def rolled_back(data: dict[str, Any], delegation_id: str) -> list[str]:
    return [p["problem"] for p in data["problems"]
            if p["delegation"] == delegation_id and "rolled back" in p["problem"]]


ROLLED_BACK = (r"rolled back: this configuration saw its chain at length (\d+), the journal "
               r"now holds (\d+)")


async def test_a_completed_queued_task_rolled_back_to_unclaimed_is_not_run_again(
        journal_url: str, tmp_path: Path) -> None:
    """A worker completes a queued payment. The intruder writes back the delegation as it was
    queued (rows, chain entries, sealed head, queue entry unclaimed): a worker of the same
    configuration, a new process that knows only what the configuration's key directory
    remembers, claimed it and paid again. It refuses it now, naming the rollback."""
    order = f"Q-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    async with tether.Supervisor(journal_url, keys=tether.KeyRing.load(config),
                                 tools=[pay]) as sup:
        h = await sup.delegate(payer, order, 100, remote=True)
        await sup.journal.flush()
        async with Journal(journal_url) as intruder:
            queued = await save(intruder, h.id)
        (done,) = await served(journal_url, [payer], tether.KeyRing.load(config), sup.journal,
                               [h.id])
        assert done.state is tether.DelegationState.SUCCEEDED and APPLIED[order] == 1
        async with Journal(journal_url) as intruder:
            await restore(intruder, h.id, queued)
            entry = await intruder.queue_entry(h.id)
            assert entry is not None and entry.claimed_by is None  # waiting for a worker
        (again,) = await served(journal_url, [payer], tether.KeyRing.load(config),
                                sup.journal, [h.id])
    assert APPLIED[order] == 1  # never paid twice
    assert again.state is tether.DelegationState.FAILED and again.failure == "refused:work"
    assert again.error is not None and "rolled back" in again.error, again.error
    code, data = await verify_json(journal_url, "--keys", str(config))
    assert code == 1 and rolled_back(data, h.id), data


async def test_a_local_delegation_rolled_back_past_a_payment_is_refused_and_named(
        journal_url: str) -> None:
    """A local delegation applies two payments and succeeds. The intruder writes back its
    state after the first (RUNNING, one payment), and its owner is gone: `tether reconcile`
    terminated it and reported one payment (the provider applied two). It refuses it now and
    exits non-zero; `tether verify` names the rollback; the delegation is left as it is."""
    order = f"L-{uuid.uuid4().hex[:6]}"
    first, gate = asyncio.Event(), asyncio.Event()

    async def twice(ctx: tether.Context) -> str:
        await ctx.call(pay, order_id=order, cents=100)
        first.set()
        await gate.wait()
        await ctx.call(pay, order_id=order, cents=200)
        return "ok"

    async with tether.Supervisor(journal_url, tools=[pay]) as sup:
        h = await sup.delegate(tether.Agent("twice", twice, (pay,)), tools=[pay])
        await first.wait()
        await sup.journal.flush()
        async with Journal(journal_url) as intruder:
            once = await save(intruder, h.id)
        gate.set()
        assert await h.result() == "ok"
        owner = (await sup.journal.get(h.id)).owner_id
    assert APPLIED[order] == 2
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data  # no false alarm before
    async with Journal(journal_url) as intruder:
        await restore(intruder, h.id, once)
        # Its process is gone (here the test's own process, so its row goes instead).
        await intruder._write(lambda db: db.execute("DELETE FROM owners WHERE id = ?",
                                                    (owner,)))
        assert (await intruder.get(h.id)).state is tether.DelegationState.RUNNING
    code, out, err = await tether_cli("reconcile", "--journal", journal_url)
    assert code == 1, out + err
    assert "refused" in err and h.id in err and "rolled back" in err, err
    code, data = await verify_json(journal_url)
    assert code == 1 and rolled_back(data, h.id), data
    assert re.search(ROLLED_BACK, rolled_back(data, h.id)[0])
    async with Journal(journal_url) as j:
        row = await j.get(h.id)
        assert row.state is tether.DelegationState.RUNNING and not row.fenced  # untouched
    assert APPLIED[order] == 2


async def test_a_rolled_back_delegation_is_not_recovered_by_an_orchestrator_waiting_on_it(
        journal_url: str) -> None:
    """Found by review: `tether reconcile` refused a rolled-back delegation, but an
    orchestrator's own wait on it (a queued task whose worker's lease ran out, a recall of a
    delegation whose owner is gone) recovered it: it terminated it and reported one payment of
    the two applied, inviting a re-delegation that pays again. It refuses it too now."""
    order = f"W-{uuid.uuid4().hex[:6]}"
    first, gate = asyncio.Event(), asyncio.Event()

    async def twice(ctx: tether.Context) -> str:
        await ctx.call(pay, order_id=order, cents=100)
        first.set()
        await gate.wait()
        await ctx.call(pay, order_id=order, cents=200)
        return "ok"

    async with tether.Supervisor(journal_url, tools=[pay]) as sup:
        keys = sup.keys
        h = await sup.delegate(tether.Agent("twice", twice, (pay,)), tools=[pay])
        await first.wait()
        await sup.journal.flush()
        async with Journal(journal_url) as intruder:
            once = await save(intruder, h.id)
        gate.set()
        assert await h.result() == "ok"
        owner = (await sup.journal.get(h.id)).owner_id
    async with Journal(journal_url) as intruder:
        await restore(intruder, h.id, once)
        await intruder._write(lambda db: db.execute("DELETE FROM owners WHERE id = ?",
                                                    (owner,)))
    async with tether.Supervisor(journal_url, keys=keys, tools=[pay], recover=False) as sup:
        row = await sup.journal.get(h.id)
        with pytest.raises(tether.errors.Tampered, match="rolled back"):
            await sup.recover_delegation(row, "owner is gone")
        after = await sup.journal.get(h.id)
    assert after.state is tether.DelegationState.RUNNING and not after.fenced  # untouched
    assert APPLIED[order] == 2


async def test_a_running_process_does_not_act_on_a_head_older_than_one_it_sealed(
        journal_url: str) -> None:
    """In memory alone (an ephemeral key ring persists nothing): the process that sealed a
    longer head refuses the rolled-back delegation (Tampered naming the rollback) and does not
    seal over its head when it writes to it again (the write stays visible as unchained)."""
    order = f"P-{uuid.uuid4().hex[:6]}"
    first, gate = asyncio.Event(), asyncio.Event()

    async def twice(ctx: tether.Context) -> str:
        await ctx.call(pay, order_id=order, cents=1)
        first.set()
        await gate.wait()
        await ctx.call(pay, order_id=order, cents=2)
        return "ok"

    ring = tether.KeyRing.ephemeral()
    async with tether.Supervisor(journal_url, keys=ring, tools=[pay]) as sup:
        h = await sup.delegate(tether.Agent("twice", twice, (pay,)), tools=[pay])
        await first.wait()
        await sup.journal.flush()
        saved = await save(sup.journal, h.id)
        gate.set()
        assert await h.result() == "ok"
        sealed = await head_length(sup.journal, h.id)
        await sup.journal.untampered([h.id], ring.trusted, "check")  # no false alarm
        await restore(sup.journal, h.id, saved)
        older = await head_length(sup.journal, h.id)
        assert older < sealed
        with pytest.raises(tether.errors.Tampered, match=ROLLED_BACK) as refused:
            await sup.journal.untampered([h.id], ring.trusted, "re-delegate it")
        numbers = re.search(ROLLED_BACK, str(refused.value))
        assert numbers is not None and int(numbers[1]) >= sealed and int(numbers[2]) == older
        sup.journal.event(sup.clock.wall(), "note", h.id)
        await sup.journal.flush()
        assert await head_length(sup.journal, h.id) == older  # not sealed over


async def test_the_witness_is_persisted_at_the_moments_that_matter(journal_url: str,
                                                                   tmp_path: Path) -> None:
    """A head sealed is remembered in memory once its commit is confirmed; the key directory
    learns it when a delegation ends (and at every flush, and on close): another process of
    the configuration (a fresh key ring on the same directory) then knows it."""
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    ring = tether.KeyRing.load(config)
    async with tether.Supervisor(journal_url, keys=ring, tools=[pay]) as sup:
        h = await sup.delegate(payer, f"W-{uuid.uuid4().hex[:6]}", 5, tools=[pay])
        await h.result()
        length = await head_length(sup.journal, h.id)
        other = tether.KeyRing.load(config)
        assert other.trusted.heads is not None
        other.trusted.heads.refresh()
        mark = other.trusted.heads.seen(h.id)  # persisted when the delegation ended
        assert mark is not None and 0 < mark.length <= length
        await sup.journal.flush()
        other.trusted.heads.refresh()
        assert ring.trusted.heads is not None
        assert other.trusted.heads.seen(h.id) == ring.trusted.heads.seen(h.id)
    assert (config / HEADS).stat().st_mode & 0o777 == 0o600


class LockedElsewhere:
    """The configuration's key directory locked by another process (an open file description
    of its own: a lock as another process's) until ``release`` or 10 s: a loop that waits
    for the lock could never release it itself."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.held, self._release, self.released = (threading.Event(), threading.Event(),
                                                   threading.Event())
        self._thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        fd = os.open(self.config / ".lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.held.set()
        self._release.wait(10)
        self.released.set()
        os.close(fd)

    async def __aenter__(self) -> LockedElsewhere:
        self._thread.start()
        assert await asyncio.to_thread(self.held.wait, 10)
        return self

    def let_go(self) -> None:
        """From any thread: the holder lets go (``released`` once it did)."""
        self._release.set()

    async def release(self) -> None:
        self.let_go()
        if self._thread.ident is not None:  # (a test that failed before taking it)
            await asyncio.to_thread(self._thread.join)

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


async def test_a_key_directory_locked_elsewhere_never_stops_the_event_loop(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process of the configuration holding its key directory's lock (its own
    append, creating a key, compacting heads.jsonl, or paused while it holds it) never stops
    this process's event loop, whose heartbeats, leases and children go on: a delegation's
    end leaves its heads in memory, and they reach the directory by themselves once the lock
    is free, with no further moment of this process's needed."""
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    ring = tether.KeyRing.load(config)
    lock = LockedElsewhere(config)
    persisting = threading.Event()
    real = chainops.persist

    def persist(*witnesses: Any, **kw: Any) -> Any:
        if lock.held.is_set():
            persisting.set()
        return real(*witnesses, **kw)

    monkeypatch.setattr(chainops, "persist", persist)
    other = tether.KeyRing.load(config).trusted.heads
    assert other is not None
    async with tether.Supervisor(journal_url, keys=ring, tools=[pay]) as sup:
        await sup.current_trust()  # the registry's mark saved before the lock is taken
        async with lock:
            h = await sup.delegate(payer, f"L-{uuid.uuid4().hex[:6]}", 5, tools=[pay])
            # Its end hands its heads over while the lock is held; this loop hears of it
            # from a thread, so it runs meanwhile.
            assert await asyncio.to_thread(persisting.wait, 10)
            ran_while_held = not lock.released.is_set()
            await h.result()
            assert ran_while_held and not lock.released.is_set(), \
                "the event loop waited for another process's lock"
            other.refresh()
            assert other.seen(h.id) is None  # nothing was appended under another's lock

        def remembered() -> bool:
            other.refresh()
            return other.seen(h.id) is not None

        await until(remembered, "the heads remembered once the lock was free", within=10.0)


async def test_a_child_that_ended_is_reported_as_it_ended_with_the_key_directory_locked(
        journal_url: str, tmp_path: Path) -> None:
    """A child's end committed while the key directory is locked elsewhere, and its
    parent's terminate lands right after: the child is reported as it ended, with its
    result. Handing its heads to the directory is no step between its end's commit and its
    report that the terminate could cut."""
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    ring = tether.KeyRing.load(config)
    go, later = asyncio.Event(), asyncio.Event()
    handles: list[tether.Handle] = []

    @tether.agent
    async def leaf(ctx: tether.Context) -> str:
        await go.wait()
        return "done"

    @tether.agent(tools=[leaf])
    async def lead(ctx: tether.Context) -> str:
        handles.append(await ctx.delegate(leaf))
        await later.wait()  # the parent goes on after its child ended
        return "never"

    async with tether.Supervisor(journal_url, keys=ring) as sup:
        parent = await sup.delegate(lead)
        await until(lambda: bool(handles), "the child delegated")
        child = handles[0]
        await sup.current_trust()
        async with LockedElsewhere(config) as lock:
            go.set()
            deadline = asyncio.get_running_loop().time() + 10.0
            while (await sup.journal.get(child.id)).state is not tether.DelegationState.SUCCEEDED:
                assert asyncio.get_running_loop().time() < deadline, "the child never ended"
                await asyncio.sleep(0.005)
            report = await asyncio.wait_for(parent.terminate("stop"), 30)
            assert not lock.released.is_set(), "the lock was let go before the terminate"
        assert report.verdict == "TERMINATE"
        assert await child.result() == "done"



async def _run_with_the_lock_taken(sup: tether.Supervisor,
                                   lock: LockedElsewhere) -> tether.Handle:
    """A delegation run to its end while ``lock`` holds the key directory (the registry's mark
    saved before it is taken)."""
    await sup.current_trust()
    await lock.__aenter__()
    h = await sup.delegate(payer, f"L-{uuid.uuid4().hex[:6]}", 5, tools=[pay])
    await h.result()
    return h


async def test_heads_held_back_by_a_lock_are_tried_at_growing_intervals_said_once_and_at_close(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """While another process keeps the key directory locked, this one tries again at
    intervals that double up to a bound (never a busy loop, never given up); it says so once
    it has waited its patience, once, even when the try that crosses it runs late; and a
    close with heads still held back says, before it waits for the lock, that it waits, and
    lands them once the lock is free."""
    monkeypatch.setattr(access, "PERSIST_RETRY", 0.01)
    monkeypatch.setattr(access, "PERSIST_RETRY_MAX", 0.04)
    monkeypatch.setattr(access, "PERSIST_PATIENCE", 0.2)
    delays: list[float] = []
    defer = access.JournalAccess._defer

    def deferring(self: access.JournalAccess, delay: float, since: float, *rest: Any) -> None:
        delays.append(delay)
        if len(delays) == 3:  # a loop busy for a while: the try that crosses the patience
            asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # runs late, and says so
        defer(self, delay, since, *rest)

    monkeypatch.setattr(access.JournalAccess, "_defer", deferring)
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    ring = tether.KeyRing.load(config)
    other = tether.KeyRing.load(config).trusted.heads
    assert other is not None
    patience = "not yet remembered in the key directory"
    closing = "closing: waiting for the key directory's lock"
    lock = LockedElsewhere(config)
    held_when_said: list[bool] = []

    class ReleaseOnceSaid(logging.Handler):
        """The close waits on this loop's thread: the holder lets go once it said so."""

        def emit(self, record: logging.LogRecord) -> None:
            if closing in record.getMessage():
                held_when_said.append(not lock.released.is_set())
                lock.let_go()

    handler = ReleaseOnceSaid()
    logging.getLogger("tether.journal").addHandler(handler)
    try:
        async with tether.Supervisor(journal_url, keys=ring, tools=[pay]) as sup:
            h = await _run_with_the_lock_taken(sup, lock)
            await until(lambda: patience in caplog.text, "the wait said", within=10.0)
            tries = len(delays)
            await until(lambda: len(delays) >= tries + 5, "tried on after saying so",
                        within=10.0)
            assert caplog.text.count(patience) == 1
            assert delays[:3] == [0.01, 0.02, 0.04] and set(delays[3:]) == {0.04}, delays
            other.refresh()
            assert other.seen(h.id) is None and closing not in caplog.text
    finally:
        logging.getLogger("tether.journal").removeHandler(handler)
        await lock.release()
    assert held_when_said == [True]  # said before it waited, the lock still held
    other.refresh()
    assert other.seen(h.id) is not None  # landed by the close, once the lock was free


async def test_a_close_gives_up_on_a_key_directory_that_stays_locked_and_says_so(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A holder that keeps the key directory's lock (paused or hung while it held it) never
    hangs this process's close: it waits its patience, says the heads were not remembered,
    and closes with the lock still held (its heads are then as a crash leaves them)."""
    monkeypatch.setattr(keyfiles, "LOCK_PATIENCE", 0.3)
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    ring = tether.KeyRing.load(config)
    other = tether.KeyRing.load(config).trusted.heads
    assert other is not None
    lock = LockedElsewhere(config)
    try:
        async with tether.Supervisor(journal_url, keys=ring, tools=[pay]) as sup:
            h = await _run_with_the_lock_taken(sup, lock)
        assert not lock.released.is_set(), "the close waited for the lock's holder"
        assert "stayed locked by another process or thread for 0.3 s" in caplog.text
        other.refresh()
        assert other.seen(h.id) is None
    finally:
        await lock.release()


async def test_a_registry_mark_that_cannot_take_the_lock_fails_closed_and_waits_once(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A longer key registry must be remembered before a decision that read it goes on; with
    the configuration's directory locked by a holder that does not let go, the first such
    decision fails after the lock's patience, the next ones at once (the journal's writer
    never waits it out again), and once the lock is free the next decision remembers it."""
    monkeypatch.setattr(keyfiles, "LOCK_PATIENCE", 0.3)
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    other = tether.KeyRing.init(tmp_path / "other")
    config = tmp_path / "observer"
    observer = tether.KeyRing.init(config, pins={deployment.signer.key_id:
                                                 deployment.signer.public_b64()})
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await sup.current_trust()
    async with Journal(journal_url) as j:
        await j.registry(observer.trusted)  # remembered as it is now
        async with tether.Supervisor(journal_url, keys=deployment) as sup:
            await sup.journal.change_trust(deployment.signer, deployment.trusted, "trust",
                                           other.signer.key_id, other.signer.public_b64(),
                                           "a new key", time.time())
        async with LockedElsewhere(config) as lock:
            took: list[float] = []
            for _ in range(3):
                began = time.monotonic()
                with pytest.raises(keyfiles.LockTimeout):
                    await j.registry(observer.trusted)
                took.append(time.monotonic() - began)
            assert not lock.released.is_set()
        assert took[0] >= 0.3 and max(took[1:]) < 0.3, took
        registry = await j.registry(observer.trusted)  # the lock is free: remembered now
        assert other.signer.key_id in registry.keys
    mark = json.loads((config / "registry.json").read_text())
    assert mark, "the longer registry was never remembered"


async def test_a_key_command_on_a_directory_that_stays_locked_fails_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tether keys pin`` waits its patience for a lock nobody lets go, then says why in
    one line (exit 2), and the configuration is as it was."""
    monkeypatch.setattr(keyfiles, "LOCK_PATIENCE", 0.3)
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    before = (config / "trusted.json").read_bytes()
    public = tether.KeyRing.init(tmp_path / "other").signer.public_b64()
    async with LockedElsewhere(config) as lock:
        result = await asyncio.to_thread(
            CliRunner().invoke, app, ["keys", "pin", public, "--keys", str(config)])
        held = not lock.released.is_set()
    assert held, "the command waited for the lock's holder"
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and result.output.count("\n") == 1, result.output
    assert "stayed locked by another process or thread for 0.3 s" in result.output
    assert (config / "trusted.json").read_bytes() == before


def test_the_witness_file_is_appended_compacted_and_read_by_other_processes(
        tmp_path: Path) -> None:
    """Heads are appended (no whole-file rewrite per head); a file with many more lines than
    delegations is compacted; a reader takes in what was appended or compacted since it last
    looked; a torn last line (a crash mid-append) is skipped, never an error."""
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    a, b = tether.KeyRing.load(config).trusted.heads, tether.KeyRing.load(config).trusted.heads
    assert a is not None and b is not None
    for n in range(1, 3001):
        a.note("d_one", n, f"{n:064x}")
        a.persist()
    lines = (config / HEADS).read_text().splitlines()
    assert len(lines) < 3000  # compacted on the way
    b.refresh()
    assert b.seen("d_one") == HeadMark(3000, f"{3000:064x}")
    b.note("d_two", 7, "b" * 64)
    b.persist()
    with open(config / HEADS, "a") as torn:
        torn.write('["d_thr')
    a.refresh()
    assert a.seen("d_two") == HeadMark(7, "b" * 64)
    b.note("d_four", 4, "d" * 64)  # appended after the torn line, not onto it
    b.persist()
    a.refresh()
    assert a.seen("d_four") == HeadMark(4, "d" * 64) and a.seen("d_thr") is None
    fresh = tether.KeyRing.load(config).trusted.heads
    assert fresh is not None and fresh.seen("d_two") == HeadMark(7, "b" * 64)
    a.note("d_one", 12, "c" * 64)  # shorter than what it saw: never remembered
    assert a.seen("d_one") == HeadMark(3000, f"{3000:064x}")


def test_the_judgement_names_a_head_older_than_the_one_seen() -> None:
    """The pure rule: a chain shorter than the head the configuration saw is rolled back; one
    as long or longer whose entry at that length is another is rewritten; one that extends the
    head seen is fine."""
    from tether._core.trust import Registry

    registry = Registry(tether.KeyRing.ephemeral().trusted, None, ())
    entries = [Entry(n, "event 1", "c", "", f"{n:064x}") for n in (1, 2, 3)]
    head = Head(3, f"{3:064x}", False, None, None)
    seen = {d: [p.problem for p in judge("d", head, entries, {}, registry, seen=mark).problems
                if "this configuration" in p.problem]
            for d, mark in {"shorter": HeadMark(5, "e" * 64), "same": HeadMark(3, f"{3:064x}"),
                            "prefix": HeadMark(2, f"{2:064x}"),
                            "forked": HeadMark(2, "f" * 64), "none": None}.items()}
    assert seen["same"] == seen["prefix"] == seen["none"] == []
    (shorter,) = seen["shorter"]
    assert shorter.startswith("rolled back: this configuration saw its chain at length 5, "
                              "the journal now holds 3")
    (forked,) = seen["forked"]
    assert forked.startswith("rolled back and rewritten"), forked


async def test_a_delegation_seen_chained_is_not_passed_off_as_older_than_the_chain(
        journal_url: str) -> None:
    """In a journal upgraded from before the chain, a head marked legacy cannot be told from
    a downgrade by the journal alone (docs/security.md, "The chain"): its entries deleted and
    its head replaced by a legacy one, a delegation's records read as unchained. A
    configuration that saw its chain names it."""
    from tests.test_chain import before_the_chain, flip, scene

    await scene(journal_url)
    async with Journal(journal_url) as j:
        await before_the_chain(j, tether.KeyRing.load(j.keys_dir))
    s = await scene(journal_url)  # chained, after the upgrade; its configuration saw it
    async with Journal(journal_url) as j:
        await flip(j, s)
        await j._write(lambda db: db.execute("DELETE FROM chain WHERE delegation_id = ?",
                                             (s.delegation,)))
        await j._write(lambda db: db.execute(
            "UPDATE chain_heads SET length = 0, hash = '', legacy = 1, path = NULL, "
            "seal = NULL, signer = NULL, signature = NULL WHERE delegation_id = ?",
            (s.delegation,)))
    code, data = await verify_json(journal_url)
    assert code == 1 and rolled_back(data, s.delegation), data


async def test_a_head_rolled_back_to_the_one_this_process_sealed_last_is_not_sealed_over(
        journal_url: str, tmp_path: Path) -> None:
    """Process A (a supervisor) seals a delegation's head at length L. Another process of the
    same configuration (B: the same key directory) extends it to L+1, and the configuration
    remembers L+1. An intruder writes the delegation back to A's moment (rows, entries and
    A's own sealed head). A's next write to it must not seal over the rolled-back head: it is
    the head A sealed last, but not the newest its configuration saw."""
    config = tmp_path / "config"
    tether.KeyRing.init(config)
    ring = tether.KeyRing.load(config)
    entered, gate = asyncio.Event(), asyncio.Event()

    async def waits(ctx: tether.Context) -> str:
        entered.set()
        await gate.wait()
        return "ok"

    async with tether.Supervisor(journal_url, keys=ring) as sup:
        h = await sup.delegate(tether.Agent("waits", waits, ()))
        await entered.wait()
        await sup.journal.flush()
        saved = await save(sup.journal, h.id)
        sealed = await head_length(sup.journal, h.id)
        own = sup.journal._sealer.own.get(h.id)
        assert own is not None and own[0] == sealed
        other = tether.KeyRing.load(config)  # another process of the configuration
        async with Journal(journal_url) as b:
            b.seal_with(other.signer, other.trusted)
            await b.record_event(sup.clock.wall(), "note", h.id)
            await b.flush()
            assert await head_length(b, h.id) == sealed + 1
        assert ring.trusted.heads is not None
        ring.trusted.heads.refresh()
        seen = ring.trusted.heads.seen(h.id)
        assert seen is not None and seen.length == sealed + 1  # the configuration saw L+1
        await restore(sup.journal, h.id, saved)  # the intruder: back to A's own head
        assert await head_length(sup.journal, h.id) == sealed
        assert sup.journal._sealer.own.get(h.id) == own
        sup.journal.event(sup.clock.wall(), "note", h.id)
        await sup.journal.flush()
        after = await head_length(sup.journal, h.id)
        gate.set()
        with contextlib.suppress(Exception):
            await h.result()
    assert after == sealed, "a head rolled back by hand was sealed over by its last sealer"
