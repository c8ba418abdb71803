"""Streamable HTTP both ways: `tether mcp-proxy --http 127.0.0.1:PORT` serves MCP at /mcp with
one delegation per MCP session, and an upstream can be a URL. A client that cancels a call
over HTTP has it cancelled upstream and reconciled; a retry with a new request id but the same
tether idempotency key in `_meta` replays the journaled outcome (I7). On any loopback address
the proxy refuses a request for a foreign host (DNS rebinding)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

import tether
from tests.conftest import until as conftest_until
from tests.mcp_helpers import PYTHONPATH, ROOT, connect, paid, text
from tests.mcp_wire import mark_upstream, marked
from tests.remote_agents import listen_gate
from tests.test_mcp_proxy import cli

A = tether.ActionState
KEY = "io.tether/idempotency-key"


def key_meta(key: str) -> Any:
    """A request's ``_meta`` carrying tether's idempotency key."""
    return {KEY: key}


@asynccontextmanager
async def serving(*args: str, ready: str) -> AsyncIterator[list[str]]:
    """A process run until it says ``ready`` on stderr; its stderr lines so far."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = await asyncio.create_subprocess_exec(*args, cwd=ROOT, env=env,
                                                stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[str] = []
    up = asyncio.Event()

    async def read() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            lines.append(raw.decode())
            if ready in lines[-1]:
                up.set()

    reader = asyncio.ensure_future(read())
    try:
        await asyncio.wait_for(up.wait(), 60)
        yield lines
    finally:
        proc.terminate()
        await proc.wait()
        reader.cancel()


@asynccontextmanager
async def proxy_http(journal: str, *extra: str,
                     upstream: str = f"bank={sys.executable} -m tests.mcp_bank",
                     ) -> AsyncIterator[str]:
    """The proxy on a port the system picks (it says which once it listens)."""
    async with serving(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--http", "127.0.0.1:0", "--upstream", upstream, *extra,
                       ready="serving MCP at") as lines:
        said = next(line for line in lines if "serving MCP at" in line)
        yield said.split("serving MCP at ")[1].split()[0]


@asynccontextmanager
async def http_client(url: str) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(url) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def reports(journal: str) -> list[tether.Report]:
    async with tether.Journal(journal, create=False) as j:
        from tether._runtime.reconcile import build_report

        return [await build_report(j, r.id) for r in await j.delegations()]


async def until(journal: str, done: object, within: float = 30.0) -> list[tether.Report]:
    give_up = time.monotonic() + within
    while True:
        found = await reports(journal)
        if (callable(done) and done(found)) or time.monotonic() > give_up:
            return found
        await asyncio.sleep(0.05)


async def test_each_http_session_is_a_delegation_and_a_retry_replays(
        bank_env: Path, tmp_path: Path) -> None:
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with proxy_http(journal) as url, http_client(url) as one, http_client(url) as two:
        names = {t.name for t in (await one.list_tools()).tools}
        first = await one.call_tool("pay", {"account": "R-1", "cents": 3},
                                    meta=key_meta("order-77"))
        # The stream broke before the answer, say: the client retries with a new
        # request id, the same key, on another session. The journal replays the outcome.
        again = await two.call_tool("pay", {"account": "R-1", "cents": 3},
                                    meta=key_meta("order-77"))
    assert {"pay", "balance"} <= names
    assert text(first) == text(again) == "paid 3 to R-1" and not again.is_error
    # Applied once, under the key in the client's namespace: what the upstream dedupes on.
    assert paid(bank_env, "R-1") == [("client:order-77", 3)]
    found = await reports(journal)
    assert len(found) == 2  # one delegation per MCP session
    assert [(a.tool, a.state, a.idempotency_key) for r in found for a in r.actions] == [
        ("bank.pay", A.COMPLETED, "client:order-77")]  # the client's own namespace


