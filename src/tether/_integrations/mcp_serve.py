"""Running ``tether mcp-proxy``: connecting its upstreams, starting the session's delegation,
and serving the client over stdio."""

from __future__ import annotations

import os
import sys
from contextlib import AsyncExitStack

from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.server.stdio import stdio_server

from tether._core.errors import UserError
from tether._integrations.mcp_proxy import Proxy
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent


async def connect_upstreams(proxy: Proxy, stack: AsyncExitStack) -> None:
    for name, argv in proxy.commands.items():
        params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
        try:
            read, write = await stack.enter_async_context(stdio_client(params))
            session = await stack.enter_async_context(proxy.session_for(read, write))
            await session.initialize()
        except OSError as exc:
            raise UserError(f"cannot start upstream {name} ({argv[0]}): {exc}") from None
        await proxy.add_upstream(name, session)


async def serve_stdio(journal: str, proxy: Proxy) -> None:
    async with AsyncExitStack() as stack:
        await connect_upstreams(proxy, stack)
        sup = await stack.enter_async_context(Supervisor(journal))
        proxy.sup = sup
        handle = await sup.delegate(Agent(proxy.name, proxy.session_agent, proxy.tools()))
        # stdout is the MCP channel: tell the operator on stderr how to reach this session.
        print(f"tether mcp-proxy: delegation {handle.id}; stop it with "
              f"`tether recall {handle.id} --grace SECONDS`", file=sys.stderr, flush=True)
        server = proxy.server()
        options = server.create_initialization_options(proxy.notification_options())
        async with stdio_server() as (read, write):
            await server.run(read, write, options)
        proxy.closed.set()  # a session that ended normally ends its delegation normally
        await proxy.settle_background()
        await handle.wait()
