"""Workers in other processes on PostgreSQL: recall, terminate, SIGKILL, a paused worker and
racing orchestrators, each with real `tether worker` processes on loopback (I2, I3, I4, I8)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import tether
from tests import remote_agents
from tests.conftest import settled
from tests.remote_agents import listen_gate, open_gate

ROOT = Path(__file__).resolve().parent.parent
LEASE = "1"  # seconds: short, so that a dead worker is noticed quickly


@dataclass
class Cluster:
    url: str
    env: dict[str, str]
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)

    async def worker(self, *extra: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "worker", "--journal", self.url,
            "--agents", "tests.remote_agents:AGENTS", "--lease", LEASE, *extra,
            env=self.env, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        self.procs.append(proc)
        assert proc.stdout is not None
        line = (await proc.stdout.readline()).decode()
        assert line.startswith("worker "), line + (await proc.stderr.read()).decode() \
            if proc.stderr else line
        return proc


@pytest.fixture
async def cluster(pg_url: str, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    gates = tmp_path / "gates"
    remote_agents.make_gates(gates, "started", "release", "next", "go1", "go2")
    monkeypatch.setenv("TETHER_TEST_LEDGER", str(tmp_path / "ledger.db"))
    monkeypatch.setenv("TETHER_TEST_GATES", str(gates))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    remote_agents.ledger.cache_clear()
    c = Cluster(pg_url, env)
    yield c
    for proc in c.procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    remote_agents.ledger.cache_clear()


def supervisor(url: str) -> tether.Supervisor:
    return tether.Supervisor(url, tools=remote_agents.TOOLS, recover=False)


def spy_accepts(sup: tether.Supervisor, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a control intent from this orchestrator is durable in the journal."""
    accepted = asyncio.Event()
    original: Callable[..., Any] = sup.journal.sign_and_accept

    async def spy(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        accepted.set()
        return result

    monkeypatch.setattr(sup.journal, "sign_and_accept", spy)
    return accepted


async def test_a_queued_delegation_runs_on_a_worker(cluster: Cluster) -> None:
    async with supervisor(cluster.url) as sup:
        proc = await cluster.worker()
        handle = await sup.delegate(remote_agents.refunder, "A-1", remote=True)
        refs = await handle.result()
        report = await handle.report()
        row = await sup.journal.get(handle.id)
    assert len(refs) == 1 and remote_agents.ledger().refund_count("A-1") == 1
    assert report.outcome is tether.DelegationState.SUCCEEDED
    assert [a.state for a in report.actions] == [tether.ActionState.COMPLETED]
    assert row.owner_id != sup.owner_id  # the worker claimed it
    proc.send_signal(signal.SIGTERM)
    assert await proc.wait() == 0


async def test_recall_across_processes_lets_the_in_flight_action_finish(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    async with supervisor(cluster.url) as sup:
        await cluster.worker()
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "hold-1", then="R-2", remote=True)
        assert await started == "hold-1"  # in flight on the worker, intent durable
        accepted = spy_accepts(sup, monkeypatch)
        recall = asyncio.ensure_future(handle.recall(grace=60, reason="plan changed"))
        await accepted.wait()
        open_gate("release")  # the in-flight refund finishes inside the grace window
        report = await recall
    assert report.outcome is tether.DelegationState.RECALLED
    assert [(a.tool, a.state) for a in report.actions] == [
        ("refund", tether.ActionState.COMPLETED)]  # the second refund never started
    assert remote_agents.ledger().refund_count("hold-1") == 1
    assert remote_agents.ledger().refund_count("R-2") == 0


async def test_a_grace_window_expiring_on_a_worker_is_reconciled(cluster: Cluster) -> None:
    """The same grace rules as in one process: an action still in flight when the window ends
    is declared in doubt and probed; the report never calls it cancelled on a guess."""
    async with supervisor(cluster.url) as sup:
        await cluster.worker()
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "hold-4", remote=True)
        await started
        report = await handle.recall(grace=0.2, reason="too slow")  # never released
        assert report.verdict == "GRACE_EXPIRED"
        if not report.outcome.terminal:  # drained before the call's deadline: in doubt
            assert report.actions[0].state is tether.ActionState.IN_DOUBT
            report = await settled(sup, handle.id)  # the worker probes again at the deadline
    (action,) = report.actions
    assert action.state is tether.ActionState.NOT_APPLIED  # the provider has no entry
    assert action.evidence is not None and action.evidence["probe"] == "NOT_APPLIED"


