"""Running ``tether mcp-proxy``: connecting its upstreams, starting the session's delegation,
and serving the client over stdio."""

from __future__ import annotations

import os
import sys
from contextlib import AsyncExitStack
from typing import Any

from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from tether._core.errors import TetherError, UserError
from tether._integrations.mcp_config import ProxyConfig, UpstreamSpec
from tether._integrations.mcp_proxy import Proxy
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent


def default_journal() -> str:
    """Per user, never relative to wherever the MCP host starts the proxy: the XDG state
    directory (``$XDG_STATE_HOME``, else ``~/.local/state``), ``tether/journal.db``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".local", "state")
    return f"sqlite:///{os.path.abspath(os.path.join(state, 'tether', 'journal.db'))}"


def first_error(exc: BaseException) -> BaseException:
    """The error that matters inside the exception groups of the SDK's task groups: a tether
    error if there is one, else the first leaf."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [first_error(e) for e in exc.exceptions]
        return next((e for e in leaves if isinstance(e, TetherError)), leaves[0])
    return exc


async def open_upstream(spec: UpstreamSpec, stack: AsyncExitStack) -> tuple[Any, Any]:
    if spec.url is not None:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        client = await stack.enter_async_context(
            httpx2.AsyncClient(headers=dict(spec.headers)))
        streams = await stack.enter_async_context(
            streamable_http_client(spec.url, http_client=client))
        return streams[0], streams[1]
    env = dict(os.environ) if spec.env is None else {**get_default_environment(), **spec.env}
    params = StdioServerParameters(command=spec.command[0], args=list(spec.command[1:]),
                                   env=env, cwd=spec.cwd)
    return await stack.enter_async_context(stdio_client(params))


async def connect_upstreams(proxy: Proxy, stack: AsyncExitStack) -> None:
    for name, spec in proxy.specs.items():
        what = spec.url or spec.command[0]
        try:
            read, write = await open_upstream(spec, stack)
            session = await stack.enter_async_context(proxy.session_for(read, write))
            await session.initialize()
            await proxy.add_upstream(name, session)
        except TetherError:
            raise
        except (OSError, MCPError) as exc:
            raise UserError(f"cannot start upstream {name} ({what}): {exc}") from None
        except BaseExceptionGroup as group:
            cause = first_error(group)
            if isinstance(cause, TetherError):
                raise cause from None
            raise UserError(f"cannot start upstream {name} ({what}): {cause}") from None


async def serve_stdio(journal: str, config: ProxyConfig) -> None:
    proxy = Proxy(config)
    try:
        async with AsyncExitStack() as stack:
            await connect_upstreams(proxy, stack)
            await _serve(journal, proxy, stack)
    except BaseExceptionGroup as group:  # an upstream that failed, inside the SDK's groups
        cause = first_error(group)
        if isinstance(cause, TetherError):
            raise cause from None
        raise UserError(f"an upstream MCP server failed: {cause!r}") from None


async def _serve(journal: str, proxy: Proxy, stack: AsyncExitStack) -> None:
    sup = await stack.enter_async_context(Supervisor(journal))
    proxy.sup = sup
    handle = await sup.delegate(Agent(proxy.name, proxy.session_agent, proxy.tools()))
    # stdout is the MCP channel: tell the operator on stderr how to reach this session.
    print(f"tether mcp-proxy: delegation {handle.id}; stop it with "
          f"`tether recall {handle.id} --grace SECONDS --journal {journal}`",
          file=sys.stderr, flush=True)
    server = proxy.server()
    options = server.create_initialization_options(proxy.notification_options())
    async with stdio_server() as (read, write):
        await server.run(read, write, options)
    proxy.closed.set()  # a session that ended normally ends its delegation normally
    await proxy.settle_background()
    await handle.wait()
