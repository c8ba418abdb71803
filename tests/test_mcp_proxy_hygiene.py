"""`tether mcp-proxy` shows a client what a direct connection to the upstream shows, with the
protocol's reference server from npm: the tools it offers by what the client can do, its
`serverInfo`, and the notifications it sends at startup."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as t
import pytest
from mcp import ClientSession

import tether
from tests.mcp_helpers import connect
from tests.test_mcp_proxy_passthrough import LIBRARY, Client, everything_server


@asynccontextmanager
async def everything(journal: str | None, **callbacks: Any) -> AsyncIterator[ClientSession]:
    """The everything server, directly (no journal) or through the proxy."""
    server = everything_server()
    if journal is None:
        async with connect(server, "stdio", **callbacks) as session:
            yield session
        return
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--upstream", f"everything={server} stdio", **callbacks) as session:
        yield session


def capable() -> dict[str, Any]:
    client = Client()
    return {"sampling_callback": client.sampling, "elicitation_callback": client.elicitation,
            "list_roots_callback": client.roots}


@pytest.mark.parametrize("callbacks", [{}, capable()], ids=["declares-nothing", "declares-all"])
async def test_the_client_sees_the_tools_offered_to_what_it_declared(
        tmp_path: Path, callbacks: dict[str, Any]) -> None:
    """The server adds tools for sampling, elicitation and roots only for a client that
    declared them: the proxy's upstream session declares what its client declared."""
    async with everything(None, **callbacks) as direct:
        expected = sorted(tool.name for tool in (await direct.list_tools()).tools)
    async with everything(f"sqlite:///{tmp_path / 'j.db'}", **callbacks) as proxied:
        got = sorted(tool.name for tool in (await proxied.list_tools()).tools)
    assert got == expected
    assert ("trigger-sampling-request" in got) == bool(callbacks)


async def test_server_info_is_the_upstreams(tmp_path: Path) -> None:
    async with everything(None) as direct:
        expected = direct.initialize_result
    async with everything(f"sqlite:///{tmp_path / 'j.db'}") as proxied:
        got = proxied.initialize_result
    assert expected is not None and got is not None
    assert got.server_info == expected.server_info
    assert expected.server_info.version  # what was "" through the proxy


async def test_server_info_of_several_upstreams_is_the_proxys(tmp_path: Path) -> None:
    library = " ".join(LIBRARY)
    async with connect(sys.executable, "-m", "tether", "mcp-proxy",
                       "--journal", f"sqlite:///{tmp_path / 'j.db'}",
                       "--upstream", f"everything={everything_server()} stdio",
                       "--upstream", f"library={library}") as proxied:
        got = proxied.initialize_result
    assert got is not None
    assert (got.server_info.name, got.server_info.version) == (
        "tether-mcp-proxy (everything, library)", tether.__version__)


async def test_the_startup_tools_list_changed_reaches_the_client(tmp_path: Path) -> None:
    """The server registers tools once its client is initialized and says so: over a direct
    connection the client hears it; it was dropped by the proxy, its client not yet there."""
    for journal in (None, f"sqlite:///{tmp_path / 'j.db'}"):
        changed = asyncio.Event()

        async def on_message(message: Any, changed: asyncio.Event = changed) -> None:
            if isinstance(message, t.ToolListChangedNotification):
                changed.set()

        async with everything(journal, message_handler=on_message):
            await asyncio.wait_for(changed.wait(), 30)


async def test_an_http_session_declares_its_clients_capabilities(tmp_path: Path) -> None:
    from tests.test_mcp_proxy_http import http_client, proxy_http

    async with everything(None) as direct:
        expected = sorted(tool.name for tool in (await direct.list_tools()).tools)
    async with proxy_http(f"sqlite:///{tmp_path / 'j.db'}",
                          upstream=f"everything={everything_server()} stdio") as url, \
            http_client(url) as proxied:
        got = sorted(tool.name for tool in (await proxied.list_tools()).tools)
    assert got == expected  # the client declared nothing, as `everything(None)` did
