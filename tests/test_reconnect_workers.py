"""`tether worker` processes on a private PostgreSQL server that is restarted, has its backends
terminated, is stopped or paused under them: workers ride through what is shorter than their
lease and keep their claims; past it they give them up and exit 3 with one line, never hang;
payments and the journal agree throughout."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import tether
from tests import remote_agents
from tests.conftest import until
from tether._chaos.pgserver import PrivateServer

ROOT = Path(__file__).resolve().parent.parent
WITHIN = 90.0  # seconds: a test that has not ended by then hangs, and fails
NOISE = ("Traceback", "never retrieved", "was destroyed but it is pending")


class Fleet:
    def __init__(self, url: str, env: dict[str, str]) -> None:
        self.url = url
        self.env = env
        self.procs: list[asyncio.subprocess.Process] = []

    async def worker(self, lease: str = "3") -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "worker", "--journal", self.url,
            "--agents", "tests.remote_agents:AGENTS", "--lease", lease, "--concurrency", "20",
            env=self.env, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stderr is not None
        line = (await proc.stdout.readline()).decode()
        assert line.startswith("worker "), line + (await proc.stderr.read()).decode()
        return proc


@pytest.fixture
async def fleet(private_url: str, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    gates = tmp_path / "gates"
    remote_agents.make_gates(gates, "started", "release")
    monkeypatch.setenv("TETHER_TEST_LEDGER", str(tmp_path / "ledger.db"))
    monkeypatch.setenv("TETHER_TEST_GATES", str(gates))
    remote_agents.ledger.cache_clear()
    f = Fleet(private_url, {**os.environ, "PYTHONPATH": str(ROOT)})
    yield f
    for proc in f.procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    remote_agents.ledger.cache_clear()



async def stop(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    code = await asyncio.wait_for(proc.wait(), WITHIN)
    return code, (await proc.stderr.read()).decode()


def fault(private_pg: PrivateServer, name: str) -> Callable[[], Awaitable[object]]:
    actions: dict[str, Callable[[], object]] = {
        "restart-fast": lambda: private_pg.restart("fast"),
        "restart-immediate": lambda: private_pg.restart("immediate"),
        "terminate": private_pg.terminate,
    }
    return lambda: asyncio.to_thread(actions[name])


@pytest.mark.parametrize("name", ["restart-fast", "restart-immediate", "terminate"])
async def test_workers_ride_through_and_keep_their_claims(
        private_pg: PrivateServer, fleet: Fleet, name: str) -> None:
    workers = [await fleet.worker() for _ in range(2)]
    ledger = remote_agents.ledger()

    async def run() -> list[list[str]]:
        async with tether.Supervisor(fleet.url, tools=remote_agents.TOOLS,
                                     recover=False) as sup:
            handles = [await sup.delegate(remote_agents.refunder, f"R-{n}", f"S-{n}",
                                          remote=True) for n in range(30)]
            await until(lambda: len(ledger.entries()) >= 10, "payments flowing", WITHIN)
            await fault(private_pg, name)()
            handles += [await sup.delegate(remote_agents.refunder, f"R-{n}", f"S-{n}",
                                           remote=True) for n in range(30, 40)]
            results: list[list[str]] = [await h.result() for h in handles]
            actions = await sup.journal.actions([h.id for h in handles])
            keys = {e.key for e in ledger.entries()}
            assert {a.idempotency_key for a in actions} == keys
            assert {a.state for a in actions} == {tether.ActionState.COMPLETED}
            return results

    results = await asyncio.wait_for(run(), WITHIN)
    assert [len(r) for r in results] == [2] * 40
    assert [ledger.refund_count(f"R-{n}") for n in range(40)] == [1] * 40
    assert all(w.returncode is None for w in workers), "a worker stopped"
    for proc in workers:
        code, err = await stop(proc)
        assert code == 0, err
        assert not any(n in err for n in NOISE), err


@pytest.mark.parametrize("how", ["down", "pause"])
async def test_a_worker_whose_journal_stays_away_past_its_lease_gives_up_and_exits_3(
        private_pg: PrivateServer, fleet: Fleet, how: str) -> None:
    """A delegation holds (its provider's reply waits) when the server goes away for longer
    than the lease: the worker exits 3 with one line, without a traceback and without
    waiting on the server. Once it is back, another supervisor settles the delegation from
    the provider's ledger: the payment that was applied is COMPLETED."""
    worker = await fleet.worker(lease="1")
    async with tether.Supervisor(fleet.url, tools=remote_agents.TOOLS, recover=False) as sup:
        started = await remote_agents.listen_gate("started")
        handle = await sup.delegate(remote_agents.refunder, "reply-1", remote=True)
        assert await asyncio.wait_for(started, WITHIN) == "applied reply-1"
        try:
            if how == "down":
                await asyncio.to_thread(private_pg.down, "immediate")
            else:
                await asyncio.to_thread(private_pg.pause)
            code = await asyncio.wait_for(worker.wait(), WITHIN)
        finally:  # back before this supervisor closes, whatever happened
            if how == "down":
                await asyncio.to_thread(private_pg.up)
            else:
                await asyncio.to_thread(private_pg.resume)
        assert worker.stderr is not None
        err = (await worker.stderr.read()).decode()
    assert code == 3, err
    lines = [ln for ln in err.strip().splitlines() if " INFO " not in ln]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    async with tether.Supervisor(fleet.url, tools=remote_agents.TOOLS) as sup:
        report = await sup.report(handle.id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN
        while not report.outcome.terminal and loop.time() < deadline:
            await sup.recover(handle.id)
            report = await sup.report(handle.id)
    assert [a.state for a in report.actions] == [tether.ActionState.COMPLETED]
    assert remote_agents.ledger().refund_count("reply-1") == 1
