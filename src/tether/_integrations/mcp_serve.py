"""Running ``tether mcp-proxy``: connecting its upstreams, the MCP server its client sees,
starting the session's delegation, and serving the client over stdio."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from typing import Any

from mcp import types as mcp_types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.runner import serve_dual_era_loop
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.methods import CACHEABLE_METHODS
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from tether._core.errors import TetherError, UserError
from tether._integrations.mcp_children import GRACE, Children, Stopper, spawn
from tether._integrations.mcp_config import ProxyConfig, UpstreamSpec
from tether._integrations.mcp_process import stdio_upstream
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


def first_error(exc: BaseException) -> BaseException:
    """The error that matters inside the exception groups of the SDK's task groups: a tether
    error if there is one, else the first leaf."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [first_error(e) for e in exc.exceptions]
        return next((e for e in leaves if isinstance(e, TetherError)), leaves[0])
    return exc


class ProxyServer(Server[Any]):
    """A lowlevel server whose initialization advertises the upstreams' list-changed flags,
    however it is run (the HTTP session manager asks with no options), and which serves the
    capabilities of the upstreams ``equip`` gave it."""

    notes = NotificationOptions()
    # Per capability an upstream may offer, the methods served for it and their handler.
    offered: dict[str, list[tuple[str, Any]]]

    def create_initialization_options(
            self, notification_options: NotificationOptions | None = None,
            experimental_capabilities: dict[str, dict[str, Any]] | None = None,
            extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or self.notes, experimental_capabilities, extensions)

    async def serve(self, read: Any, write: Any) -> None:
        """``run``, with the ``initialize`` result built when the client asks for it (over
        stdio the upstreams connect then, and ``equip`` runs before it is answered), not
        when serving starts."""
        async with self.lifespan(self) as state:
            await serve_dual_era_loop(self, read, write, lifespan_state=state,
                                      init_options=None)


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


def build_server(resolve: Resolve) -> ProxyServer:
    """The MCP server the client sees, each request handled by the proxy of its client
    session; what it serves is ``equip``'s to say."""
    server = ProxyServer("tether-mcp-proxy")

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
    server.offered = {
        "tools": [("tools/list", list_tools), ("tools/call", call_tool)],
        **{capability: [(method, pass_through) for method in methods] for capability, methods in {
            "resources": ("resources/list", "resources/templates/list", "resources/read"),
            "prompts": ("prompts/list", "prompts/get"),
            "completions": ("completion/complete",),
            "logging": ("logging/setLevel",),
            "subscribe": ("resources/subscribe", "resources/unsubscribe"),
        }.items()},
    }
    server.add_notification_handler("notifications/roots/list_changed",
                                    mcp_types.NotificationParams, roots_changed)
    server.add_notification_handler("notifications/initialized",
                                    mcp_types.NotificationParams, initialized)
    return server


def equip(server: ProxyServer, template: Proxy) -> None:
    """What ``template``'s upstreams offer, served and advertised: their capabilities (a
    method none serves is not found, as at the upstream), list-changed flags, instructions,
    and ``serverInfo`` (``Proxy.server_info``)."""
    caps = [up.capabilities for up in template.upstreams]
    info = template.server_info()
    server.name, server.version, server.title = info.name, info.version, info.title
    server.description, server.website_url, server.icons = (
        info.description, info.website_url, info.icons)
    server.instructions = "\n\n".join(i for up in template.upstreams
                                       if (i := up.session.instructions)) or None
    server.notes = NotificationOptions(
        prompts_changed=any(c.prompts is not None and bool(c.prompts.list_changed)
                            for c in caps),
        resources_changed=any(c.resources is not None and bool(c.resources.list_changed)
                              for c in caps),
        tools_changed=any(c.tools is not None and bool(c.tools.list_changed) for c in caps))
    offered = {capability for capability in ("tools", "resources", "prompts", "completions",
                                             "logging")
               if any(getattr(c, capability) is not None for c in caps)}
    if any(c.resources is not None and c.resources.subscribe for c in caps):
        offered.add("subscribe")
    for capability in offered:
        for method, handler in server.offered[capability]:
            server.add_request_handler(method, RawParams, handler)