async def test_a_client_key_never_takes_over_another_sessions_automatic_key(
        bank_env: Path, tmp_path: Path) -> None:
    """Task ids are visible (`tether ls`), so another session's next automatic key can be
    guessed: a client that sends it in ``_meta`` must not make that session's genuine call
    replay and never run."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with proxy_http(journal) as url, http_client(url) as victim:
        await victim.list_tools()
        (mine,) = await until(journal, lambda rs: len(rs) == 1)
        async with http_client(url) as other:
            stolen = await other.call_tool("pay", {"account": "R-9", "cents": 5},
                                           meta=key_meta(f"{mine.task_id}:bank.pay:mcp0"))
        genuine = await victim.call_tool("pay", {"account": "R-9", "cents": 5})
    assert not stolen.is_error and not genuine.is_error
    # Both calls ran, in the journal and at the bank (which dedupes on the key it is sent).
    assert sorted(key for key, _ in paid(bank_env, "R-9")) == [
        f"client:{mine.task_id}:bank.pay:mcp0", f"{mine.task_id}:bank.pay:mcp0"]


async def test_a_call_cancelled_over_http_is_cancelled_upstream_and_reconciled(
        bank_env: Path, tmp_path: Path) -> None:
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with proxy_http(journal) as url, http_client(url) as session:
        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-7", "cents": 7}))
        await started
        call.cancel()
        assert await asyncio.wait_for(cancelled, 30) == "hold-7"
        found = await until(journal, lambda rs: rs and rs[0].actions
                            and rs[0].actions[0].evidence is not None)
    (action,) = found[0].actions
    assert action.state in (A.UNKNOWN, A.IN_DOUBT)  # never COMPLETED: it was cancelled
    assert paid(bank_env, "hold-7") == []


async def test_an_upstream_reached_by_url(bank_env: Path, tmp_path: Path) -> None:
    config = tmp_path / "mcp.json"
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with serving(sys.executable, "-m", "tests.mcp_bank", "--http", "0",
                       ready="Uvicorn running") as lines:
        said = next(line for line in lines if "Uvicorn running on " in line)
        base = said.split("Uvicorn running on ")[1].split()[0]
        config.write_text(json.dumps({"mcpServers": {
            "bank": {"url": f"{base}/mcp", "effects": {"pay": "EXTERNAL"}}}}))
        async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--config",
                           str(config), "--journal", journal) as session:
            result = await session.call_tool("pay", {"account": "U-1", "cents": 8})
    assert text(result) == "paid 8 to U-1"
    (report,) = await reports(journal)
    (action,) = report.actions
    assert (action.tool, action.state) == ("bank.pay", A.COMPLETED)
    assert paid(bank_env, "U-1") == [(action.idempotency_key, 8)]


async def test_http_listen_mistakes_are_one_line(tmp_path: Path) -> None:
    for spec, message in [("8765", "must be HOST:PORT"), ("0.0.0.0:8765", "loopback address only"),
                          ("127.0.0.1:99999", "must be HOST:PORT")]:
        code, _, err = await cli("mcp-proxy", "--http", spec, "--upstream", "x=y",
                                 "--journal", f"sqlite:///{tmp_path / 'j.db'}")
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    # A port in use: said before any upstream starts (uvicorn said it in its own words once
    # the upstreams had been probed, and exited 3).
    marker = tmp_path / "spawned"
    upstream = f"x={sys.executable} -c \"import pathlib; pathlib.Path({str(marker)!r}).touch()\""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, _, err = await cli("mcp-proxy", "--http", f"127.0.0.1:{port}", "--upstream",
                                 upstream, "--journal", f"sqlite:///{tmp_path / 'j.db'}")
    assert code == 2 and "cannot listen there" in err and len(err.splitlines()) == 1, err
    assert not marker.exists()


async def test_2026_clients_share_one_session_over_http(bank_env: Path, tmp_path: Path) -> None:
    """The 2026-07-28 protocol has no sessions: its requests share one client session of the
    proxy (one delegation, one set of upstream connections), not one per request."""
    from mcp import Client

    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with proxy_http(journal) as url, Client(url) as client:
        version = client.protocol_version
        for cents in (1, 2, 3):
            result = await client.call_tool("pay", {"account": "M-1", "cents": cents})
            assert not result.is_error, text(result)
    assert version == "2026-07-28"
    (report,) = await reports(journal)
    assert [a.state for a in report.actions] == [A.COMPLETED] * 3
    assert [c for _, c in paid(bank_env, "M-1")] == [1, 2, 3]


async def test_a_2026_client_that_drops_its_request_cancels_the_call(
        bank_env: Path, tmp_path: Path) -> None:
    """On the 2026-07-28 wire a client cancels by closing the request's stream: the proxy
    takes the disconnect as a cancellation, sends it upstream, and reconciles the call."""
    from mcp import Client

    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with proxy_http(journal) as url, Client(url) as client:
        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        call = asyncio.ensure_future(client.call_tool("pay", {"account": "hold-8", "cents": 8}))
        await started
        call.cancel()  # the SDK aborts the request's POST: no notification on this wire
        assert await asyncio.wait_for(cancelled, 30) == "hold-8"
        found = await until(journal, lambda rs: rs and rs[0].actions
                            and rs[0].actions[0].evidence is not None)
    (action,) = found[0].actions
    assert action.state in (A.UNKNOWN, A.IN_DOUBT)  # never COMPLETED: it was cancelled
    assert paid(bank_env, "hold-8") == []


async def test_mcp_http_on_any_loopback_address_refuses_a_foreign_host(
        bank_env: Path, tmp_path: Path) -> None:
    """DNS rebinding: a web page whose name resolves to the proxy's loopback address must not
    reach it. 127.0.0.2 is loopback (accepted by --http) like 127.0.0.1."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with serving(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--http", "127.0.0.2:0", "--upstream",
                       f"bank={sys.executable} -m tests.mcp_bank",
                       ready="serving MCP at") as lines:
        said = next(line for line in lines if "serving MCP at" in line)
        url = said.split("serving MCP at ")[1].split()[0]
        body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "page", "version": "1"}}}
        async with httpx2.AsyncClient() as web:
            answer = await web.post(url, json=body, headers={
                "Host": "rebound.example", "Origin": "http://rebound.example",
                "Accept": "application/json, text/event-stream"})
    assert answer.status_code in (421, 403), answer.status_code


