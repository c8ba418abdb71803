"""``tether sim``: the simulator's deterministic loop, its inline journal runner and
notifications, and trials that run the production Supervisor, Worker and journal on them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import tether
from tether._core import outcome
from tether._core.errors import JournalError
from tether._core.model import ActionState, ProbeOutcome
from tether._core.signing import SigningKey, TrustedKeys
from tether._journal import ops
from tether._journal.inline import Loss, MemorySqlite, Server, shared_database
from tether._journal.journal import Journal
from tether._journal.rows import NewDelegation, OwnerRow
from tether._runtime import reconcile
from tether._runtime.keys import KeyRing
from tether._sim import trial as production
from tether._sim.loop import Host, RealIO, SimLoop, Stalled, run
from tether._sim.plan import trial_seed
from tether._sim.runs import run_sim


def order_of(seed: int) -> list[str]:
    loop = SimLoop(random.Random(seed))
    seen: list[str] = []

    async def one(name: str) -> None:
        await asyncio.sleep(1.0)
        seen.append(name)

    async def main() -> None:
        await asyncio.gather(*(one(n) for n in "abcd"))

    run(loop, main())
    return seen


def test_callbacks_due_at_one_instant_run_in_an_order_drawn_from_the_seed() -> None:
    orders = {tuple(order_of(seed)) for seed in range(12)}
    assert len(orders) > 1, "every seed ran the four wake-ups in one order"
    assert order_of(5) == order_of(5)


def test_time_jumps_to_the_next_timer_when_nothing_is_ready() -> None:
    loop = SimLoop(random.Random(0))

    async def main() -> float:
        await asyncio.sleep(3600.0)
        await asyncio.sleep(0.25)
        return loop.time()

    assert run(loop, main()) == 3600.25


def test_a_crashed_host_runs_nothing_more_and_a_paused_one_resumes_late() -> None:
    loop = SimLoop(random.Random(0))
    ticks: dict[str, list[float]] = {"a": [], "b": [], "c": []}

    async def ticker(name: str) -> None:
        for _ in range(4):
            await asyncio.sleep(1.0)
            ticks[name].append(loop.time())

    async def main() -> None:
        hosts = {n: Host(n) for n in ticks}
        tasks = [loop.start(h, ticker(n)) for n, h in hosts.items()]
        await asyncio.sleep(1.5)
        loop.crash(hosts["a"])
        loop.pause(hosts["b"], 10.0)
        await asyncio.gather(tasks[1], tasks[2])

    run(loop, main())
    assert ticks["a"] == [1.0]
    assert ticks["b"] == [1.0, 10.0, 11.0, 12.0]
    assert ticks["c"] == [1.0, 2.0, 3.0, 4.0]


def test_threads_and_waiting_for_ever_are_refused_not_hidden() -> None:
    async def thread() -> None:
        await asyncio.to_thread(print, "never")

    with pytest.raises(RealIO, match="refuses threads"):
        run(SimLoop(random.Random(0)), thread())

    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(Stalled):
        run(SimLoop(random.Random(0)), forever())


# -- the inline runner: the production batch code on the loop ------------------------------

class Counted(MemorySqlite):
    read_backs = 0

    def committed(self, conn: Any) -> bool:
        self.read_backs += 1
        return super().committed(conn)


@pytest.mark.parametrize("loss", ["before", "after"])
def test_a_lost_commit_reply_is_read_back_and_the_write_lands_once(loss: str) -> None:
    name = f"lost-{loss}"
    anchor = shared_database(name)
    losses: list[Loss] = [loss]  # type: ignore[list-item]
    runner = Counted(name, lose_commit=lambda wrote: losses.pop() if losses else None)
    journal = Journal("sqlite:///sim/journal.db", runner=runner, wall=lambda: 1.0)

    async def main() -> list[OwnerRow]:
        await journal.open()
        await journal.register_owner(OwnerRow("o1", 1, "h", 1.0, 1.0))
        owners = await journal.owners()
        await journal.close()
        return owners

    owners = run(SimLoop(random.Random(0)), main())
    count = anchor.execute("SELECT COUNT(*) FROM owners").fetchone()[0]
    anchor.close()
    assert [o.id for o in owners] == ["o1"] and count == 1
    assert runner.read_backs == 1, "the production read-back did not run"
    assert runner.reconnects >= 1


def test_a_refused_operation_rolls_back_only_its_savepoint_in_a_shared_batch() -> None:
    anchor = shared_database("savepoints")
    journal = Journal("sqlite:///sim/journal.db", runner=MemorySqlite("savepoints",
                                                                      latency=lambda: 0.01))

    def refuse(db: Any) -> None:
        ops.register_owner(db, OwnerRow("o2", 1, "h", 1.0, 1.0))
        raise JournalError("refused")

    async def main() -> list[BaseException | None]:
        await journal.open()
        outcomes = await asyncio.gather(
            journal.register_owner(OwnerRow("o1", 1, "h", 1.0, 1.0)),
            journal._write(refuse), return_exceptions=True)
        await journal.close()
        return [o if isinstance(o, BaseException) else None for o in outcomes]

    outcomes = run(SimLoop(random.Random(0)), main())
    ids = [r[0] for r in anchor.execute("SELECT id FROM owners")]
    anchor.close()
    assert outcomes[0] is None and isinstance(outcomes[1], JournalError)
    assert ids == ["o1"]


def test_a_killed_process_writes_nothing_more_even_as_its_code_closes_the_journal() -> None:
    """A crash closes a host's coroutines where they stand, and a ``finally`` of theirs may
    still close the journal; a killed process commits nothing more (its queued writes are
    not flushed) and persists no chain head it noted."""
    from tether._sim.plan import HeadsFile

    anchor = shared_database("killed")
    host = Host("w0.0")
    heads = HeadsFile()
    memory = heads.memory(lambda: host.alive)
    journal = Journal("sqlite:///sim/journal.db",
                      runner=MemorySqlite("killed", latency=lambda: 0.01,
                                          alive=lambda: host.alive))

    async def main() -> None:
        await journal.open()
        await journal.register_owner(OwnerRow("o1", 1, "h", 1.0, 1.0))
        journal.heartbeat("o1", 2.0)  # queued, not flushed yet
        memory.note("d1", 3, "h3")
        host.alive = False  # killed here: what its code does next reaches nothing
        await journal.close()
        memory.persist()

    run(SimLoop(random.Random(0)), main())
    beat = anchor.execute("SELECT heartbeat_at FROM owners WHERE id = 'o1'").fetchone()
    anchor.close()
    assert beat == (1.0,)
    assert heads.lines == []


def test_a_lost_server_loses_the_commits_since_the_last_that_waited_for_the_disk() -> None:
    """``server_lost``: a relaxed commit after a durable one is lost with the server, every
    connection is cut, and the next batch reconnects; a durable commit makes everything
    before it safe (the log is synced in order), so then nothing is lost."""
    anchor = shared_database("server-lost")
    server = Server(anchor)
    runner = Counted("server-lost", server=server)
    journal = Journal("sqlite:///sim/journal.db", runner=runner, wall=lambda: 1.0)
    journal.relaxed_posts = True

    def kinds() -> list[str]:
        return [r[0] for r in anchor.execute("SELECT kind FROM events ORDER BY id")]

    async def main() -> list[tuple[bool, list[str]]]:
        seen = []
        await journal.open()
        journal.event(1.0, "synced")
        await journal.flush()
        journal.event(1.0, "posted")
        await journal.flush(durable=False)
        seen.append((server.crash(), kinds()))
        journal.event(1.0, "after")  # the cut connection is found broken, and replaced
        journal.event(1.0, "relaxed")
        await journal.flush(durable=False)
        await journal.flush()  # durable: the relaxed commit before it is safe now
        seen.append((server.crash(), kinds()))
        await journal.close()
        return seen

    seen = run(SimLoop(random.Random(0)), main())
    anchor.close()
    assert seen == [(True, ["synced"]), (False, ["synced", "after", "relaxed"])]
    assert runner.reconnects >= 1


SIGNER = SigningKey.from_raw(bytes(range(32)), "sim")


def ring() -> KeyRing:
    """A process's key ring: the trial's key, and a head memory of its own."""
    return KeyRing(SIGNER, TrustedKeys([SIGNER.public]))


class Writer:
    """A writes without waiting for the disk (the MCP proxy's mode), B reads: one journal,
    ``a`` and ``b`` their own journals on it (a shared simulated one with ``server``)."""

    def __init__(self, url: str, server: Server | None = None) -> None:
        name = url.split("/")[-2] if server is not None else ""
        self.ra, self.rb = ring(), ring()

        def journal(mark: str) -> Journal:
            runner = MemorySqlite(name, server=server, mark=mark) if server else None
            return Journal(url, runner=runner, wall=lambda: 1.0)

        self.a, self.b = journal("a"), journal("b")
        self.a.relaxed_posts = True

    async def delegation(self, delegation_id: str) -> str:
        """Open both, and make a delegation of A's, durably."""
        await self.a.open()
        await self.b.open()
        await self.a.genesis(SIGNER, 1.0)
        self.a.seal_with(SIGNER, self.ra.trusted)
        self.b.seal_with(SIGNER, self.rb.trusted)
        await self.a.register_owner(OwnerRow("o1", 1, "h", 1.0, 1.0))
        row = await self.a.create_delegation(NewDelegation(
            id=delegation_id, task_id=f"t{delegation_id}", parent_id=None, attempt=1,
            agent="a", surface=(), args={}, owner_id="o1", now=1.0))
        return row.id

    async def relaxed_event(self, delegation_id: str) -> None:
        self.a.event(1.0, "relaxed", delegation_id)
        await self.a.flush(durable=False)

    async def read_relaxed(self, delegation_id: str) -> tuple[str, Any]:
        """A's delegation with a relaxed head on it, read by B: the id, and what B
        remembered of it at once."""
        d = await self.delegation(delegation_id)
        await self.relaxed_event(d)
        await self.b.chain_verdicts([d], self.rb.trusted)
        return d, self.heads.seen(d)

    async def close(self) -> None:
        await self.a.close()
        await self.b.close()

    @property
    def heads(self) -> Any:
        assert self.rb.trusted.heads is not None
        return self.rb.trusted.heads


def test_a_head_read_before_it_reached_the_disk_is_remembered_only_once_it_did() -> None:
    """Process A commits a receipt without waiting for the disk (the MCP proxy's mode); B
    reads and accepts A's chain; the server crashes and loses A's commit. B must not take
    the journal for rolled back (it refused to reconcile, and left its own later writes
    unsealed: inserted rows for everyone else). Once a commit of B's that waited for the
    disk came after its read, what it read is remembered."""
    anchor = shared_database("read-relaxed")
    server = Server(anchor)
    w = Writer("sqlite:///read-relaxed/journal.db", server)
    b = w.b

    async def main() -> tuple[Any, ...]:
        d = await w.delegation("d_x")
        await w.relaxed_event(d)
        read = await b.chain_verdicts([d], w.rb.trusted)
        accepted = (w.heads.seen(d), w.heads.pending().get(d))
        lost = server.crash()
        after = await b.chain_verdicts([d], w.rb.trusted)
        await b.untampered([d], w.rb.trusted, "reconcile")
        await b.record_event(1.0, "written after the crash", d)
        fresh = await b.chain_verdicts([d], ring().trusted)
        await b.flush()  # a commit that waited for the disk, after the read
        result = (read[0].ok, accepted, lost, after[0].problems, fresh[0].problems,
                  w.heads.seen(d), await b.chain_verdicts([d], ring().trusted))
        await w.close()
        return result

    ok, accepted, lost, after, fresh, remembered, now = run(SimLoop(random.Random(0)), main())
    anchor.close()
    assert ok and lost
    seen, pending = accepted
    assert seen is None and pending is not None  # accepted, not remembered before the disk
    assert after == [] and fresh == []
    assert remembered is not None and remembered != pending  # what holds now, not what went
    assert now[0].ok


@pytest.mark.parametrize("after_crash", ["flush", "read the older head, then flush"])
def test_a_head_accepted_before_a_server_crash_is_never_confirmed_after_it(
        after_crash: str) -> None:
    """B accepts A's head of a relaxed commit; the server crashes and loses it. Nothing B
    does afterwards confirms it: not a durable flush on the server's next life (a new
    connection), nor one after B read the older head again (the journal no longer holds
    the one accepted)."""
    name = f"crash-pending-{len(after_crash)}"
    anchor = shared_database(name)
    server = Server(anchor)
    w = Writer(f"sqlite:///{name}/journal.db", server)
    b = w.b

    async def main() -> Any:
        d = await w.delegation("d_y")
        await b.chain_verdicts([d], w.rb.trusted)
        await b.flush()  # the durable head, remembered
        await w.relaxed_event(d)
        await b.chain_verdicts([d], w.rb.trusted)  # accepts the relaxed head
        assert server.crash()
        if after_crash != "flush":
            await b.chain_verdicts([d], w.rb.trusted)
        await b.flush()
        (verdict,) = await b.chain_verdicts([d], w.rb.trusted)
        await w.close()
        return verdict

    verdict = run(SimLoop(random.Random(0)), main())
    anchor.close()
    assert verdict.problems == []


def test_a_flush_after_a_read_syncs_the_sqlite_log_another_process_left_unsynced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite: A commits without waiting for the disk; B reads and accepts its head; B's
    durable flush writes nothing, yet syncs the write-ahead log (what A wrote with it)
    before B remembers the head."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    w = Writer(f"sqlite:///{tmp_path / 'journal.db'}")

    async def main() -> tuple[Any, Any]:
        d, before = await w.read_relaxed("d_z")
        synced.clear()
        await w.b.flush()
        after = w.heads.seen(d)
        await w.close()
        return before, after

    before, after = asyncio.run(main())
    assert before is None and after is not None
    assert [p for p in synced if p.endswith("journal.db-wal")], synced


@pytest.mark.parametrize("disk", ["syncs", "refuses"])
def test_a_reader_that_closes_remembers_what_it_read_once_the_sqlite_log_is_synced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: str) -> None:
    """SQLite: B only reads A's relaxed head, then closes (`tether verify`): its close syncs the
    write-ahead log from outside any transaction and only then remembers the head; a log that
    refuses the sync leaves it unremembered, and the close still ends cleanly."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("journal.db-wal"):
            synced.append(path)
            if disk == "refuses":
                raise OSError(5, "Input/output error")
        real(fd)

    w = Writer(f"sqlite:///{tmp_path / 'journal.db'}")

    async def main() -> tuple[Any, Any]:
        d, before = await w.read_relaxed("d_c")
        monkeypatch.setattr(os, "fsync", fsync)
        await w.b.close()  # A is still open: its log is there, unsynced
        monkeypatch.setattr(os, "fsync", real)
        await w.a.close()
        return d, before

    d, before = asyncio.run(main())
    assert before is None
    assert synced, "the close never synced the write-ahead log"
    assert (w.heads.seen(d) is not None) is (disk == "syncs")


async def _read_then_close(w: Writer, d: str, between: Any = None) -> tuple[Any, Any]:
    """B reads A's head, then (after ``between``) closes: what B remembered then and after."""
    await w.b.chain_verdicts([d], w.rb.trusted)
    before = w.heads.seen(d)
    if between is not None:
        await between()
    await w.b.close()
    await w.a.close()
    return before, w.heads.seen(d)


