"""An MCP server (the SDK's server API, over stdio) whose tool, once the test lets it go, logs
and asks its client for sampling, each naming the call it belongs to: which client receives
them tells whether a proxy keeps its clients apart. ``tagged(tag)`` waits on the named pipes
``started-TAG`` / ``release-TAG`` in TETHER_TEST_GATES. ``stubborn(tag)`` does the same, but
goes on after its client cancels the call (cancellation is advisory), saying ``cancelled-TAG``
when told and ``done-TAG`` once it has logged and asked."""

from __future__ import annotations

import asyncio
import os
import sys
import warnings

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import SamplingMessage, TextContent, ToolAnnotations

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.remote_agents import listen_gate, open_gate

warnings.simplefilter("ignore")  # sampling and logging are deprecated at 2026-07-28
server = MCPServer("chatty")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def tagged(tag: str, ctx: Context) -> str:
    return await chat(tag, ctx)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def stubborn(tag: str, ctx: Context) -> str:
    job = asyncio.ensure_future(chat(tag, ctx))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        open_gate(f"cancelled-{tag}", tag)
        job.add_done_callback(lambda _: open_gate(f"done-{tag}", tag))
        raise


async def chat(tag: str, ctx: Context) -> str:
    release = await listen_gate(f"release-{tag}")
    open_gate(f"started-{tag}", tag)
    await release
    await ctx.info(f"log for {tag}")
    try:
        sampled = await ctx.request_context.session.create_message(
            [SamplingMessage(role="user", content=TextContent(type="text",
                                                              text=f"sample for {tag}"))],
            max_tokens=5, related_request_id=ctx.request_id)
    except MCPError as exc:
        return f"{tag}: sampling refused: {exc.error.message}"
    said = sampled.content.text if isinstance(sampled.content, TextContent) else "?"
    return f"{tag}: {said}"


if __name__ == "__main__":
    server.run()