async def test_the_http_proxy_does_not_import_what_tether_tools_names(
        tmp_path: Path, monkeypatch: Any) -> None:
    """$TETHER_TOOLS names the deployment's Python tools; the proxy's are its upstreams'. A
    deployment that sets it for all its processes (here, a module the proxy's environment
    cannot import) still has a proxy that serves."""
    monkeypatch.setenv("TETHER_TOOLS", "myapp_not_here.tools:ALL")
    args = (sys.executable, "-m", "tether", "mcp-proxy", "--journal",
            f"sqlite:///{tmp_path / 'j.db'}", "--http", "127.0.0.1:0", "--upstream",
            f"bank={sys.executable} -m tests.mcp_bank")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join((str(ROOT), os.environ.get("PYTHONPATH", "")))}
    proc = await asyncio.create_subprocess_exec(*args, cwd=ROOT, env=env,
                                                stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    said: list[str] = []
    try:
        async with asyncio.timeout(60):
            async for raw in proc.stderr:
                said.append(raw.decode())
                if "serving MCP at" in said[-1]:
                    break
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
    assert any("serving MCP at" in line for line in said), said


async def test_an_idle_http_session_expires_and_its_delegation_settles(
        bank_env: Path, tmp_path: Path) -> None:
    """A client that leaves without closing its session (no DELETE, as the Inspector CLI
    leaves): after --idle-timeout the session is closed, its delegation ends and its upstream
    process is stopped, while the proxy goes on serving."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    spec, mark = mark_upstream("bank", sys.executable, "-m", "tests.mcp_bank")
    async with proxy_http(journal, "--idle-timeout", "1", upstream=spec) as url:
        async with streamable_http_client(url, terminate_on_close=False) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            paid_now = await session.call_tool("pay", {"account": "I-1", "cents": 2})
        found = await until(journal, lambda r: r and all(x.outcome.terminal for x in r))
        await conftest_until(lambda: not marked(mark), "the idle session's upstream stopped")
    assert not paid_now.is_error
    assert [r.outcome for r in found] == [tether.DelegationState.SUCCEEDED]


async def test_a_bad_idle_timeout_is_one_line(tmp_path: Path) -> None:
    code, _, err = await cli("mcp-proxy", "--journal", f"sqlite:///{tmp_path / 'j.db'}",
                             "--http", "127.0.0.1:0", "--idle-timeout", "0",
                             "--upstream", "bank=x")
    assert code == 2 and err.startswith("error:") and "--idle-timeout" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "j.db").exists()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (the upstreams a proxy started, and theirs)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(entry.name)] = int(stat[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return {p for p in found if _alive(p)}


async def test_a_signal_while_the_http_proxy_probes_its_upstreams_stops_them_with_it(
        tmp_path: Path) -> None:
    """SIGTERM before the proxy listens (an upstream that never answers ``initialize``): the
    proxy stops its upstream and exits 128 + 15, with no traceback. It was killed by the
    signal's default action, and its upstream ran on."""
    marker = tmp_path / "upstream.pid"
    silent = (f"{sys.executable} -c \"import os, pathlib, time; "
              f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid())); time.sleep(60)\"")
    code, err = await _signalled_when(tmp_path, f"mute={silent}",
                                      lambda: marker.exists() and bool(marker.read_text()))
    upstream = int(marker.read_text())
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    give_up = time.monotonic() + 10
    while _alive(upstream):
        assert time.monotonic() < give_up, "the upstream outlived the proxy"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("signals", [1, 2])