async def test_a_postgresql_reader_remembers_what_it_read_once_the_log_is_on_disk(
        pg_url: str) -> None:
    """PostgreSQL: B only reads (`tether verify`) a head A committed durably: B's close finds
    the server's log on disk past its read and remembers the head (before, a reader on
    PostgreSQL remembered nothing: no rollback witness for a configuration that only reads)."""
    w = Writer(pg_url)
    d = await w.delegation("d_pg")
    before, after = await _read_then_close(w, d)
    assert before is None and after is not None


@pytest.mark.parametrize("then", ["crash", "no_flush", "durable_commit"])
async def test_a_postgresql_reader_remembers_a_relaxed_head_only_once_it_is_on_disk(
        tmp_path: Path, then: str) -> None:
    """A commits without waiting for the disk, on a server whose WAL writer waits 10 s; B
    reads A's head, then closes. A crash of the server in between loses the head: B must not
    remember it. With nothing flushed meanwhile, B does not wait 10 s: it leaves the head
    unremembered. A durable commit of A's after the read flushes the log past it: remembered."""
    from tether._chaos.pgserver import PrivateServer

    with PrivateServer(wal_writer_delay="10s") as server:
        w = Writer(f"{server.url}?schema=reader&keys={tmp_path / 'keys'}")

        async def between() -> None:
            if then == "crash":
                await asyncio.to_thread(server.restart, "immediate")
            elif then == "durable_commit":
                w.a.event(1.0, "durable")
                await w.a.flush()

        d = await w.delegation("d_relaxed")
        await w.relaxed_event(d)
        before, after = await _read_then_close(w, d, between)
    assert before is None
    assert (after is not None) is (then == "durable_commit"), after


