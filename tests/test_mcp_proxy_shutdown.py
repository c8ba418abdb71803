"""`tether mcp-proxy` ends with its client, however the client ends it: stdin closed and then
SIGTERM (what the TypeScript SDK's stdio client does), or a signal alone. Its upstreams, each in
a process group of its own, are gone by the time the proxy exits (none is left holding the
client's stderr), and the session's delegation is settled."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

import tether
from tests.conftest import until
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


async def test_a_signal_while_the_proxy_starts_stops_its_upstreams(tmp_path: Path) -> None:
    """The upstreams start before the proxy imports the MCP SDK (they boot meanwhile): a
    signal then, before any client spoke, stops them with the proxy, which exits 128 + signal
    with no traceback and no delegation."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    spec, mark = mark_upstream("slow", sys.executable, "-m", "tests.mcp_lingering")
    client = await WireClient.start(journal, spec)
    try:
        await until(lambda: len(marked(mark)) >= 1, "the upstream started")
        client.proc.send_signal(signal.SIGTERM)
        await until(lambda: client.proc.returncode is not None, "the proxy exited")
        assert marked(mark) == [], "the upstream outlived the proxy"
        assert client.proc.stderr is not None
        err = (await asyncio.wait_for(client.proc.stderr.read(), 30)).decode()
    finally:
        await client.aclose(mark)
    assert client.proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    if (tmp_path / "journal.db").exists():
        async with tether.Journal(journal, create=False) as j:
            assert await j.delegations() == []
