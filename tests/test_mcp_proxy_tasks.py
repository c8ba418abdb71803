"""MCP tasks as a probe: an upstream with the tasks extension (tests.mcp_tasks_bank, built with the
SDK) answers a call through `tether mcp-proxy` with a task; the proxy journals the task id and
reads the outcome with `tasks/get`, also after a cut: a proxy that died waiting is settled by
the next one on the journal, and a call its client cancelled is settled by what became of the
task it was cancelled as (I3, I8)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

import tether
from tests.mcp_helpers import PYTHONPATH, ROOT, connect, paid, text
from tests.remote_agents import listen_gate, open_gate
from tests.test_mcp_proxy_http import reports, serving, until

A = tether.ActionState


@asynccontextmanager
async def tasks_bank() -> AsyncIterator[str]:
    """The tasks bank over Streamable HTTP (it outlives a proxy that dies): its URL."""
    async with serving(sys.executable, "-m", "tests.mcp_tasks_bank", "0",
                       ready="Uvicorn running") as lines:
        said = next(line for line in lines if "Uvicorn running on " in line)
        yield said.split("Uvicorn running on ")[1].split()[0] + "/mcp"


def config(tmp_path: Path, url: str, **extra: Any) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"bank": {
        "url": url, "tasks": True, "effects": {"pay": "EXTERNAL"}, **extra}}}))
    return path


def proxy(path: Path, journal: str) -> AbstractAsyncContextManager[ClientSession]:
    return connect(sys.executable, "-m", "tether", "mcp-proxy", "--config", str(path),
                   "--journal", journal)


async def eventually(check: Callable[[], Awaitable[Any]], within: float = 30.0) -> None:
    """Until ``check()`` is truthy; a failure (not a hang) after ``within`` seconds."""
    give_up = time.monotonic() + within
    while not await check():
        assert time.monotonic() < give_up, "gave up waiting"
        await asyncio.sleep(0.02)


async def task_events(journal: str) -> list[dict[str, Any]]:
    async with tether.Journal(journal, create=False) as j:
        ids = [r.id for r in await j.delegations()]
        return [e.detail for e in await j.events(ids) if e.kind == "mcp_task"]


async def test_a_task_augmented_call_answers_as_an_ordinary_call(
        bank_env: Path, journal_url: str, tmp_path: Path) -> None:
    async with tasks_bank() as url, proxy(config(tmp_path, url), journal_url) as session:
        result = await session.call_tool("pay", {"account": "T-1", "cents": 4})
    assert not result.is_error and text(result) == "paid 4 to T-1"
    (report,) = await reports(journal_url)
    (action,) = report.actions
    assert action.state is A.COMPLETED
    assert paid(bank_env, "T-1") == [(action.idempotency_key, 4)]
    # The call became a task upstream, and the journal holds which, with the call's key.
    (event,) = await task_events(journal_url)
    assert event["key"] == action.idempotency_key and event["upstream"] == "bank"


async def test_a_task_the_proxy_died_waiting_on_is_settled_by_the_next_proxy(
        bank_env: Path, journal_url: str, tmp_path: Path) -> None:
    """The cut: the proxy is killed while the task runs upstream. The task completes after;
    the next proxy on the journal recovers the dead session and asks `tasks/get`."""
    async with tasks_bank() as url:
        path = config(tmp_path, url)
        started = await listen_gate("started")
        async with proxy(path, journal_url) as session:
            call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-1",
                                                                   "cents": 9}))
            await started
            # The task id is journaled before the proxy waits on the task.
            await eventually(lambda: task_events(journal_url))
            async with tether.Journal(journal_url, create=False) as j:
                (owner,) = [o for o in await j.owners() if o.pid != os.getpid()]
            os.kill(owner.pid, signal.SIGKILL)
            with pytest.raises(MCPError, match="Connection closed"):
                await call
        open_gate("release")  # the task completes upstream, with nobody waiting on it

        async def applied() -> bool:
            return bool(paid(bank_env, "hold-1"))

        await eventually(applied)
        (before,) = await reports(journal_url)
        async with proxy(path, journal_url) as again:  # recovers the dead session first
            await again.list_tools()
    assert [a.state for a in before.actions] == [A.PENDING]
    dead = next(r for r in await reports(journal_url) if r.delegation_id == before.delegation_id)
    (action,) = dead.actions
    assert action.state is A.COMPLETED, action.evidence
    assert action.result["content"] == [{"type": "text", "text": "paid 9 to hold-1"}]
    assert action.evidence is not None and action.evidence["status"] == "completed"
    assert paid(bank_env, "hold-1") == [(action.idempotency_key, 9)]


@asynccontextmanager
async def http_proxy(path: Path, journal: str) -> AsyncIterator[tuple[str, Any]]:
    """`tether mcp-proxy --http` on a free port: its URL, and its process (to kill)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "mcp-proxy", "--config", str(path), "--journal",
        journal, "--http", "127.0.0.1:0", cwd=ROOT, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert proc.stderr is not None
    url: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode()
            if "serving MCP at " in line and not url.done():
                url.set_result(line.split("serving MCP at ")[1].split()[0])

    reader = asyncio.ensure_future(read())
    try:
        yield await asyncio.wait_for(url, 60), proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        reader.cancel()


