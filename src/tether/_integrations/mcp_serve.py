"""Running ``tether mcp-proxy``: connecting its upstreams, the MCP server its client sees,
starting the session's delegation, and serving the client over stdio."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from mcp import types as mcp_types
from mcp.client.stdio import get_default_environment
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.methods import CACHEABLE_METHODS
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from tether._core.errors import TetherError, UserError
from tether._integrations.mcp_config import ProxyConfig, UpstreamSpec
from tether._integrations.mcp_process import Children, Stopper, stdio_upstream
from tether._integrations.mcp_proxy import Proxy
from tether._integrations.mcp_relay import RawParams
from tether._integrations.mcp_stdio import loop_stdio
from tether._integrations.mcp_tasks import connect as connect_tasks
from tether._runtime.logs import announce, logger
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent

# The proxy of the client session a request belongs to (None: not started, for an HTTP
# session's initialize); ``start`` says whether a new session's proxy may be started.
Resolve = Callable[[ServerRequestContext[Any], bool], Awaitable[Proxy | None]]


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


class ProxyServer(Server[Any]):
    """A lowlevel server whose initialization advertises the upstreams' list-changed flags,
    however it is run (the HTTP session manager asks with no options)."""

    notes = NotificationOptions()

    def create_initialization_options(
            self, notification_options: NotificationOptions | None = None,
            experimental_capabilities: dict[str, dict[str, Any]] | None = None,
            extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or self.notes, experimental_capabilities, extensions)


def for_client(ctx: ServerRequestContext[Any], result: dict[str, Any]) -> dict[str, Any]:
    """An upstream's result in the client's protocol era: a 2026-07-28 client requires the
    ``resultType`` and, for cacheable methods, the caching fields that an older upstream does
    not send (the SDK's own defaults: immediately stale, private). An older client ignores
    them."""
    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return result
    filled: dict[str, Any] = {"resultType": "complete"}
    if ctx.method in CACHEABLE_METHODS:
        filled.update({"ttlMs": 0, "cacheScope": "private"})
    return {**filled, **result}


def build_server(template: Proxy, resolve: Resolve) -> ProxyServer:
    """The MCP server the client sees: the upstreams' capabilities (as ``template``'s upstreams
    declare them), each request handled by the proxy of its client session."""
    caps = [up.capabilities for up in template.upstreams]
    instructions = "\n\n".join(i for up in template.upstreams
                               if (i := up.session.instructions)) or None
    names = ", ".join(up.name for up in template.upstreams)
    server = ProxyServer(f"tether-mcp-proxy ({names})", instructions=instructions)
    server.notes = NotificationOptions(
        prompts_changed=any(c.prompts is not None and bool(c.prompts.list_changed)
                            for c in caps),
        resources_changed=any(c.resources is not None and bool(c.resources.list_changed)
                              for c in caps),
        tools_changed=any(c.tools is not None and bool(c.tools.list_changed) for c in caps))

    async def track(ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        proxy = await resolve(ctx, False)
        return await (proxy.track(ctx, call_next) if proxy else call_next(ctx))

    async def session_of(ctx: ServerRequestContext[Any]) -> Proxy:
        proxy = await resolve(ctx, True)
        assert proxy is not None
        return proxy

    async def list_tools(ctx: ServerRequestContext[Any], params: RawParams) -> Any:
        return for_client(ctx, await (await session_of(ctx)).list_tools(ctx, params))

    async def call_tool(ctx: ServerRequestContext[Any], params: RawParams) -> Any:
        return for_client(ctx, await (await session_of(ctx)).call_tool(ctx, params))

    async def pass_through(ctx: ServerRequestContext[Any], params: RawParams) -> Any:
        return for_client(ctx, await (await session_of(ctx)).pass_through(ctx, params))

    async def roots_changed(ctx: ServerRequestContext[Any],
                            params: mcp_types.NotificationParams) -> None:
        proxy = await resolve(ctx, False)
        if proxy is not None:
            await proxy.roots_changed(ctx, params)

    async def initialized(ctx: ServerRequestContext[Any],
                          params: mcp_types.NotificationParams) -> None:
        proxy = await resolve(ctx, False)
        if proxy is not None:
            await proxy.client_initialized(ctx, params)

    server.middleware.append(track)
    if any(c.tools is not None for c in caps):
        server.add_request_handler("tools/list", RawParams, list_tools)
        server.add_request_handler("tools/call", RawParams, call_tool)
    passing = {
        "resources": ("resources/list", "resources/templates/list", "resources/read"),
        "prompts": ("prompts/list", "prompts/get"),
        "completions": ("completion/complete",),
        "logging": ("logging/setLevel",),
    }
    for capability, methods in passing.items():
        if any(getattr(c, capability) is not None for c in caps):
            for method in methods:
                server.add_request_handler(method, RawParams, pass_through)
    if any(c.resources is not None and c.resources.subscribe for c in caps):
        for method in ("resources/subscribe", "resources/unsubscribe"):
            server.add_request_handler(method, RawParams, pass_through)
    server.add_notification_handler("notifications/roots/list_changed",
                                    mcp_types.NotificationParams, roots_changed)
    server.add_notification_handler("notifications/initialized",
                                    mcp_types.NotificationParams, initialized)
    return server


async def open_upstream(spec: UpstreamSpec, stack: AsyncExitStack,
                        children: Children) -> tuple[Any, Any]:
    if spec.url is not None:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        client = await stack.enter_async_context(
            httpx2.AsyncClient(headers=dict(spec.headers)))
        streams = await stack.enter_async_context(
            streamable_http_client(spec.url, http_client=client))
        return streams[0], streams[1]
    env = dict(os.environ) if spec.env is None else {**get_default_environment(), **spec.env}
    return await stack.enter_async_context(
        stdio_upstream(spec.command[0], list(spec.command[1:]), env, spec.cwd, children))


async def connect_upstreams(proxy: Proxy, stack: AsyncExitStack, children: Children) -> None:
    for name, spec in proxy.specs.items():
        what = spec.url or spec.command[0]
        try:
            read, write = await open_upstream(spec, stack, children)
            session = await stack.enter_async_context(
                proxy.session_for(read, write, tasks=spec.tasks))
            await (connect_tasks(session) if spec.tasks else session.initialize())
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


async def start_session(proxy: Proxy, sup: Supervisor, journal: str) -> Any:
    """The client session's delegation; its id goes to stderr (stdout may be the MCP
    channel), with how to stop it."""
    proxy.attach(sup)
    handle = await sup.delegate(Agent(proxy.name, proxy.session_agent, proxy.tools()))
    logger("proxy").info("session started as delegation %s", handle.id,
                         extra={"delegation": handle.id, "session": proxy.name})
    announce("proxy", f"tether mcp-proxy: delegation {handle.id}; stop it with "
             f"`tether recall {handle.id} --grace SECONDS --journal {journal}`",
             delegation=handle.id, session=proxy.name)
    return handle


async def end_session(proxy: Proxy, handle: Any) -> None:
    proxy.closed.set()  # a session that ended normally ends its delegation normally
    await proxy.settle_background()
    await handle.wait()


def one_line(group: BaseExceptionGroup[Any]) -> TetherError:
    cause = first_error(group)
    if isinstance(cause, TetherError):
        return cause
    return UserError(f"an upstream MCP server failed: {cause!r}")


async def serve_stdio(journal: str, config: ProxyConfig) -> None:
    proxy = Proxy(config)
    children = Children()

    async def resolve(ctx: ServerRequestContext[Any], start: bool) -> Proxy:
        return proxy

    with Stopper(children).installed() as stopper:
        try:
            async with AsyncExitStack() as stack:
                with stopper.serving():  # a signal cancels this; the exits below settle
                    await connect_upstreams(proxy, stack, children)
                    # The upstreams' tools (their probes, and the tasks their calls became)
                    # settle what an earlier proxy on this journal left in doubt when it died.
                    sup = await stack.enter_async_context(
                        Supervisor(journal, tools=proxy.journaled_tools(), recover=False))
                    proxy.attach(sup)
                    await sup.recover()
                    handle = await start_session(proxy, sup, journal)
                    server = build_server(proxy, resolve)
                    async with loop_stdio() as pipes:
                        # Read and written on the event loop where they are pipes
                        # (``mcp_stdio``).
                        wire = stdio_server(*pipes) if pipes else stdio_server()  # type: ignore[arg-type]
                        async with wire as (read, write):
                            await server.run(read, write, server.create_initialization_options())
                await end_session(proxy, handle)
        except asyncio.CancelledError:
            if stopper.signal is None:
                raise
        except BaseExceptionGroup as group:  # an upstream that failed, inside the SDK's groups
            if stopper.signal is None:
                raise one_line(group) from None
    if stopper.exit_code is not None:  # the session's delegation settled: now exit
        raise SystemExit(stopper.exit_code)
