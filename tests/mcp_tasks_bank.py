"""An MCP server with the tasks extension (``io.modelcontextprotocol/tasks``, SEP-2663), built
with the SDK's extension API (mcp 2.3 ships no tasks implementation of its own), run over
Streamable HTTP by the tests so that it outlives the proxy that called it.

A client that declares the extension on a 2026-07-28 connection has ``pay`` answered with a
task handle (``resultType: "task"``) and reads the outcome with ``tasks/get``, which inlines the
``CallToolResult`` of a completed task or the JSON-RPC error of a failed one; ``tasks/cancel``
asks for a task's cancellation. Any other client gets the ordinary result. The task store is in
memory: a task is known for as long as this process runs, whoever asks.

``pay`` applies a payment to the ledger (TETHER_TEST_LEDGER) under the idempotency key in
``_meta``, as in ``tests.mcp_bank``; ``hold-*`` accounts wait for the test (named pipes in
TETHER_TEST_GATES) and do not apply when cancelled first; ``closed-*`` accounts fail with
INVALID_PARAMS before anything runs.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
import sys
from datetime import UTC, datetime
from typing import Any

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolRequestParams, RequestParams, ToolAnnotations

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.remote_agents import listen_gate, open_gate

KEY_META = "io.tether/idempotency-key"
TASKS = "io.modelcontextprotocol/tasks"


class TaskParams(RequestParams):
    task_id: str


class _Task:
    def __init__(self) -> None:
        self.id = secrets.token_urlsafe(16)
        self.status = "working"
        self.created = self.updated = _now()
        self.result: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.job: asyncio.Task[None] | None = None

    def view(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"taskId": self.id, "status": self.status,
                                 "createdAt": self.created, "lastUpdatedAt": self.updated,
                                 "ttlMs": 600_000, "pollIntervalMs": 50}
        return shown


TASK_STORE: dict[str, _Task] = {}


def _now() -> str:
    return datetime.now(UTC).isoformat()


def ledger() -> sqlite3.Connection:
    db = sqlite3.connect(os.environ["TETHER_TEST_LEDGER"], isolation_level=None)
    db.execute("CREATE TABLE IF NOT EXISTS paid (key TEXT PRIMARY KEY, account TEXT, cents INT)")
    return db


async def apply_payment(account: str, cents: int, key: str) -> str:
    if account.startswith("closed-"):
        raise MCPError(code=INVALID_PARAMS, message=f"account {account} is closed")
    if account.startswith("hold-"):
        release = await listen_gate("release")
        open_gate("started", account)
        try:
            await release
        except BaseException:
            open_gate("cancelled", account)
            raise
    ledger().execute("INSERT OR IGNORE INTO paid VALUES (?, ?, ?)", (key, account, cents))
    return f"paid {cents} to {account}"


class Tasks(Extension):
    identifier = TASKS

    def methods(self) -> list[MethodBinding]:
        return [MethodBinding("tasks/get", TaskParams, self.get),
                MethodBinding("tasks/cancel", TaskParams, self.cancel)]

    @staticmethod
    def _known(params: TaskParams) -> _Task:
        task = TASK_STORE.get(params.task_id)
        if task is None:
            raise MCPError(code=INVALID_PARAMS, message=f"unknown task {params.task_id}")
        return task

    async def get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> Any:
        task = self._known(params)
        shown = {**task.view(), "resultType": "complete"}
        if task.result is not None:
            shown["result"] = task.result
        if task.error is not None:
            shown["error"] = task.error
        return shown

    async def cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> Any:
        task = self._known(params)
        if task.job is not None and not task.job.done():
            task.job.cancel()
        return {}

    async def intercept_tool_call(self, params: CallToolRequestParams,
                                  ctx: ServerRequestContext[Any, Any],
                                  call_next: CallNext) -> HandlerResult:
        caps = ctx.session.client_capabilities
        declared = caps.extensions if caps is not None else None
        if params.name != "pay" or not declared or TASKS not in declared:
            return await call_next(ctx)
        arguments = params.arguments or {}
        meta = dict(ctx.meta or {})
        account, cents = str(arguments["account"]), int(arguments["cents"])
        key = str(meta.get(KEY_META) or f"no-key:{account}")
        task = _Task()
        TASK_STORE[task.id] = task

        async def run() -> None:
            try:
                text = await apply_payment(account, cents, key)
            except asyncio.CancelledError:
                task.status = "cancelled"
            except MCPError as exc:
                task.status = "failed"
                task.error = exc.error.model_dump(mode="json", by_alias=True,
                                                  exclude_none=True)
            else:
                task.status = "completed"
                # What the tool itself answers (its output schema wraps the text).
                task.result = {"content": [{"type": "text", "text": text}], "isError": False,
                               "structuredContent": {"result": text}}
            task.updated = _now()

        task.job = asyncio.ensure_future(run())
        return {**task.view(), "resultType": "task"}


server = MCPServer("tasks-bank", extensions=[Tasks()])


@server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
async def pay(account: str, cents: int, ctx: Context) -> str:
    """Pays (the tasks extension answers this tool with a task for a client that declares it)."""
    meta = ctx.request_context.meta or {}
    return await apply_payment(account, cents, str(meta.get(KEY_META) or f"no-key:{account}"))


if __name__ == "__main__":
    server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