async def test_an_http_proxy_that_died_is_settled_by_the_next_one(
        bank_env: Path, journal_url: str, tmp_path: Path) -> None:
    """As above, for `tether mcp-proxy --http`: its recovery, before it serves, asks the
    upstream about the task the dead proxy's call became."""
    async with tasks_bank() as url:
        path = config(tmp_path, url)
        started = await listen_gate("started")
        async with http_proxy(path, journal_url) as (at, proc), \
                streamable_http_client(at) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            call = asyncio.ensure_future(session.call_tool(
                "pay", {"account": "hold-3", "cents": 7}))
            await started
            await eventually(lambda: task_events(journal_url))
            proc.kill()  # the cut
            await proc.wait()
            await asyncio.wait({call}, timeout=30)
            assert call.done()
            call.cancel()
        open_gate("release")

        async def applied() -> bool:
            return bool(paid(bank_env, "hold-3"))

        await eventually(applied)
        (before,) = await reports(journal_url)
        async with http_proxy(path, journal_url):  # serving: its recovery is done
            pass
    assert [a.state for a in before.actions] == [A.PENDING]
    dead = next(r for r in await reports(journal_url) if r.delegation_id == before.delegation_id)
    (action,) = dead.actions
    assert action.state is A.COMPLETED, action.evidence
    assert action.result["content"] == [{"type": "text", "text": "paid 7 to hold-3"}]


@pytest.mark.parametrize("probed", [False, True])
async def test_a_cancelled_call_is_settled_by_its_cancelled_task(
        bank_env: Path, journal_url: str, tmp_path: Path, probed: bool) -> None:
    """The client cancels while the task runs: the proxy sends `tasks/cancel`, and the probe
    finds the task cancelled, so it can no longer apply. Whether it applied before is the
    operator's probe's to say; its "not applied" is then final at once. Without one: UNKNOWN."""
    probes = {"probes": {"pay": "tests.mcp_probes:bank_pay"}} if probed else {}
    async with tasks_bank() as url, \
            proxy(config(tmp_path, url, **probes), journal_url) as session:
        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-2", "cents": 5}))
        await started
        call.cancel()
        assert await asyncio.wait_for(cancelled, 30) == "hold-2"  # tasks/cancel reached it
        found = await until(journal_url, lambda rs: rs and rs[0].actions
                            and "status" in (rs[0].actions[0].evidence or {}))
    (action,) = found[0].actions
    assert action.evidence is not None and action.evidence["status"] == "cancelled"
    # NOT_APPLIED before the 30 s dispatch deadline: final because the task is over.
    assert action.state is (A.NOT_APPLIED if probed else A.UNKNOWN), action.evidence
    assert paid(bank_env, "hold-2") == []
