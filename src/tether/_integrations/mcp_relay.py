"""What ``tether mcp-proxy`` carries unchanged between its client and the upstream servers.

Everything but ``tools/call`` passes through as the raw JSON the peers sent: resources, resource
templates, subscriptions, prompts, completions and logging from the client to the upstream that
serves them; notifications (logs, list changes, resource updates) and server-to-client requests
(sampling, elicitation, roots) from an upstream to the client. None of it is a journaled
action: reads change nothing, and what an upstream asks of the client is the client's to answer.
Progress notifications ride every forwarded request, in the direction the protocol allows.
"""

from __future__ import annotations

import asyncio
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
        # Upstreams that asked for roots before a client was there, and, once a client with
        # roots is, the event each sets when its roots request was answered.
        self.roots_refused: set[ClientSession] = set()
        self.roots_answered: dict[ClientSession, asyncio.Event] = {}

    def _target(self, what: str, origin: ClientSession) -> tuple[ServerSession, Any]:
        found = self._client(origin)
        if found is None:
            raise MCPError(code=mcp_types.INVALID_REQUEST,
                           message=f"{what}: no client of the proxy can be asked (none is "
                           "connected, or the request cannot be told apart from others')")
        return found

    async def _ask(self, what: str, origin: ClientSession, request: mcp_types.ServerRequest,
                   result: type[Any]) -> Any:
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
        if self._client(context.session) is None:
            self.roots_refused.add(context.session)
        answer = await self._ask("roots", context.session, mcp_types.ListRootsRequest(),
                                 mcp_types.ListRootsResult)
        if (event := self.roots_answered.get(context.session)) is not None:
            event.set()
        return answer

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
        found = self._client(origin)
        if found is None:
            return
        session, related = found
        if isinstance(message, mcp_types.ProgressNotification):
            return  # progress of forwarded requests is relayed by their own callbacks
        request_scoped = isinstance(message, mcp_types.LoggingMessageNotification)
        await session.send_notification(message, related if request_scoped else None)