def _crash_a_backend(url: str) -> None:
    """SIGKILL one server process: the server ends every session and restarts from its log
    by itself, its start time unchanged, and loses what its WAL writer had not flushed."""
    import signal
    import time

    import psycopg

    with psycopg.connect(url, autocommit=True) as victim:
        os.kill(victim.info.backend_pid, signal.SIGKILL)
        with contextlib.suppress(psycopg.Error):
            victim.execute("SELECT 1")  # its server process is gone
    for _ in range(400):
        time.sleep(0.05)
        with contextlib.suppress(psycopg.Error):
            psycopg.connect(url, autocommit=True).close()
            return
    raise AssertionError("the server did not come back")


@pytest.mark.parametrize("how", ["failed_read", "reopened", "crash_restart"])
async def test_a_postgresql_reader_never_remembers_a_head_the_server_then_lost(
        tmp_path: Path, how: str) -> None:
    """B reads a head A committed without waiting for the disk, in a way that must leave it
    unremembered: the read fails after accepting it (another read of B's had been placed in
    the log before), or B closes, the server loses the commit (a restart, or a crash it
    restarts from by itself, its start time unchanged), and B is opened again and closed.
    The configuration must then find the journal as it is, not rolled back."""
    from tether._chaos.pgserver import PrivateServer

    with PrivateServer(wal_writer_delay="10s") as server:
        url = f"{server.url}?schema=lost&keys={tmp_path / 'keys'}"
        w = Writer(url)
        x = await w.delegation("d_x")
        y = await w.a.create_delegation(NewDelegation(
            id="d_y", task_id="td_y", parent_id=None, attempt=1, agent="a", surface=(),
            args={}, owner_id="o1", now=1.0))
        await w.b.chain_verdicts([x], w.rb.trusted)  # placed, and flushed
        await w.relaxed_event(y.id)
        if how == "failed_read":
            with pytest.raises(JournalError):
                await w.b.chain_verdicts([y.id, "bad\x00"], w.rb.trusted)
            await w.b.close()
            await asyncio.to_thread(server.restart, "immediate")
        else:
            await w.b.chain_verdicts([y.id], w.rb.trusted)
            await w.b.close()  # the log is not on disk within the close's wait
            if how == "reopened":
                await asyncio.to_thread(server.restart, "immediate")
            else:
                await asyncio.to_thread(_crash_a_backend, server.url)
            for _ in range(20):  # the journal goes on: the log passes where it was lost
                w.a.event(1.0, "after", x)
                await w.a.flush()
            await w.b.open()
            if how == "reopened":
                await w.b.chain_verdicts([x], w.rb.trusted)
            await w.b.close()
        await w.a.close()
        assert w.heads.seen(y.id) is None
        async with Journal(url) as c:
            (verdict,) = await c.chain_verdicts([y.id], w.rb.trusted)
    assert verdict.ok, verdict.problems