async def open_upstream(spec: UpstreamSpec, stack: AsyncExitStack, children: Children,
                        started: dict[str, asyncio.subprocess.Process] | None = None
                        ) -> tuple[Any, Any]:
    """Its streams: over HTTP, or the stdio of its process (taken from ``started`` if it was
    started before the SDK was imported, else started now)."""
    if spec.url is not None:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        client = await stack.enter_async_context(
            httpx2.AsyncClient(headers=dict(spec.headers)))
        streams = await stack.enter_async_context(
            streamable_http_client(spec.url, http_client=client))
        return streams[0], streams[1]
    proc = (started or {}).pop(spec.name, None) or await spawn(spec, children)
    return await stack.enter_async_context(stdio_upstream(proc, children))


@contextlib.contextmanager
def _starting(name: str, spec: UpstreamSpec) -> Iterator[None]:
    """An upstream that cannot start (or fails its handshake) is one line."""
    what = spec.url or spec.command[0]
    try:
        yield
    except TetherError:
        raise
    except (OSError, MCPError) as exc:
        raise UserError(f"cannot start upstream {name} ({what}): {exc}") from None
    except BaseExceptionGroup as group:
        cause = first_error(group)
        if isinstance(cause, TetherError):
            raise cause from None
        raise UserError(f"cannot start upstream {name} ({what}): {cause}") from None


async def open_upstreams(proxy: Proxy, stack: AsyncExitStack, children: Children,
                         started: dict[str, asyncio.subprocess.Process] | None = None
                         ) -> dict[str, tuple[Any, Any]]:
    """Each upstream's streams: its process started (or taken from ``started``), for a
    command."""
    opened = {}
    for name, spec in proxy.specs.items():
        with _starting(name, spec):
            opened[name] = await open_upstream(spec, stack, children, started)
    return opened


async def connect_upstreams(proxy: Proxy, stack: AsyncExitStack, children: Children,
                            declared: mcp_types.ClientCapabilities | None = None,
                            opened: dict[str, tuple[Any, Any]] | None = None) -> None:
    """Each upstream's session, declaring the client's capabilities (``declared``; None: all
    the proxy can relay), on the streams ``opened`` already, or opened now."""
    if opened is None:
        opened = await open_upstreams(proxy, stack, children)
    for name, spec in proxy.specs.items():
        with _starting(name, spec):
            read, write = opened[name]
            session = await stack.enter_async_context(
                proxy.session_for(read, write, tasks=spec.tasks, declared=declared))
            await (connect_tasks(session) if spec.tasks else session.initialize())
            await proxy.add_upstream(name, session)


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


def one_line(group: BaseException) -> TetherError:
    cause = first_error(group)
    if isinstance(cause, TetherError):
        return cause
    return UserError(f"an upstream MCP server failed: {cause!r}")


def declared(ctx: ServerRequestContext[Any]) -> mcp_types.ClientCapabilities:
    """What the client says it can do: in its ``initialize`` (not yet recorded on its
    session when the request is handled), else in its request's 2026-07-28 envelope."""
    if ctx.method != "initialize":
        return ctx.session.client_capabilities or mcp_types.ClientCapabilities()
    raw = (ctx.params or {}).get("capabilities")
    try:
        return mcp_types.ClientCapabilities.model_validate(raw if isinstance(raw, dict) else {})
    except ValueError:  # the SDK refuses the request itself
        return mcp_types.ClientCapabilities()


