"""What ``tether mcp-proxy`` sends upstream for one client ``tools/call``: the client's request
forwarded whole (its ``_meta``, progress and cancellation), the upstream's answer sorted into
what the gateway journals (a result, an error result in doubt, a refusal before running, a
failure in doubt), and each upstream session with the tools it offers."""

from __future__ import annotations

import asyncio
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

from tether._core.errors import ToolRejected
from tether._integrations.mcp_gateway import (
    KEY_META,
    REJECTED_BEFORE_RUNNING,
    McpToolError,
)
from tether._integrations.mcp_policy import ServerPolicy
from tether._integrations.mcp_relay import RawRequest, RawResult, progress_relay
from tether._integrations.mcp_tasks import TaskBook, is_task, outcome
from tether._runtime.tools import Tool, ToolFn


def error_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class UpstreamErrorResult(McpToolError):
    """The upstream answered ``isError``: in doubt, and its result goes to the client as is."""

    def __init__(self, result: dict[str, Any]) -> None:
        texts = [c.get("text", "") for c in result.get("content", []) if isinstance(c, dict)]
        super().__init__(" ".join(t for t in texts if t) or "the tool reported an error")
        self.result = result


class UpstreamRejected(ToolRejected):
    """The upstream refused the request before running it (invalid params, no such method)."""

    def __init__(self, error: MCPError) -> None:
        super().__init__(error.error.message)
        self.error = error


class UpstreamFailed(Exception):
    """Any other JSON-RPC error: the call may have applied first, so it is in doubt."""

    def __init__(self, error: MCPError) -> None:
        super().__init__(error.error.message)
        self.error = error


class ClientCancelled(Exception):
    """The client gave up on a call that was running upstream: in doubt, then probed."""


@dataclass(eq=False)
class Call:
    """One client ``tools/call`` on its way: what the tool function forwards, and its task."""

    request: ServerRequestContext[Any]
    params: dict[str, Any]  # the client's own (fields this proxy does not know included)
    meta: dict[str, Any]
    wants_progress: bool
    task: asyncio.Task[Any] | None = None
    cancelled: bool = False


CALL: ContextVar[Call | None] = ContextVar("tether_mcp_call", default=None)
# Upstream sessions whose connection closed (an upstream that exited): never reopened.
_GONE: weakref.WeakSet[ClientSession] = weakref.WeakSet()


def _upstream_error(exc: MCPError, session: ClientSession) -> Exception:
    if exc.code == mcp_types.CONNECTION_CLOSED:  # it may have applied; the next not
        _GONE.add(session)
    if exc.code in REJECTED_BEFORE_RUNNING:
        return UpstreamRejected(exc)
    return UpstreamFailed(exc)


def forwarder(session: ClientSession, spec: mcp_types.Tool,
               book: TaskBook | None = None) -> ToolFn:
    """The function the gateway runs for one upstream tool: the client's request, forwarded.
    With a ``book``, an upstream's task handle is journaled and waited on (``mcp_tasks``)."""
    name = spec.name

    async def call(idempotency_key: str | None = None, **arguments: Any) -> Any:
        mine = CALL.get()
        if mine is not None and mine.cancelled:
            raise ToolRejected(f"{name}: the client cancelled the call before it was sent")
        if session in _GONE:  # certainly not sent: not a call for a person to reconcile
            raise ToolRejected(f"{name}: the upstream server's connection is closed; the call "
                               "was not sent")
        meta = dict(mine.meta) if mine is not None else {}
        if idempotency_key:
            meta[KEY_META] = idempotency_key
        params: dict[str, Any] = {**(mine.params if mine is not None else {}),
                                  "name": name, "arguments": arguments}
        params.pop("_meta", None)
        if meta:
            params["_meta"] = meta
        if mine is not None:
            mine.task = asyncio.current_task()
        relay = progress_relay(mine.request, mine.wants_progress) if mine else None
        try:
            res = await session.send_request(RawRequest(method="tools/call", params=params),
                                             RawResult, progress_callback=relay)
        except asyncio.CancelledError:
            # The SDK has sent notifications/cancelled upstream for the request by now.
            if mine is not None and mine.cancelled:
                raise ClientCancelled(f"{name}: the client cancelled the call while it "
                                      "ran upstream") from None
            raise
        except MCPError as exc:
            raise _upstream_error(exc, session) from None
        result = res.model_dump(mode="json", by_alias=True, exclude_none=True)
        if book is not None and is_task(result):
            result = await _await_task(book, result, idempotency_key, mine, name)
        if result.get("isError"):
            raise UpstreamErrorResult(result)
        return result

    call.__name__ = name
    return call


async def _await_task(book: TaskBook, handle: dict[str, Any], key: str | None,
                      mine: Call | None, name: str) -> dict[str, Any]:
    """The call became a task upstream: its id journaled, then its outcome read."""
    task_id = str(handle["taskId"])
    try:
        if key:
            await book.record(key, task_id)
        task = await book.wait(handle)
        return outcome(task)
    except asyncio.CancelledError:
        book.cancel(task_id)  # as notifications/cancelled is sent for an ordinary call
        if mine is not None and mine.cancelled:
            raise ClientCancelled(f"{name}: the client cancelled the call while its task "
                                  "ran upstream") from None
        raise
    except MCPError as exc:  # the task failed (its error), or tasks/get did
        raise _upstream_error(exc, book.session) from None


@dataclass(eq=False)
class Upstream:
    name: str
    session: ClientSession
    policy: ServerPolicy
    prefix: str = ""
    tools: dict[str, tuple[Tool, mcp_types.Tool]] = field(default_factory=dict)
    book: TaskBook | None = None  # the upstream answers calls with tasks (``mcp_tasks``)

    @property
    def capabilities(self) -> mcp_types.ServerCapabilities:
        caps = self.session.server_capabilities
        return caps if caps is not None else mcp_types.ServerCapabilities()
