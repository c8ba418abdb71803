"""``tether mcp-proxy --http HOST:PORT``: the proxy served over Streamable HTTP at ``/mcp``.

Each MCP session (the SDK's session manager gives each its id, its streams and its idle
timeout) is one client session of the proxy: its own upstream connections, so that what an
upstream asks of its client (sampling, elicitation, roots) and what it notifies reaches the
right one, and its own delegation in the journal. Clients of the 2026-07-28 protocol have no
sessions: their requests share one client session of the proxy while it serves. A client that
drops a request's stream, or cancels it, has the call cancelled upstream and reconciled like
any cancellation; a client that retries after a broken stream with the same tether
idempotency key in ``_meta`` gets the journaled outcome replayed instead of a second call.

Loopback only: the proxy has no authentication of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from mcp import types as mcp_types
from mcp.server.context import ServerRequestContext
from mcp.server.session import ServerSession
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from tether._core.errors import UserError
from tether._integrations.mcp_children import Children, Stopper
from tether._integrations.mcp_config import ProxyConfig
from tether._integrations.mcp_proxy import Proxy
from tether._integrations.mcp_serve import (
    build_server,
    connect_upstreams,
    end_session,
    equip,
    first_error,
    one_line,
    start_session,
)
from tether._runtime.logs import announce
from tether._runtime.supervisor import Supervisor


def parse_listen(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0: any free one), on a loopback address
    only."""
    host, sep, port = spec.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"--http {spec!r} must be HOST:PORT, e.g. 127.0.0.1:8765")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"--http {spec!r}: the proxy has no authentication of its own, so it "
                        "serves on a loopback address only (127.0.0.1, ::1 or localhost)")
    return host, int(port)


def guard(host: str) -> TransportSecuritySettings:
    """DNS-rebinding protection on whichever loopback address is served: the SDK enables it
    only for 127.0.0.1, ::1 and localhost, not 127.0.0.2 or an expanded IPv6 form."""
    shown = f"[{host}]" if ":" in host else host
    hosts = sorted({f"{shown}:*", "127.0.0.1:*", "localhost:*", "[::1]:*"})
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=[f"http://{h}" for h in hosts])


STATELESS = "(2026-07-28 clients, sessionless)"


@dataclass(eq=False)
class _Session:
    client: ServerSession
    ready: asyncio.Future[Proxy] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class HttpSessions:
    """The proxy of each MCP session, started at its first request, ended with the session."""

    def __init__(self, journal: str, config: ProxyConfig, sup: Supervisor,
                 children: Children) -> None:
        self.journal, self.config, self.sup = journal, config, sup
        self.children = children
        self.sessions: dict[str, _Session] = {}
        # Set by a signal: a session that ends from then on is cut, not ended by its client
        # (its delegation terminated, as the stdio proxy's), whatever unwinds it.
        self.cut = False

    async def resolve(self, ctx: ServerRequestContext[Any], start: bool) -> Proxy | None:
        # The SDK keeps a client's Connection (its session, and the exit stack it unwinds when
        # the session ends) on the per-request session only.
        connection = ctx.session._connection
        # A 2026-07-28 client has no session: each request comes on a connection of its own.
        # Its requests share one client session of the proxy, for as long as it serves.
        key = connection.session_id or STATELESS
        found = self.sessions.get(key)
        if found is None:
            if not start or ctx.method == "initialize":
                return None
            found = self.sessions[key] = _Session(ctx.session)
            found.task = asyncio.ensure_future(self._run(found, key is STATELESS))
            if key is not STATELESS:
                connection.exit_stack.push_async_callback(self._ended, key)
        return await asyncio.shield(found.ready)

    async def _run(self, session: _Session, shared: bool = False) -> None:
        proxy = Proxy(self.config)
        proxy.shared = shared
        proxy.client = session.client  # known before the upstreams connect (and ask for roots)
        proxy.relay.ready.set()  # its first request after initialize started this
        # A sessionless client's capabilities are its request's; those sharing the proxy may
        # differ, so its upstreams are offered all the proxy can relay.
        declared = None if shared else (session.client.client_capabilities
                                     or mcp_types.ClientCapabilities())
        try:
            async with AsyncExitStack() as stack:
                await connect_upstreams(proxy, stack, self.children, declared)
                handle = await start_session(proxy, self.sup, self.journal)
                session.ready.set_result(proxy)
                await session.done.wait()
                await end_session(proxy, handle)
        except BaseException as exc:
            if not session.ready.done():
                session.ready.set_exception(MCPError(
                    code=mcp_types.INTERNAL_ERROR,
                    message=f"tether mcp-proxy: the upstreams failed: {first_error(exc)}"))
            if not isinstance(exc, Exception):
                raise

    async def _ended(self, key: str) -> None:
        session = self.sessions.pop(key, None)
        if session is not None:
            if self.cut and session.task is not None:
                session.task.cancel()  # its delegation is terminated as the supervisor closes
            session.done.set()
            if session.task is not None:
                await asyncio.wait({session.task}, timeout=self.sup.policy.ack_timeout)

    async def close(self) -> None:
        for key in list(self.sessions):
            await self._ended(key)