async def test_a_terminate_after_a_recall_expired_on_a_worker_cuts_the_call_left_running(
        cluster: Cluster) -> None:
    """A recall whose grace ends with a call still running leaves that call to finish on the
    worker, which no longer tracks the delegation's code. A terminate then must still kill
    now: the worker cuts the call before the provider saw it, and settles the delegation
    itself (the worker claimed it from the queue; it is not queued work nobody ran)."""
    async with supervisor(cluster.url) as sup:
        await cluster.worker()
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "hold-6", remote=True)
        await started
        recalled = await handle.recall(grace=0.2, reason="too slow")  # the call held
        assert recalled.verdict == "GRACE_EXPIRED" and not recalled.outcome.terminal
        report = await handle.terminate(reason="kill it")
        # Cut: nobody waits at the gate any more (writing to it finds no reader).
        with pytest.raises(OSError, match="No such device or address"):  # ENXIO
            open_gate("release")
    assert report.verdict == "TERMINATE"  # the worker's drain, not a recovery from here
    assert remote_agents.ledger().refund_count("hold-6") == 0


async def test_terminate_across_processes_reconciles_the_in_flight_action(
        cluster: Cluster) -> None:
    async with supervisor(cluster.url) as sup:
        await cluster.worker()
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "hold-2", remote=True)
        await started
        report = await handle.terminate(reason="stop now")
        if not report.outcome.terminal:  # drained before the call's deadline: in doubt
            assert report.actions[0].state is tether.ActionState.IN_DOUBT
            report = await settled(sup, handle.id)  # the worker probes again at the deadline
    assert report.outcome is tether.DelegationState.RECONCILED  # terminated, then probed
    assert report.verdict == "TERMINATE"
    (action,) = report.actions
    # Cancelled before the provider saw it: the worker's probe says so, with evidence.
    assert action.state is tether.ActionState.NOT_APPLIED
    assert action.evidence is not None and action.evidence["probe"] == "NOT_APPLIED"
    assert remote_agents.ledger().refund_count("hold-2") == 0


async def test_a_worker_killed_mid_action_is_reconciled_after_its_lease(
        cluster: Cluster) -> None:
    async with supervisor(cluster.url) as sup:
        proc = await cluster.worker()
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "reply-3", remote=True)
        assert await started == "applied reply-3"  # applied; the reply never comes
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
        await handle.wait()  # returns once the lease ran out and the work was reconciled
        report = await handle.report()
    (action,) = report.actions
    assert action.state is tether.ActionState.COMPLETED  # the probe found it applied
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"
    assert report.verdict == "RECOVERED"
    assert remote_agents.ledger().refund_count("reply-3") == 1


async def test_a_stopped_worker_terminates_what_it_still_holds_and_gives_up_its_lease(
        cluster: Cluster) -> None:
    async with supervisor(cluster.url) as sup:
        proc = await cluster.worker("--lease", "60", "--stop-timeout", "0.2")
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "hold-5", remote=True)
        await started
        proc.send_signal(signal.SIGTERM)  # the refund never finishes on its own
        assert await proc.wait() == 0
        await handle.wait()  # at once: no waiting for a 60 s lease to run out
        report = await handle.report()
        owners = {o.id: o for o in await sup.journal.owners()}
        row = await sup.journal.get(handle.id)
    (action,) = report.actions
    assert report.verdict == "TERMINATE" and action.state is tether.ActionState.NOT_APPLIED
    lease = owners[row.owner_id].lease_until
    assert lease is not None and lease <= time.time()


async def test_a_paused_worker_is_fenced_after_its_lease_expired(cluster: Cluster) -> None:
    async with supervisor(cluster.url) as sup:
        proc = await cluster.worker()
        started = await listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "P-1", then="after-gate-P-2",
                                    remote=True)
        assert await started == "first done P-1"
        proc.send_signal(signal.SIGSTOP)  # a VM paused between two payments
        await handle.wait()  # the orchestrator presumed it dead and reconciled it
        open_gate("next")  # the second payment is now due...
        proc.send_signal(signal.SIGCONT)  # ...when the worker wakes up
        assert await proc.wait() == 3  # it found its lease gone and stopped
        report = await handle.report()
    # Whichever came first on waking (renewing the lease, or the next payment, or a write on
    # a connection the server closed because it was paused inside a transaction), the journal
    # refused it, and the second payment never reached the provider.
    assert [a.args["order_id"] for a in report.actions] == ["P-1"]
    assert remote_agents.ledger().refund_count("after-gate-P-2") == 0
    assert report.verdict == "RECOVERED"