async def test_a_flush_through_a_connection_that_outlived_the_server_confirms_nothing_lost(
        tmp_path: Path) -> None:
    """A transaction pooler keeps the client's connection when the server crashes and gives it
    a new server session silently: to the journal, the same connection. B read A's relaxed
    head, the server lost it, and B's next durable flush commits on the server's new life:
    the head must not be remembered on the strength of that flush (the pooler is emulated by
    keeping B's connection token through the crash)."""
    from tether._chaos.pgserver import PrivateServer

    with PrivateServer(wal_writer_delay="10s") as server:
        url = f"{server.url}?schema=pooled&keys={tmp_path / 'keys'}"
        w = Writer(url)
        d, before = await w.read_relaxed("d_p")
        token = w.b._connection()
        w.b._connection = lambda: token  # type: ignore[method-assign]
        await asyncio.to_thread(_crash_a_backend, server.url)
        await w.b.flush()
        remembered = w.heads.seen(d)
        await w.close()
        async with Journal(url) as c:
            (verdict,) = await c.chain_verdicts([d], w.rb.trusted)
    assert before is None and remembered is None
    assert verdict.ok, verdict.problems


# -- trials of the production engine ---------------------------------------------------------

def test_a_bounded_run_of_the_production_runtime_finds_no_violation() -> None:
    result = run_sim(24, 11)
    assert result["trials"] == 24
    assert result["violations"] == [], result["violations"][:3]
    assert result["totals"]["applied"] > 0 and result["totals"]["commits"] > 0


