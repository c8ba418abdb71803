"""What ``tether mcp-proxy`` carries unchanged between its client and the upstream servers.

Everything but ``tools/call`` passes through as the raw JSON the peers sent: resources, resource
templates, subscriptions, prompts, completions and logging from the client to the upstream that
serves them; notifications (logs, list changes, resource updates) and server-to-client requests
(sampling, elicitation, roots) from an upstream to the client. None of it is a journaled
action: reads change nothing, and what an upstream asks of the client is the client's to answer.
Progress notifications ride every forwarded request, in the direction the protocol allows.

Upstreams connect once the client's first request (its ``initialize``) is in, declaring the
client's own sampling, elicitation and roots capabilities (``AsClient``): a server that offers
tools by what its client can do offers the proxy's client what it would offer it directly.
What an upstream asks or says before the client finished its handshake waits for it (the
startup ``tools/list_changed`` of a server that adds tools at ``initialized``, its roots
request), and then reaches the client, as it would over a direct connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.client.session import ClientRequestContext, IncomingMessage, MessageHandlerFnT
from mcp.server.context import ServerRequestContext
from mcp.server.session import ServerSession
from mcp.shared.dispatcher import ProgressFnT
from mcp.shared.exceptions import MCPError
from mcp.shared.message import ServerMessageMetadata
from pydantic import ConfigDict

RESERVED = "io.modelcontextprotocol/"
# Seconds an upstream's request waits for the client to finish its handshake, and the
# client's first request for the answers to roots requests made meanwhile.
HANDSHAKE_WAIT = 5.0


class AsClient(ClientSession):
    """An upstream session that declares the proxy's client's sampling, elicitation and roots
    as the client declared them (``None``: all three, for a client not yet known). The SDK
    derives them from the callbacks given, which the relay always gives; its
    ``_build_capabilities`` is where it does, for the handshake and the 2026-07-28 envelope
    alike."""

    def __init__(self, *args: Any, declared: mcp_types.ClientCapabilities | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._declared = declared

    def _build_capabilities(self, version: str) -> mcp_types.ClientCapabilities:
        caps = super()._build_capabilities(version)
        if self._declared is None:
            return caps
        mine = self._declared
        return caps.model_copy(update={"sampling": mine.sampling,
                                       "elicitation": mine.elicitation, "roots": mine.roots})


class RawParams(mcp_types.RequestParams):
    """Any request's params, kept whole: the proxy forwards what the client sent."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class RawRequest(mcp_types.Request[dict[str, Any] | None, str]):
    params: dict[str, Any] | None = None


class RawResult(mcp_types.Result):
    """Any result, kept whole (fields this SDK version does not know included)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def outgoing(params: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, bool]:
    """The client's params as sent upstream, and whether the client asked for progress. Its
    progress token is the client's; the upstream session uses its own and the proxy relays."""
    # (A 2026-07-28 client's progress token rides the same key.)
    if params is None:
        return None, False
    out = dict(params)
    # The reserved keys (the 2026-07-28 envelope: protocol version, client info and
    # capabilities, log level) belong to one hop: the upstream session stamps its own.
    meta = {k: v for k, v in (out.get("_meta") or {}).items() if not k.startswith(RESERVED)}
    wants = meta.pop("progressToken", None) is not None
    if meta:
        out["_meta"] = meta
    else:
        out.pop("_meta", None)
    return out, wants


def progress_relay(ctx: ServerRequestContext[Any], wanted: bool) -> ProgressFnT | None:
    """Upstream progress for a forwarded request, reported to the client under its token."""
    if not wanted:
        return None

    async def relay(progress: float, total: float | None, message: str | None) -> None:
        await ctx.session.report_progress(progress, total, message)

    return relay