async def test_a_signal_while_the_http_proxy_serves_stops_its_sessions_upstreams(
        bank_env: Path, tmp_path: Path, signals: int) -> None:
    """SIGTERM while a session is open (a second one soon after, too): the server stops, the
    session's upstream with it, the session's delegation is terminated (not ended as if its
    client had closed it), and the proxy exits 128 + 15 with nothing on stderr but its own
    lines. uvicorn re-raised the signal once it had shut down, which killed the proxy before
    it stopped its upstreams, and it waited for the client's open stream for as long as the
    client kept it."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
        "--http", "127.0.0.1:0", "--upstream", f"bank={sys.executable} -m tests.mcp_bank",
        cwd=ROOT, env=env, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        line = ""
        while "serving MCP at" not in line:
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, "the proxy ended before it served"
        url = line.split("serving MCP at ")[1].split()[0]
        async with http_client(url) as session:
            await session.list_tools()
            upstreams = _descendants(proc.pid)
            assert upstreams, "the session started no upstream"
            for _ in range(signals):
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.05)
            code = await asyncio.wait_for(proc.wait(), 30)
            rest = (await proc.stderr.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 128 + signal.SIGTERM
    assert "Traceback" not in rest and "ERROR" not in rest, rest
    (report,) = await reports(journal)
    assert report.outcome is tether.DelegationState.TERMINATED, report
    give_up = time.monotonic() + 10
    while any(_alive(p) for p in upstreams):
        assert time.monotonic() < give_up, "a session's upstream outlived the proxy"
        await asyncio.sleep(0.02)


async def test_a_signal_as_the_http_proxy_makes_its_server_exits_128_plus_it(
        bank_env: Path, tmp_path: Path) -> None:
    """SIGTERM after the upstreams were probed and before the server listens (the probe's
    upstream takes its time to exit): the proxy exits 128 + 15, never 0 as if it had ended
    of its own accord."""
    marker = tmp_path / "probed"
    lingering = tmp_path / "lingering.sh"
    lingering.write_text(f"#!/bin/sh\ntrap '' TERM\n{sys.executable} -m tests.mcp_bank\n"
                         f"echo done > {marker}\nexec sleep 30\n")
    lingering.chmod(0o755)
    # Its stdin closed once probed, it lingers: the proxy waits for it to exit, and is signalled.
    code, err = await _signalled_when(tmp_path, f"bank={lingering}", marker.exists)
    assert code == 128 + signal.SIGTERM, err
    assert "serving MCP at" not in err


async def _signalled_when(tmp_path: Path, upstream: str, ready: Callable[[], bool]
                          ) -> tuple[int, str]:
    """An --http proxy of ``upstream``, sent SIGTERM once ``ready()``: its exit code and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "mcp-proxy", "--journal",
        f"sqlite:///{tmp_path / 'journal.db'}", "--http", "127.0.0.1:0",
        "--upstream", upstream, cwd=ROOT, env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        give_up = time.monotonic() + 60
        while not ready():
            assert time.monotonic() < give_up and proc.returncode is None, "never ready"
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode()