async def test_two_orchestrators_race_to_redelegate_and_exactly_one_wins(
        cluster: Cluster) -> None:
    async with supervisor(cluster.url) as sup:
        handle = await sup.delegate(remote_agents.refunder, "X-1", remote=True)
        report = await handle.recall(grace=5, reason="re-plan")  # no worker claimed it yet
        assert report.outcome is tether.DelegationState.RECALLED and report.actions == ()
        assert report.verdict == "NEVER_STARTED"
        racers = []
        for gate in ("go1", "go2"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.remote_agents", cluster.url, handle.id, gate,
                env=cluster.env, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            cluster.procs.append(proc)
            assert proc.stdout is not None
            assert (await proc.stdout.readline()).decode().strip() == "ready"
            racers.append(proc)
        open_gate("go1")
        open_gate("go2")
        answers = [await p.communicate() for p in racers]
        # A racer that answers neither way shows why (its traceback), not an IndexError.
        outs = sorted(out.decode().split()[0] if out.split() else
                      f"nothing (exit {p.returncode}): {err.decode()[-2000:]}"
                      for p, (out, err) in zip(racers, answers, strict=True))
        assert outs == ["lost", "won"]
        rows = [r for r in await sup.journal.delegations() if r.task_id == handle.task_id]
    assert sorted(r.epoch for r in rows) == [0, 1]


async def test_a_redelegation_committing_under_the_losers_check_is_no_tampering(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before re-delegating, an orchestrator checks that no epoch of the task was deleted by
    hand (``ops.epoch_gaps``: the epochs on record against the successors they name). At READ
    COMMITTED each statement sees what committed before it: a rival's re-delegation that
    commits between a read of the epochs and a read of the successors must not read as epoch 1
    deleted (a false Tampered, "decide by hand"); the loser loses the race (StaleEpoch). The
    racing-processes test above failed so about once in a hundred runs."""
    from tether._journal import ops

    loop = asyncio.get_running_loop()
    async with supervisor(pg_url) as a, supervisor(pg_url) as b:
        handle = await a.delegate(remote_agents.refunder, "X-2", remote=True)
        await handle.recall(grace=5, reason="re-plan")
        won: list[tether.Handle] = []
        fired: list[bool] = []
        real = ops.epoch_gaps

        def gaps(db: Any, ids: Any) -> Any:
            if fired:  # the rival's own check, and any after the race
                return real(db, ids)

            class Db:  # the rival commits right after the first read of the task's epochs
                def execute(self, statement: str, params: Any = ()) -> Any:
                    cursor = db.execute(statement, params)
                    if "FROM delegations WHERE task_id IN" in statement and not fired:
                        rows = cursor.fetchall()
                        fired.append(True)
                        won.append(asyncio.run_coroutine_threadsafe(
                            b.handle_for(handle.id).redelegate(), loop).result(timeout=30))
                        return Rows(rows)
                    return cursor

            return real(Db(), ids)

        monkeypatch.setattr(ops, "epoch_gaps", gaps)
        with pytest.raises(tether.errors.StaleEpoch):
            await a.handle_for(handle.id).redelegate()
        assert won and won[0].epoch == 1
        rows = [r for r in await a.journal.delegations() if r.task_id == handle.task_id]
    assert sorted(r.epoch for r in rows) == [0, 1]


class Rows:
    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def fetchall(self) -> list[Any]:
        return self._rows


async def test_two_workers_share_a_queue_and_run_each_task_exactly_once(
        cluster: Cluster) -> None:
    """Claims skip rows another worker holds (SKIP LOCKED): no task runs twice (I7)."""
    async with supervisor(cluster.url) as sup:
        workers = [await cluster.worker("--concurrency", "4") for _ in range(2)]
        handles = [await sup.delegate(remote_agents.refunder, f"M-{n}", remote=True)
                   for n in range(24)]
        results = [await h.result() for h in handles]
        owners = {(await sup.journal.get(h.id)).owner_id for h in handles}
    assert all(len(r) == 1 for r in results)
    assert [remote_agents.ledger().refund_count(f"M-{n}") for n in range(24)] == [1] * 24
    assert sup.owner_id not in owners and 1 <= len(owners) <= 2
    for proc in workers:
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0


@pytest.mark.parametrize(("spec", "message"), [
    ("nocolon", "module:attribute"),
    ("tests.no_such_module:AGENTS", "cannot import"),
    ("tests.remote_agents:MISSING", "no attribute"),
    ("tests.remote_agents:TOOLS", "not a tether agent"),
    ("tests.remote_agents:ledger", "not an agent"),
])
async def test_a_bad_agents_spec_is_one_line(tmp_path: Path, spec: str, message: str) -> None:
    journal = tmp_path / "j.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "worker", "--journal", f"sqlite:///{journal}",
        "--agents", spec, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    text = err.decode().strip()
    assert proc.returncode == 2 and text.startswith("error:") and message in text
    assert len(text.splitlines()) == 1 and "Traceback" not in text + out.decode()
    assert not journal.exists()  # refused before anything was written


@pytest.mark.parametrize("kwargs", [{"concurrency": 0}, {"lease": 0}, {"lease": float("nan")},
                                    {"poll": -1.0}])
def test_bad_worker_settings_are_user_errors(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(tether.errors.UserError):
        tether.Worker(f"sqlite:///{tmp_path / 'j.db'}", remote_agents.AGENTS, **kwargs)
    assert not (tmp_path / "j.db").exists()


async def test_a_worker_without_the_agent_leaves_the_task_queued(cluster: Cluster) -> None:
    """A worker claims only agents it can run; the task waits for one that can."""
    async with supervisor(cluster.url) as sup:
        other = tether.Agent("someone_else", remote_agents.refunder.fn,
                             remote_agents.refunder.tools)
        handle = await sup.delegate(other, "Q-1", remote=True)
        known = await sup.delegate(remote_agents.refunder, "Q-2", remote=True)
        await cluster.worker()
        # Claims go oldest first, so once the newer task ran, the worker has passed the older
        # one over rather than not looked yet.
        await known.result()
        report = await handle.recall(grace=5)  # still queued: settled here
    assert report.verdict == "NEVER_STARTED"


async def test_a_worker_stops_even_when_its_renewal_answers_as_it_is_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run()`` ends by cancelling the lease's task and waiting for it. A renewal that the
    journal answers in the very instant of that cancel must not swallow it (as
    ``asyncio.wait_for`` does on Python 3.11 when what it waits for is done by then): the
    task would go on renewing for ever and the worker never exit on SIGTERM."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    keys = tether.KeyRing.load_or_init(tmp_path / "keys")
    async with tether.Worker(url, remote_agents.AGENTS, lease=2.0, keys=keys) as w:
        for steps in range(6):  # the cancel lands at each step of the answer's way back
            answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            asked = asyncio.Event()

            async def renew_lease(*args: object, answer: asyncio.Future[bool] = answer,
                                  asked: asyncio.Event = asked, **kwargs: object) -> bool:
                asked.set()
                return await answer

            monkeypatch.setattr(w.supervisor.journal, "renew_lease", renew_lease)
            renewing = asyncio.create_task(w._renew())
            await asked.wait()
            answer.set_result(True)
            for _ in range(steps):
                await asyncio.sleep(0)
            if renewing.cancel():  # not done yet: it must end cancelled
                with pytest.raises(asyncio.CancelledError):
                    await renewing
            else:
                await renewing
            monkeypatch.undo()


async def test_a_clock_read_the_journal_holds_does_not_hold_back_the_renewals(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each renewal the worker reads the server's clock. A read the journal does not
    answer (a paused server) must not keep the next renewals waiting: that is how the worker
    learns within its lease, not after the read's own bound, that the journal is gone."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    keys = tether.KeyRing.load_or_init(tmp_path / "keys")
    async with tether.Worker(url, remote_agents.AGENTS, lease=1.0, keys=keys) as w:
        renewed = asyncio.Event()
        renewals = 0

        async def renew_lease(*args: object, **kwargs: object) -> bool:
            nonlocal renewals
            renewals += 1
            if renewals >= 3:
                renewed.set()
            return True

        async def server_time() -> float:
            await asyncio.Event().wait()  # never answered
            raise AssertionError("unreachable")

        monkeypatch.setattr(w.supervisor.journal, "renew_lease", renew_lease)
        monkeypatch.setattr(w.supervisor.journal, "server_time", server_time)
        beat = asyncio.create_task(w._keep_lease())
        try:
            async with asyncio.timeout(30):  # a bound on a condition; a tenth of a second each
                await renewed.wait()
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            monkeypatch.undo()