async def forward(session: ClientSession, ctx: ServerRequestContext[Any], method: str,
                  params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Send the client's request upstream and return the upstream's result as it came. An
    upstream's JSON-RPC error reaches the client as it was (code, message and data)."""
    out, wants = outgoing(params)
    result = await session.send_request(RawRequest(method=method, params=out), RawResult,
                                        progress_callback=progress_relay(ctx, wants))
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


# Where to send what one upstream session (None: unknown) asks or says: a client's session
# and the request it relates to, or None when there is no client to send it to.
ClientFinder = Callable[[ClientSession | None], tuple[ServerSession, Any] | None]


class ClientRelay:
    """The upstream sessions' callbacks: each request or notification an upstream sends goes
    to the real client, on the stream of the client's request in flight when there is one."""

    def __init__(self, client: ClientFinder,
                 on_tools_changed: Callable[[], Awaitable[None]] | None = None) -> None:
        self._client = client
        self._on_tools_changed = on_tools_changed
        # Set once the client finished its handshake (``notifications/initialized``, or its
        # first request after ``initialize``): the protocol lets a server ask or notify its
        # client only from then on.
        self.ready = asyncio.Event()
        # Answered when each roots request made before that is.
        self._early_roots: list[asyncio.Event] = []

    async def handshake(self, origin: ClientSession | None) -> None:
        """Wait (bounded) for the client's handshake, when there is a client to wait for."""
        if not self.ready.is_set() and self._client(origin) is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HANDSHAKE_WAIT):
                    await self.ready.wait()

    async def early_roots(self) -> None:
        """Roots asked before the client's handshake answered first (bounded), so that its
        first request sees them in effect at the upstream."""
        early, self._early_roots = self._early_roots, []
        if early:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HANDSHAKE_WAIT):
                    await asyncio.gather(*(e.wait() for e in early))

    def _target(self, what: str, origin: ClientSession) -> tuple[ServerSession, Any]:
        found = self._client(origin)
        if found is None:
            raise MCPError(code=mcp_types.INVALID_REQUEST,
                           message=f"{what}: no client of the proxy can be asked (none is "
                           "connected, or the request cannot be told apart from others')")
        return found

    async def _ask(self, what: str, origin: ClientSession, request: mcp_types.ServerRequest,
                   result: type[Any]) -> Any:
        await self.handshake(origin)
        session, related = self._target(what, origin)
        try:
            return await session.send_request(
                request, result, metadata=ServerMessageMetadata(related_request_id=related))
        except MCPError as exc:  # the client's own refusal, passed back as it was
            return exc.error

    async def sampling(self, context: ClientRequestContext,
                       params: mcp_types.CreateMessageRequestParams) -> Any:
        request = mcp_types.CreateMessageRequest(params=params)
        kind = (mcp_types.CreateMessageResultWithTools if params.tools or params.tool_choice
                else mcp_types.CreateMessageResult)
        return await self._ask("sampling", context.session, request, kind)

    async def elicitation(self, context: ClientRequestContext,
                          params: mcp_types.ElicitRequestParams) -> Any:
        return await self._ask("elicitation", context.session,
                               mcp_types.ElicitRequest(params=params), mcp_types.ElicitResult)

    async def roots(self, context: ClientRequestContext) -> Any:
        answered = asyncio.Event()
        if not self.ready.is_set():
            self._early_roots.append(answered)
        try:
            return await self._ask("roots", context.session, mcp_types.ListRootsRequest(),
                                   mcp_types.ListRootsResult)
        finally:
            answered.set()

    def notifications(self) -> tuple[MessageHandlerFnT, Callable[[ClientSession], None]]:
        """A message handler for one upstream session, and how to tell it which session it
        is (the session is built with its handler)."""
        origin: list[ClientSession] = []

        async def handle(message: IncomingMessage) -> None:
            await self.notification(message, origin[0] if origin else None)

        return handle, origin.append

    async def notification(self, message: IncomingMessage,
                           origin: ClientSession | None = None) -> None:
        if isinstance(message, Exception):
            return  # a transport fault of an upstream: its requests fail on their own
        if isinstance(message, mcp_types.ToolListChangedNotification) and self._on_tools_changed:
            await self._on_tools_changed()
        if self._client(origin) is not None:
            await self.ready.wait()  # each notification is handled in a task of its own
        found = self._client(origin)
        if found is None:
            return
        session, related = found
        if isinstance(message, mcp_types.ProgressNotification):
            return  # progress of forwarded requests is relayed by their own callbacks
        request_scoped = isinstance(message, mcp_types.LoggingMessageNotification)
        await session.send_notification(message, related if request_scoped else None)