def test_a_trial_replays_exactly_from_its_seed() -> None:
    seed = trial_seed(4, 2)
    first = production.run_trial(seed, trace=True)
    again = production.run_trial(seed, trace=True)
    assert first.trace and first.trace == again.trace
    assert first.digest == again.digest
    replayed = run_sim(1, 0, replay=seed)
    assert replayed["trials_detail"][0]["trace_sha256"] == first.digest
    assert replayed["trace"] == first.trace


def test_the_faults_reach_the_production_code() -> None:
    """Each fault the engine draws leaves its mark: a lost commit reply is read back by the
    runner, a crash restarts a process, a late apply is refused by the provider."""
    seen: Counter[str] = Counter()
    for i in range(12):
        result = production.run_trial(trial_seed(21, i), ("commit_lost", "crash", "late_apply"),
                                      trace=True)
        seen.update(result.stats)
        seen["refused"] += sum("provider refused" in line for line in result.trace or [])
    assert seen["commits_lost"] > 0 and seen["restarts"] > 0 and seen["refused"] > 0, seen


def test_a_probe_judged_final_before_its_deadline_is_caught_in_production_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mutation of the production reconciler (not of a model of it): "not applied" taken
    as final whatever the dispatch deadline says."""
    original = outcome.judge_probe

    def final(answer: ProbeOutcome, *, voided: bool, deadline_at: float, now: float,
              tolerance: float) -> ActionState:
        if answer is ProbeOutcome.NOT_APPLIED:
            return ActionState.NOT_APPLIED
        return original(answer, voided=voided, deadline_at=deadline_at, now=now,
                        tolerance=tolerance)

    monkeypatch.setattr(reconcile, "judge_probe", final)
    result = run_sim(30, 99, ("late_apply", "reply_lost", "race"))
    assert result["counts"]["dishonest"] > 0, result["counts"]


def test_an_orchestrator_waits_for_a_redelegated_epoch_that_starts_past_attempt_one() -> None:
    """Seed 1941492191: t0 was re-dispatched (attempt 2), then re-delegated; the new epoch's
    first row is attempt 2. An orchestrator that looked for attempt 1 stopped waiting on
    that epoch, and the trial ended with it queued and unclaimed (stuck)."""
    faults = ("crash", "probe_raise", "probe_early", "commit_lost", "notify_lost", "clock",
              "race", "stream_cut")
    result = production.run_trial(1941492191, faults)
    assert result.violations == [], result.violations


def test_a_worker_that_lost_its_lease_is_started_again_and_claims_what_was_queued() -> None:
    """Found with seed 1114455190 (its interleaving has moved since): the only worker, paused
    past its lease, stopped with LeaseLost while the re-delegated epoch of t0 waited in the
    queue; a restarted orchestrator had no tasks to wait for, so the trial ended with that
    epoch unclaimed (stuck). Trials of the same faults until one has a worker lose its lease:
    each of them is clean, and a worker of the same name worked again after it."""
    faults = ("crash", "pause", "reply_lost", "probe_early", "race")
    for i in range(60):
        result = production.run_trial(trial_seed(5, i), faults, trace=True)
        assert result.violations == [], result.violations
        lines = result.trace or []
        lost = [n for n, line in enumerate(lines) if "stopped: LeaseLost" in line]
        if lost:
            name = lines[lost[0]].split(" note ")[1].split(" stopped")[0]  # e.g. w0.0
            again = f" {name.split('.')[0]}.{int(name.split('.')[1]) + 1} "
            assert any(again in line for line in lines[lost[0]:]), name
            return
    pytest.fail("no trial had a worker lose its lease")


# -- what the production engine found in production code ------------------------------------

async def test_a_parent_that_failed_leaves_no_child_paying_after_terminate(
        tmp_path: Path) -> None:
    """Found (in the runtime of then) by ``tether sim --replay 1910862834 --faults
    crash,probe_raise,commit_lost,race`` (ghost): the root awaited its first child, which was
    recalled, and raised; its second child went on; cancel() of the task found the root
    finished and returned; the second child's next payment landed after that."""
    applied: list[str] = []
    go = asyncio.Event()

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def pay(n: int, *, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "ok"

    @tether.agent(tools=[pay])
    async def fails(ctx: tether.Context) -> None:
        raise RuntimeError("the first child fails")

    @tether.agent(tools=[pay])
    async def pays_later(ctx: tether.Context) -> None:
        await go.wait()
        await ctx.call(pay, n=1)

    @tether.agent(tools=[fails, pays_later])
    async def parent(ctx: tether.Context) -> None:
        first = await ctx.delegate(fails)
        second = await ctx.delegate(pays_later)
        await first.result()  # raises: the parent fails with its second child running
        await second.result()

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}") as sup:
        handle = await sup.delegate(parent)
        with pytest.raises(tether.DelegationError):
            await handle.result()
        await handle.terminate("stop the whole task")
        go.set()  # whatever still runs of the task may go on now
        second = next(r for r in await sup.journal.delegations() if r.agent == "pays_later")
        while not (await sup.journal.get(second.id)).state.terminal:  # ran on, or stopped
            await sup.wake(0.01)
    assert applied == [], "a payment of the task landed after terminate() returned"


