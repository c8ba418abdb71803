"""`tether mcp-proxy` ends with its client, however the client ends it: stdin closed and then
SIGTERM (what the TypeScript SDK's stdio client does), or a signal alone. Its upstreams, each in
a process group of its own, are gone by the time the proxy exits (none is left holding the
client's stderr), and the session's delegation is settled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tether
from tests.conftest import until
from tests.mcp_helpers import PYTHONPATH, ROOT
from tests.mcp_wire import WireClient, mark_upstream, marked


async def delegation_state(journal: str) -> tether.DelegationState:
    async with tether.Journal(journal, create=False) as j:
        (row,) = await j.delegations()
        return row.state


async def started(journal: str) -> tuple[WireClient, str]:
    """A session whose upstream (and the helper process it started) outlives its stdin."""
    spec, mark = mark_upstream("slow", sys.executable, "-m", "tests.mcp_lingering")
    client = await WireClient.start(journal, spec)
    await client.initialize()
    called = await client.request("tools/call", {"name": "hello", "arguments": {}})
    assert called["result"]["content"][0]["text"] == "hello"
    assert len(marked(mark)) == 2, "the upstream and its helper run"
    return client, mark


@pytest.mark.parametrize("eof", [True, False], ids=["eof-then-sigterm", "sigterm-alone"])
async def test_the_proxy_stops_its_upstream_and_settles_when_signalled(
        tmp_path: Path, eof: bool) -> None:
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    client, mark = await started(journal)
    try:
        if eof:  # the TypeScript SDK's close: stdin ended, SIGTERM while the proxy winds down
            client.close_stdin()
            await asyncio.sleep(0.5)  # the client's own delay, as it does it: not a wait
        client.proc.send_signal(signal.SIGTERM)
        await until(lambda: client.proc.returncode is not None, "the proxy exited")
        # At once: not after the upstream gave up on its own.
        assert marked(mark) == [], "the upstream outlived the proxy"
        assert client.proc.stderr is not None
        err = await asyncio.wait_for(client.proc.stderr.read(), 30)  # nobody holds it open
    finally:
        await client.aclose(mark)
    assert client.proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert "Traceback" not in err.decode()
    state = await delegation_state(journal)
    assert state.terminal, state
    if not eof:  # cut by the signal: terminated, its calls accounted for as on any stop
        assert state is tether.DelegationState.TERMINATED


async def test_the_proxy_stops_a_lingering_upstream_after_its_grace_on_eof(
        tmp_path: Path) -> None:
    """EOF alone: the upstream's stdin is closed, and an upstream still there after the grace
    is stopped with its helper (SIGTERM to its group), so the proxy exits by itself."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    client, mark = await started(journal)
    try:
        client.close_stdin()
        await until(lambda: client.proc.returncode is not None, "the proxy exited")
        assert marked(mark) == [], "the upstream outlived the proxy"
    finally:
        await client.aclose(mark)
    assert client.proc.returncode == 0
    assert await delegation_state(journal) is tether.DelegationState.SUCCEEDED


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("more", [False, True], ids=["one signal", "signals until it is gone"])
async def test_a_signal_while_the_proxy_starts_stops_its_upstreams(
        tmp_path: Path, more: bool, sig: signal.Signals) -> None:
    """The upstreams start before the proxy imports the MCP SDK (they boot meanwhile): a
    signal then, before any client spoke, stops them with the proxy, which exits 128 + signal
    with no traceback and no delegation. More signals (a supervisor's or a user's impatience,
    every 5 ms until it is gone) change nothing, wherever they land in its exit: the loop's
    close gave the signals back their default action, and one landing in the interpreter's
    teardown killed the proxy (-15) before, and a SIGINT there raised KeyboardInterrupt."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    spec, mark = mark_upstream("slow", sys.executable, "-m", "tests.mcp_lingering")
    client = await WireClient.start(journal, spec)
    sent = 1
    try:
        await until(lambda: len(marked(mark)) >= 1, "the upstream started")
        client.proc.send_signal(sig)
        while more:
            await asyncio.sleep(0.005)
            if client.proc.returncode is not None:
                break
            # Not ``send_signal``: its Popen would reap the exited proxy under asyncio's
            # watcher, which then reports 255. (Gone: reaped, its code not yet delivered.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(client.proc.pid, sig)
                sent += 1
        await until(lambda: client.proc.returncode is not None, "the proxy exited")
        assert marked(mark) == [], "the upstream outlived the proxy"
        assert client.proc.stderr is not None
        err = (await asyncio.wait_for(client.proc.stderr.read(), 30)).decode()
    finally:
        await client.aclose(mark)
    assert client.proc.returncode == 128 + sig, (client.proc.returncode, sent, err)
    assert "Traceback" not in err, err
    if (tmp_path / "journal.db").exists():
        async with tether.Journal(journal, create=False) as j:
            assert await j.delegations() == []


async def test_a_client_that_leaves_before_a_silent_upstream_answers_ends_the_proxy(
        tmp_path: Path) -> None:
    """The client's initialize waits for the upstream's, which never comes; the client closes
    stdin. The proxy stops connecting (nothing was journaled), stops the upstream and exits
    by itself, instead of waiting for an answer forever."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    spec, mark = mark_upstream("mute", sys.executable, "-c", "'import time; time.sleep(600)'")
    client = await WireClient.start(journal, spec)
    try:
        await until(lambda: len(marked(mark)) == 1, "the upstream started")
        asked = asyncio.ensure_future(client.request("initialize", {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "wire", "version": "1"}}))
        client.close_stdin()
        await until(lambda: client.proc.returncode is not None, "the proxy exited")
        assert client.proc.stderr is not None
        err = (await asyncio.wait_for(client.proc.stderr.read(), 30)).decode()
        assert marked(mark) == [], f"the upstream outlived the proxy: {err}"
    finally:
        await client.aclose(mark)
    assert client.proc.returncode == 0, err
    assert "Traceback" not in err, err
    if asked.done():  # answered, if at all, with an error: never a session
        assert "error" in asked.result()
    else:
        asked.cancel()
    if (tmp_path / "journal.db").exists():
        async with tether.Journal(journal, create=False) as j:
            assert await j.delegations() == []


@pytest.mark.parametrize("stdin", ["null", "file"])
async def test_a_proxy_whose_stdin_is_no_pipe_serves_it_and_ends_cleanly(
        tmp_path: Path, stdin: str) -> None:
    """Stdin from ``/dev/null`` or a file (the event loop cannot watch either): the SDK's own
    streams serve it, the session ends at its end, with no traceback."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "file", "version": "1"}}}) + "\n")
    source = Path(os.devnull) if stdin == "null" else requests
    done = await asyncio.to_thread(proxy_reading, source, f"sqlite:///{tmp_path / 'journal.db'}")
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "Traceback" not in err, err
    if stdin == "file":  # answered, the session started and ended
        assert json.loads(done.stdout.splitlines()[0])["result"]["serverInfo"]["name"] == "bank"
        async with tether.Journal(f"sqlite:///{tmp_path / 'journal.db'}", create=False) as j:
            (row,) = await j.delegations()
            assert row.state is tether.DelegationState.SUCCEEDED


def proxy_reading(source: Path, journal: str) -> subprocess.CompletedProcess[bytes]:
    with source.open("rb") as given:
        return subprocess.run(
            [sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal, "--upstream",
             f"bank={sys.executable} -m tests.mcp_bank"], stdin=given, capture_output=True,
            cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": PYTHONPATH}, check=False)
