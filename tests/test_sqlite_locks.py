"""A process keeps SQLite's locks on its journal for as long as it has a connection open.

POSIX drops every advisory lock a process holds on a file when the process closes any
descriptor of that file; a descriptor of tether's own opened beside SQLite's (to read the
header, say) drops SQLite's locks, and another process closing its last connection then
deletes the write-ahead log under live connections (SQLite's "How To Corrupt" lists this).
Each scenario opens the journal again in a process that already has it open, 20 times, while
another process opens, reads and closes its own connections to the file all along."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import tether
from tether._journal.journal import Journal

from .conftest import Shop

ROUNDS = 20

READER = """
import sqlite3, sys, time
from pathlib import Path
path, stop = sys.argv[1], Path(sys.argv[2])
print("reading", flush=True)
n = 0
while not stop.exists():
    conn = sqlite3.connect(path, timeout=5)
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    conn.close()  # the last connection to close checkpoints and deletes the log
    n += 1
    time.sleep(0.002)
print(n)
"""


@contextlib.asynccontextmanager
async def reader(path: Path, tmp_path: Path) -> AsyncIterator[None]:
    """Another process that opens, reads and closes the journal until the block ends."""
    stop = tmp_path / "stop-reading"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", READER, str(path), str(stop), stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"reading"
    try:
        yield
    finally:
        stop.touch()
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        assert int(out.strip()) > 0  # it did read meanwhile


def agent_paying(shop: Shop, i: int) -> Callable[[tether.Context], Awaitable[str]]:
    async def agent(ctx: tether.Context) -> str:
        ref: str = await ctx.call(shop.refund, order_id=f"L-{i}", cents=1)
        return ref
    return agent


async def test_a_second_journal_on_the_same_file_keeps_the_first_ones_locks(
        sqlite_url: str, tmp_path: Path) -> None:
    from tether.testing import PaymentService

    pay = PaymentService(latency=0.0)
    shop = Shop(pay)
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    async with tether.Supervisor(sqlite_url, keys=tether.KeyRing.ephemeral(),
                                 tools=shop.tools) as sup:
        async with reader(path, tmp_path):
            for i in range(ROUNDS):
                async with Journal(sqlite_url) as other:  # the console, a worker, a CLI
                    await other.delegations()
                await asyncio.sleep(0.01)  # the reader closes its connection meanwhile
                child = await sup.delegate(agent_paying(shop, i), tools=shop.tools)
                assert (await child.result()).startswith("re_")
        assert pay.applications == ROUNDS


async def test_cli_commands_in_process_beside_a_supervisor_keep_its_locks(
        sqlite_url: str, tmp_path: Path) -> None:
    """The CLI's commands run in a process that has the journal open (the console's process,
    a test, a notebook): each opens the journal itself."""
    from typer.testing import CliRunner

    from tether._cli.app import app
    from tether.testing import PaymentService

    pay = PaymentService(latency=0.0)
    shop = Shop(pay)
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    runner = CliRunner()
    async with tether.Supervisor(sqlite_url, keys=tether.KeyRing.ephemeral(),
                                 tools=shop.tools) as sup:
        first = await sup.delegate(agent_paying(shop, -1), tools=shop.tools)
        await first.result()
        commands = [["ls"], ["show", first.id], ["verify", first.id]]
        async with reader(path, tmp_path):
            for i in range(ROUNDS):
                result = await asyncio.to_thread(
                    runner.invoke, app, [*commands[i % 3], "--journal", sqlite_url])
                assert "was deleted" not in result.output, result.output
                await asyncio.sleep(0.01)
                child = await sup.delegate(agent_paying(shop, i), tools=shop.tools)
                await child.result()
        assert pay.applications == ROUNDS + 1


async def test_console_buttons_beside_another_reader_keep_the_consoles_locks(
        sqlite_url: str, tmp_path: Path) -> None:
    """The console holds the journal open; each Recall button press opens it again to sign
    and journal the intent."""
    from starlette.testclient import TestClient

    from tether._console.server import Console, build

    path = Path(sqlite_url.removeprefix("sqlite:///"))
    gate = asyncio.Event()

    async def waits(ctx: tether.Context) -> str:
        await gate.wait()
        return "done"

    async with tether.Supervisor(sqlite_url) as sup:  # keys beside the journal, as the CLI's
        children = [await sup.delegate(waits) for _ in range(ROUNDS)]
        token = "t" * 24
        with TestClient(build(Console(sqlite_url, None, token)),
                        base_url="http://127.0.0.1") as client:
            async with reader(path, tmp_path):
                for child in children:
                    pressed = await asyncio.to_thread(
                        client.post, f"/api/delegations/{child.id}/recall",
                        headers={"X-Tether-Token": token}, json={"grace": 5, "reason": "stop"})
                    assert pressed.status_code == 200, pressed.text
                    await asyncio.sleep(0.01)
                    listed = await asyncio.to_thread(
                        client.get, "/api/delegations", headers={"X-Tether-Token": token})
                    assert listed.status_code == 200, listed.text
        gate.set()
        for child in children:
            await child.wait()
            assert (await child.report()).outcome is tether.DelegationState.RECALLED


async def test_a_worker_and_a_supervisor_in_one_process_keep_each_others_locks(
        sqlite_url: str, tmp_path: Path) -> None:
    """An orchestrator that serves its queued work with a worker in its own process: each
    worker opens the journal again beside the supervisor's connection."""
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    keys = tether.KeyRing.ephemeral()

    @tether.agent()
    async def queued(ctx: tether.Context, n: int) -> int:
        return n * 2

    async with tether.Supervisor(sqlite_url, keys=keys) as sup, reader(path, tmp_path):
        for i in range(ROUNDS):
            child = await sup.delegate(queued, i, remote=True)
            async with tether.Worker(sqlite_url, [queued], keys=keys, poll=0.01) as worker:
                serving = asyncio.create_task(worker.run())
                assert await child.result() == i * 2
                worker.stop()
                await serving