async def test_a_parent_that_returned_ends_after_the_children_it_started(
        tmp_path: Path) -> None:
    """A delegation that returns with a child still running waits for it (a nursery's scope):
    its own ending is recorded after the child's, and its result only then, so a terminate of
    the task meanwhile still reaches that child."""
    applied: list[str] = []
    returned, go = asyncio.Event(), asyncio.Event()

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def pay(n: int, *, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "ok"

    @tether.agent(tools=[pay])
    async def pays_later(ctx: tether.Context) -> None:
        await go.wait()
        await ctx.call(pay, n=1)

    @tether.agent(tools=[pays_later])
    async def parent(ctx: tether.Context) -> str:
        await ctx.delegate(pays_later)  # never awaited
        returned.set()
        return "done"

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}") as sup:
        handle = await sup.delegate(parent)
        await returned.wait()
        go.set()
        assert await handle.result() == "done"
        rows = {r.agent: r for r in await sup.journal.delegations()}
    assert len(applied) == 1
    assert rows["pays_later"].state is tether.DelegationState.SUCCEEDED
    assert rows["parent"].state is tether.DelegationState.SUCCEEDED
    assert rows["pays_later"].ended_at is not None and rows["parent"].ended_at is not None
    assert rows["pays_later"].ended_at <= rows["parent"].ended_at