async def serve_http(journal: str, config: ProxyConfig, host: str, port: int, *,
                     idle_timeout: float = 300.0) -> None:
    import uvicorn

    # Listening first: a port in use, say, is the user's mistake, said in one line before
    # anything starts (uvicorn logged it and exited 3 once the upstreams had been probed).
    listener = _listen(host, port)
    children = Children()
    # The proxy's own signal handlers from the start: a signal while the upstreams are probed
    # stops them with it (the default action killed the proxy and left them running), and
    # once it serves, it stops the server too (uvicorn's own handlers are kept out: the
    # signal they re-raise at the end killed the proxy before it stopped its upstreams).
    stopper = Stopper(children)
    stopper.install()
    try:
        async with AsyncExitStack() as stack:
            template = Proxy(config)  # the upstreams' capabilities, and the config checked
            template.relay.ready.set()  # it has no client: what its upstreams ask is refused
            probe = await stack.enter_async_context(AsyncExitStack())
            with stopper.serving():  # a signal before serving begins cancels this
                await connect_upstreams(template, probe, children)
            # What an earlier proxy on this journal left in doubt when it died, settled with
            # the upstreams' tools (their probes, their tasks) while the template's sessions
            # are open; by a supervisor of its own, whose tools (those sessions') the sessions'
            # supervisor would otherwise keep in place of each session's own.
            with stopper.serving():
                async with Supervisor(journal, tools=template.journaled_tools(),
                                      recover=False) as recovering:
                    template.attach(recovering)
                    await recovering.recover()
            # tools=(): each session brings its own; what $TETHER_TOOLS names (the
            # deployment's Python tools) is never imported here.
            sup = await stack.enter_async_context(Supervisor(journal, recover=False, tools=()))
            sessions = HttpSessions(journal, config, sup, children)
            server = build_server(sessions.resolve)
            equip(server, template)
            await probe.aclose()
            app = server.streamable_http_app(host=host, transport_security=guard(host),
                                            session_idle_timeout=idle_timeout)

            class Web(uvicorn.Server):
                @contextlib.contextmanager
                def capture_signals(self) -> Iterator[None]:
                    yield  # the proxy's own handlers (``stopper``) stop the server

                async def startup(self, sockets: Any = None) -> None:
                    await super().startup(sockets)
                    # Said once it listens (a port of 0 is chosen by the system: say which).
                    bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                    shown = f"[{host}]" if ":" in host else host
                    announce("proxy", f"tether mcp-proxy: serving MCP at "
                             f"http://{shown}:{bound}/mcp (journal {journal})",
                             url=f"http://{shown}:{bound}/mcp")

            # Stopping, a client's open stream (its GET, a call in flight) is given a second
            # (uvicorn counts whole ones), then cut: uvicorn would otherwise wait for it as
            # long as the client keeps it open, and the upstreams it would reach are stopped.
            web = Web(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                     lifespan="on", timeout_graceful_shutdown=1))
            stopper.then(lambda: _shut(web, sessions))
            quiet = _Quiet(stopper)
            logging.getLogger("uvicorn.error").addFilter(quiet)
            try:
                if stopper.signal is None:  # else a signal came as the server was made
                    await web.serve(sockets=[listener])
            finally:
                if stopper.signal is None:  # a signal stopped the upstreams already
                    children.stop_now()
                with contextlib.suppress(Exception):
                    await sessions.close()
                logging.getLogger("uvicorn.error").removeFilter(quiet)
    except asyncio.CancelledError:
        if stopper.signal is None:
            raise
    except BaseExceptionGroup as group:
        failed = group.subgroup(lambda e: not isinstance(e, asyncio.CancelledError))
        if stopper.signal is None or failed is not None:  # not only what the signal cut
            raise one_line(group) from None
    finally:
        listener.close()
    stopper.exit()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise UserError(f"--http {host}:{port}: cannot listen there: "
                        f"{exc.strerror or exc}") from None


def _shut(web: Any, sessions: HttpSessions) -> None:
    """A signal while serving: the server stops, within its graceful-shutdown bound (not at
    once at a second signal: its lifespan and streams would then be left to be cancelled as
    the loop closes, each with a traceback), and the sessions it ends are cut."""
    sessions.cut = True
    web.should_exit = True


class _Quiet(logging.Filter):
    """After a signal, uvicorn's account of the streams it cut at the end of its graceful
    shutdown (the proxy's own doing, as the signal asked) is not an error to show."""

    def __init__(self, stopper: Stopper) -> None:
        super().__init__()
        self.stopper = stopper

    def filter(self, record: logging.LogRecord) -> bool:
        if self.stopper.signal is None:
            return True
        cut = record.exc_info[1] if record.exc_info else None
        return not (isinstance(cut, asyncio.CancelledError | SystemExit)
                    or "timeout graceful shutdown exceeded" in record.getMessage())
