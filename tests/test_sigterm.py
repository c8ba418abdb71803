"""A process running a supervisor that is stopped by SIGTERM leaves nothing RUNNING: with
``handle_signals=True`` it settles its children before it exits; with Python's default it dies
at once, and the next supervisor to open the journal settles them when it starts."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

import tether

ROOT = Path(__file__).resolve().parent.parent
CHILDREN = 5

ORCHESTRATOR = """
import asyncio, sys, tether

@tether.tool(dispatch_deadline=600.0)
async def pay(order: str, *, idempotency_key: str) -> str:
    while order.startswith("hang"):  # a call that outlives the supervisor's patience on
        try:                          # exit: it shrugs off the terminate's cancellation too
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            continue
    return "paid " + order

async def agent(ctx, order):
    await ctx.call(pay, order=order)
    await asyncio.Event().wait()  # works on until stopped

async def main(url, handle, children):
    extra = {"handle_signals": True} if handle else {}
    async with tether.Supervisor(url, tools=[pay], **extra) as sup:
        for i in range(children):
            await sup.delegate(agent, f"o-{i}", tools=[pay])
        if sys.argv[4:] == ["hang"]:
            await sup.delegate(agent, "hang", tools=[pay])
        while len([a for d in await sup.journal.delegations()
                   for a in (await sup.report(d.id)).actions]) < children + len(sys.argv[4:]):
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2] == "handle", int(sys.argv[3])))
"""


async def start(url: str, *args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ORCHESTRATOR, url, *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line == b"ready\n", line + await proc.stderr.read()
    return proc


async def run_and_sigterm(url: str, mode: str) -> tuple[int, str]:
    proc = await start(url, mode, str(CHILDREN))
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def states(url: str, recover: bool) -> list[tether.DelegationState]:
    async with tether.Supervisor(url, recover=recover) as sup:
        return [d.state for d in await sup.journal.delegations()]


async def test_sigterm_with_handle_signals_settles_before_exit(journal_url: str) -> None:
    code, err = await run_and_sigterm(journal_url, "handle")
    assert code == 128 + signal.SIGTERM and "Traceback" not in err, err
    # Nobody else has reconciled anything: the process itself settled its children.
    assert await states(journal_url, recover=False) == \
        [tether.DelegationState.TERMINATED] * CHILDREN


async def test_after_a_plain_sigterm_the_next_supervisor_settles_at_once(
        journal_url: str) -> None:
    code, _ = await run_and_sigterm(journal_url, "default")
    assert code == -signal.SIGTERM  # Python's default: the process ended, settling nothing
    assert set(await states(journal_url, recover=False)) == {tether.DelegationState.RUNNING}
    # Opening a supervisor recovers: the dead process's children are settled as it starts.
    settled = await states(journal_url, recover=True)
    assert len(settled) == CHILDREN and all(s.terminal for s in settled), settled


def test_handle_signals_restores_the_previous_handler(tmp_path: Path) -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        async def main() -> None:
            async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", handle_signals=True,
                                         keys=tether.KeyRing.ephemeral()):
                assert signal.getsignal(signal.SIGTERM) is not mine

        asyncio.run(main())
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


async def test_handle_signals_outside_the_main_thread_is_a_user_error(tmp_path: Path) -> None:
    def in_thread() -> None:
        async def main() -> None:
            async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", handle_signals=True,
                                         keys=tether.KeyRing.ephemeral()):
                pass

        asyncio.run(main())

    with pytest.raises(tether.errors.UserError, match="main thread"):
        await asyncio.to_thread(in_thread)


async def test_a_second_sigterm_while_settling_ends_the_process(journal_url: str) -> None:
    """The first SIGTERM starts the settling, which waits a bounded while (15 s by default)
    for a call still running; a second one is not ignored: the process ends there and then,
    and what it left is settled by the next supervisor, as after any crash."""
    proc = await start(journal_url, "handle", "0", "hang")
    proc.send_signal(signal.SIGTERM)
    deadline = asyncio.get_running_loop().time() + 60
    async with tether.Journal(journal_url, create=False) as journal:
        while (await journal.delegations())[0].state is tether.DelegationState.RUNNING:
            assert asyncio.get_running_loop().time() < deadline, "the first SIGTERM was lost"
            await asyncio.sleep(0.02)  # polling another process's progress: real time
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == -signal.SIGTERM
    settled = await states(journal_url, recover=True)
    assert len(settled) == 1 and settled[0].terminal, settled