class StdioSession:
    """The stdio proxy's one client session. Its upstream processes start at once (a command
    that cannot start is one line before anything is served), and their sessions begin at the
    client's first request, its ``initialize``, declaring the client's capabilities: a server
    that offers what its client can do then offers the proxy's client what it would offer it
    directly. The journal is then opened, what an earlier proxy left in doubt reconciled and
    the session's delegation started, all before ``initialize`` is answered, as before the
    proxy served anything when it connected at start."""

    def __init__(self, proxy: Proxy, journal: str, children: Children,
                 started: dict[str, asyncio.subprocess.Process] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.proxy, self.journal, self.children = proxy, journal, children
        self.started = started
        self.server = build_server(self.resolve)
        self.opened: asyncio.Future[None] = loop.create_future()
        self.declared: asyncio.Future[mcp_types.ClientCapabilities] = loop.create_future()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.done = asyncio.Event()
        self.failure: TetherError | None = None
        # Until every upstream answered its initialize: an upstream may never answer, and a
        # client that leaves meanwhile must not leave the proxy waiting for it.
        self.connecting = True
        self.answered = asyncio.Event()  # connected, or failed to
        self.cut = False
        self.task = asyncio.ensure_future(self._run())

    async def resolve(self, ctx: ServerRequestContext[Any], start: bool) -> Proxy:
        if not self.declared.done():
            self.proxy.client = ctx.session  # what upstreams say meanwhile waits for it
            self.declared.set_result(declared(ctx))
        await asyncio.shield(self.ready)
        return self.proxy

    async def _run(self) -> None:
        proxy = self.proxy
        try:
            async with AsyncExitStack() as stack:
                opened = await open_upstreams(proxy, stack, self.children, self.started)
                self.opened.set_result(None)
                caps = await self.declared
                try:
                    await connect_upstreams(proxy, stack, self.children, caps, opened)
                except Exception as exc:
                    # Kept before the stack unwinds: a cut meanwhile cannot lose it.
                    self.failure = one_line(exc)
                    raise
                finally:
                    # Answered (connected, or failed to): nothing is left for the client's
                    # leaving to cut, however late the watch notices it.
                    self.connecting = False
                    self.answered.set()
                # The upstreams' tools (their probes, and the tasks their calls became)
                # settle what an earlier proxy on this journal left in doubt when it died.
                sup = await stack.enter_async_context(
                    Supervisor(self.journal, tools=proxy.journaled_tools(), recover=False))
                proxy.attach(sup)
                await sup.recover()
                handle = await start_session(proxy, sup, self.journal)
                equip(self.server, proxy)
                self.ready.set_result(None)
                await self.done.wait()
                await end_session(proxy, handle)
        except asyncio.CancelledError:
            self._fail(MCPError(code=mcp_types.INTERNAL_ERROR, message="tether mcp-proxy: " + (
                "stopping" if self.failure is None else str(self.failure))))
            raise
        except BaseException as exc:
            self.failure = self.failure or one_line(exc)
            self._fail(MCPError(code=mcp_types.INTERNAL_ERROR,
                                message=f"tether mcp-proxy: {self.failure}"))
            if not isinstance(exc, Exception):
                raise

    async def watch(self, ended: asyncio.Event) -> None:
        """The client closed stdin while an upstream has not answered its initialize: the
        SDK waits for the client's own initialize to be answered before it ends, and the
        upstream may never answer, so after a grace the session stops connecting (nothing
        was journaled yet) and the client's request fails."""
        await ended.wait()
        # As long as an upstream gets to exit: one that fails soon is still reported.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(GRACE):
                await self.answered.wait()
        if self.connecting:
            self._cut()

    def _cut(self) -> None:
        """Cancel the session's task, once: a second cancel would land in its unwinding, and
        cut short the stopping of its upstream processes."""
        if not self.cut:
            self.cut = True
            self.task.cancel()

    def _fail(self, error: MCPError) -> None:
        for future in (self.opened, self.ready):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: nobody may be waiting on it

    async def close(self, cancel: bool) -> None:
        """The client is gone: the session ends (``cancel``: cut short, by a signal)."""
        self.done.set()
        # No client came, or it left before the upstreams answered: nothing was journaled,
        # nothing is left to end but processes.
        if cancel or not self.declared.done() or self.connecting:
            self._cut()
        await asyncio.gather(self.task, return_exceptions=True)


async def serve_started(journal: str, config: ProxyConfig, stopper: Stopper,
                        started: dict[str, asyncio.subprocess.Process]) -> None:
    """Serve over stdio, the ``stopper``'s signal handlers installed, with the upstream
    processes ``started`` already (``mcp_children.run_stdio``); the others start now."""
    proxy = Proxy(config)
    children = stopper.children
    session: StdioSession | None = None
    try:
        with stopper.serving():  # a signal cancels this; the session settles below
            session = StdioSession(proxy, journal, children, started)
            try:
                await asyncio.shield(session.opened)
            except MCPError:
                assert session.failure is not None
                raise session.failure from None
            async with loop_stdio() as pipes:
                # Read and written on the event loop where they are pipes (``mcp_stdio``).
                wire = stdio_server(*pipes) if pipes else stdio_server()  # type: ignore[arg-type]
                watch = asyncio.ensure_future(session.watch(pipes[0].ended)) if pipes else None
                try:
                    async with wire as (read, write):
                        await session.server.serve(read, write)
                finally:
                    if watch is not None:
                        watch.cancel()
    except asyncio.CancelledError:
        if stopper.signal is None:
            raise
    except BaseExceptionGroup as group:  # inside the SDK's groups
        if stopper.signal is None:
            raise one_line(group) from None
    finally:
        if session is not None:
            await session.close(cancel=stopper.signal is not None)
    if session is not None and session.failure is not None and stopper.signal is None:
        raise session.failure
    stopper.exit()  # for a signal, the session's delegation settled: now exit
