"""`tether mcp-proxy` carries the whole protocol, not just tools: resources, templates,
prompts, completions, instructions, logging and list changes reach the client as the upstream
sent them, and an upstream's sampling, elicitation and roots requests are asked of the real
client. Only tools/call is a journaled action."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mcp_types as t
from mcp import ClientSession

from tests.mcp_helpers import PYTHONPATH, ROOT, connect, text
from tests.test_mcp_proxy import session_delegation


@dataclass
class Client:
    """What a client saw of the server's requests and notifications."""

    logs: list[Any] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    logged: asyncio.Event = field(default_factory=asyncio.Event)

    async def sampling(self, context: Any, params: t.CreateMessageRequestParams) -> Any:
        return t.CreateMessageResult(role="assistant", model="test-model",
                                     content=t.TextContent(type="text", text="hello"))

    async def elicitation(self, context: Any, params: t.ElicitRequestParams) -> Any:
        return t.ElicitResult(action="accept", content={"name": "Ada"})

    async def roots(self, context: Any) -> Any:
        return t.ListRootsResult(roots=[t.Root.model_validate({"uri": "file:///tmp/shelf"})])

    async def logging(self, params: t.LoggingMessageNotificationParams) -> None:
        self.logs.append(params.data)
        self.logged.set()

    async def message(self, message: Any) -> None:
        if isinstance(message, t.ToolListChangedNotification):
            self.changed.set()

    def callbacks(self) -> dict[str, Any]:
        return {"sampling_callback": self.sampling, "elicitation_callback": self.elicitation,
                "list_roots_callback": self.roots, "logging_callback": self.logging,
                "message_handler": self.message}


LIBRARY = (sys.executable, "-m", "tests.mcp_library")


@asynccontextmanager
async def library(client: Client, journal: str | None) -> AsyncIterator[ClientSession]:
    if journal is None:
        async with connect(*LIBRARY, **client.callbacks()) as session:
            yield session
        return
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--upstream", f"library={' '.join(LIBRARY)}",
                       **client.callbacks()) as session:
        yield session


async def everything_seen(session: ClientSession, client: Client) -> dict[str, Any]:
    """All that a client can see of the library server, as plain data."""
    seen: dict[str, Any] = {"instructions": session.instructions}
    seen["resources"] = (await session.list_resources()).resources
    seen["templates"] = (await session.list_resource_templates()).resource_templates
    seen["catalog"] = (await session.read_resource("library://catalog")).contents
    seen["book"] = (await session.read_resource("library://books/dune")).contents
    seen["prompts"] = (await session.list_prompts()).prompts
    seen["prompt"] = (await session.get_prompt("review", {"slug": "dune"})).messages
    seen["completion"] = (await session.complete(
        t.PromptReference(type="ref/prompt", name="review"),
        {"name": "slug", "value": "d"})).completion
    seen["ask"] = text(await session.call_tool("ask", {}))
    seen["shout"] = text(await session.call_tool("shout", {"words": "hi"}))
    await asyncio.wait_for(client.changed.wait(), 30)
    await asyncio.wait_for(client.logged.wait(), 30)
    seen["logs"] = list(client.logs)
    # The tools list changed (the proxy listed them again): the tools still work.
    seen["again"] = text(await session.call_tool("shout", {"words": "again"}))
    return seen


async def test_the_whole_protocol_passes_through_the_proxy(tmp_path: Path) -> None:
    direct, proxied = Client(), Client()
    async with library(direct, None) as session:
        expected = await everything_seen(session, direct)
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with library(proxied, journal) as session:
        got = await everything_seen(session, proxied)
        report = await session_delegation(journal)
    assert got == expected
    assert got["ask"] == "hello|Ada|file:///tmp/shelf"  # the real client answered
    assert got["logs"] == ["shouting hi"] and got["completion"].values == ["dune"]
    # Reads of resources and prompts are not actions; the tool calls are.
    assert [a.tool for a in report.actions] == ["library.ask", "library.shout", "library.shout"]


EVERYTHING = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "mcp-server-everything"


def everything_server() -> str:
    assert EVERYTHING.exists(), (
        "the reference 'everything' MCP server is installed by scripts/test "
        "(npm ci in .ci/node)")
    return str(EVERYTHING)


async def everything_view(session: ClientSession) -> dict[str, Any]:
    ticks: list[tuple[float, float | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        ticks.append((progress, total))

    seen: dict[str, Any] = {"instructions": session.instructions}
    seen["resources"] = await session.list_resources()
    seen["templates"] = await session.list_resource_templates()
    seen["read"] = await session.read_resource(seen["resources"].resources[0].uri)
    seen["prompts"] = await session.list_prompts()
    seen["prompt"] = await session.get_prompt("args-prompt", {"city": "Paris"})
    seen["completion"] = await session.complete(
        t.PromptReference(type="ref/prompt", name="completable-prompt"),
        {"name": "department", "value": "E"})
    done = await session.call_tool("trigger-long-running-operation",
                                   {"duration": 0.3, "steps": 3},
                                   progress_callback=on_progress)
    seen["progress"] = (text(done), ticks)
    return seen


async def test_the_everything_server_through_the_proxy(tmp_path: Path) -> None:
    """The protocol's reference server, from the npm registry: resources, prompts,
    completions, progress and resource subscriptions, as a direct client sees them."""
    server = everything_server()
    async with connect(server, "stdio") as session:
        expected = await everything_view(session)
    updated = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, t.ResourceUpdatedNotification):
            updated.set()

    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--upstream", f"everything={server} stdio",
                       message_handler=on_message) as session:
        got = await everything_view(session)
        uri = got["resources"].resources[0].uri
        await session.send_request(  # resources/subscribe, as a 2025-era client sends it
            t.SubscribeRequest(params=t.SubscribeRequestParams(uri=uri)), t.EmptyResult)
        await session.call_tool("toggle-subscriber-updates", {})
        await asyncio.wait_for(updated.wait(), 30)  # the server's update reached the client
    assert got == expected
    assert len(got["progress"][1]) == 3  # every progress notification reached the client


async def test_a_2026_client_through_the_stdio_proxy(tmp_path: Path) -> None:
    """`mcp.Client` negotiates the 2026-07-28 protocol with the proxy while the upstream speaks
    the handshake era: each hop has its own envelope, results get the fields the newer era
    requires."""
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    params = StdioServerParameters(command=sys.executable, env={"PYTHONPATH": PYTHONPATH},
                                   args=["-m", "tether", "mcp-proxy", "--journal", journal,
                                         "--upstream", f"library={' '.join(LIBRARY)}"])
    async with Client(params) as client:
        version = client.protocol_version
        first = await client.call_tool("shout", {"words": "hey"})
        second = await client.call_tool("shout", {"words": "again"})
        resources = await client.list_resources()
        report = await session_delegation(journal)
    assert version == "2026-07-28"
    assert (text(first), text(second)) == ("HEY", "AGAIN")
    assert [r.uri for r in resources.resources] == ["library://catalog"]
    assert [a.tool for a in report.actions] == ["library.shout", "library.shout"]
