"""``tether mcp-proxy``: a stdio MCP server in front of one or more upstream MCP servers.

Any MCP client (any agent) talks to the proxy as to the upstream servers: the same tools, the
same schemas, the same results. Each client session is one tether delegation, so every call is
journaled with its key, fenced, and probed when in doubt; an operator recalls or terminates
the session with ``tether recall`` / ``tether terminate`` from another shell, and the client
then gets an error result for each new call instead of an action nobody accounted for.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from tether._core.errors import ControlSignal, UserError
from tether._integrations.mcp_gateway import McpToolError, ServerPolicy, wrap_tools
from tether._journal.journal import Journal
from tether._runtime.gateway import Context
from tether._runtime.logs import logger
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent, Tool


def parse_upstream(spec: str) -> tuple[str, list[str]]:
    """``name=command arg ...`` (shell quoting) into the name and the command line."""
    name, sep, command = spec.partition("=")
    try:
        argv = shlex.split(command) if sep else []
    except ValueError as exc:  # an unbalanced quote, say
        raise UserError(f"--upstream {spec!r}: {exc}") from None
    if not sep or not name or not argv:
        raise UserError(f"--upstream {spec!r} must be NAME=COMMAND, e.g. "
                        "git='mcp-server-git --repository .'")
    ServerPolicy(name)  # validates the name
    return name, argv


def error_result(text: str) -> mcp_types.CallToolResult:
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)],
                                    is_error=True)


class Proxy:
    """The upstream sessions, the tools they offer, and the delegation that journals them."""

    def __init__(self, upstreams: Mapping[str, list[str]],
                 policies: Mapping[str, ServerPolicy]) -> None:
        unknown = sorted(set(policies) - set(upstreams))
        if unknown:
            raise UserError(f"the MCP policy names servers with no --upstream: "
                            f"{', '.join(unknown)}")
        if not upstreams:
            raise UserError("give at least one --upstream NAME=COMMAND")
        self.upstreams = dict(upstreams)
        self.policies = {n: policies.get(n, ServerPolicy(n)) for n in upstreams}
        self.exposed: dict[str, tuple[Tool, mcp_types.Tool]] = {}
        self.ctx: Context | None = None
        self.journal: Journal | None = None
        self.closed = asyncio.Event()  # the client ended its session

    async def connect(self, stack: AsyncExitStack) -> None:
        for name, argv in self.upstreams.items():
            params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
            try:
                read, write = await stack.enter_async_context(stdio_client(params))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
            except OSError as exc:
                raise UserError(f"cannot start upstream {name} ({argv[0]}): {exc}") from None
            for tool, spec in await wrap_tools(session, self.policies[name], raw=True):
                if spec.name in self.exposed:
                    raise UserError(f"two upstream servers offer a tool named {spec.name!r}")
                self.exposed[spec.name] = (tool, spec)

    async def session_agent(self, ctx: Context) -> None:
        """The delegation's body: it lives as long as the client session."""
        self.ctx = ctx
        await self.closed.wait()

    async def list_tools(self, _: Any, __: Any) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(tools=[spec for _, spec in self.exposed.values()])

    async def call_tool(self, _: Any,
                        params: mcp_types.CallToolRequestParams) -> mcp_types.CallToolResult:
        answer = await self._call(params)
        # The client acts on what it is told, so the journal holds the call's outcome before
        # the client hears it: what a client saw paid is never left for a probe to find.
        assert self.journal is not None
        await self.journal.flush()
        return answer

    async def _call(self, params: mcp_types.CallToolRequestParams) -> mcp_types.CallToolResult:
        found = self.exposed.get(params.name)
        if found is None:
            return error_result(f"unknown tool {params.name!r}")
        assert self.ctx is not None
        try:
            raw = await self.ctx.call(found[0], **(params.arguments or {}))
        except ControlSignal as signal:  # recalled or terminated: no new work
            return error_result(f"tether: this session was stopped ({type(signal).__name__}: "
                                f"{signal}); the call was not made")
        except asyncio.CancelledError:
            try:  # a terminate cut the call: say so, and leave the outcome to reconciliation
                self.ctx.check()
            except ControlSignal as signal:
                return error_result(f"tether: this session was terminated ({signal}); the "
                                    "call's outcome is in doubt and is being reconciled")
            raise
        except (McpToolError, UserError) as exc:
            return error_result(str(exc))
        if isinstance(raw, dict):  # the upstream's own result, as journaled
            return mcp_types.CallToolResult.model_validate(raw)
        return error_result("tether: this call replayed a result it cannot return")


async def serve(journal: str, upstreams: Mapping[str, list[str]],
                policies: Mapping[str, ServerPolicy]) -> None:
    proxy = Proxy(upstreams, policies)
    async with AsyncExitStack() as stack:
        await proxy.connect(stack)
        sup = await stack.enter_async_context(Supervisor(journal))
        proxy.journal = sup.journal
        tools = tuple(tool for tool, _ in proxy.exposed.values())
        handle = await sup.delegate(Agent("mcp-proxy", proxy.session_agent, tools))
        # stdout is the MCP channel: tell the operator on stderr how to reach this session.
        logger("proxy").info("session started as delegation %s", handle.id,
                             extra={"delegation": handle.id, "upstreams": sorted(upstreams)})
        print(f"tether mcp-proxy: delegation {handle.id}; stop it with "
              f"`tether recall {handle.id} --grace SECONDS`", file=sys.stderr, flush=True)
        server: Server[Any] = Server("tether-mcp-proxy", on_list_tools=proxy.list_tools,
                                     on_call_tool=proxy.call_tool)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        proxy.closed.set()  # a session that ended normally ends its delegation normally
        await handle.wait()