# -- what the judge counts as an error of the code that ships -------------------------------

def test_a_thread_or_an_exception_in_a_callback_of_production_code_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A journal listener that starts a thread, or raises: the loop refuses the thread and
    the exception is logged by asyncio, neither raised to a caller the trial watches. Both
    are judged errors (a review found them passing for clean trials)."""
    from tether._runtime.supervisor import Supervisor

    original = Supervisor._notified

    def leaky(self: Supervisor, payload: str) -> None:
        threading.Thread(target=lambda: None).start()
        original(self, payload)

    monkeypatch.setattr(Supervisor, "_notified", leaky)
    found = production.run_trial(5, ("race",)).violations
    assert found and {v.kind for v in found} == {"error"}
    assert "refuses threads" in found[0].detail

    def failing(self: Supervisor, payload: str) -> None:
        raise ValueError("a listener's failure")

    monkeypatch.setattr(Supervisor, "_notified", failing)
    found = production.run_trial(5, ("race",)).violations
    assert found and "a listener's failure" in found[0].detail


def test_a_write_the_schema_refuses_is_an_error_even_when_nobody_waits_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat is posted: its batch's answer goes to nobody. A constraint that refuses it
    (here a duplicate key) is still the runtime asking the journal for something wrong."""
    def heartbeat(db: Any, owner_id: str, now: float) -> None:
        db.execute("INSERT INTO tether_meta (key, value) VALUES ('app', 'x')")

    monkeypatch.setattr(ops, "heartbeat", heartbeat)
    found = production.run_trial(trial_seed(11, 0)).violations
    assert any("constraints refused" in v.detail for v in found), found


def test_a_crashed_hosts_generator_exit_is_no_error_but_anything_else_is() -> None:
    """A crash closes a dead host's coroutines (GeneratorExit), and a future one awaited may be
    left holding it, unretrieved: the process is gone, so that is no error (fresh seeds found
    five such trials judged errors). Any other unretrieved exception is one."""
    loop = SimLoop(random.Random(0))
    loop.call_exception_handler({"message": "Future exception was never retrieved",
                                 "exception": GeneratorExit()})
    assert loop.errors == []
    loop.call_exception_handler({"message": "Future exception was never retrieved",
                                 "exception": ValueError("lost")})
    assert loop.errors == ["Future exception was never retrieved: ValueError('lost')"]
    loop.close()
