"""An MCP server built with the SDK's own server API, run over stdio by the tests.

``pay`` applies a payment to a ledger (a SQLite file in TETHER_TEST_LEDGER, the provider's own
record) keyed by the idempotency key tether sends in ``_meta``. Accounts named ``hold-*`` wait
for the test (named pipes in TETHER_TEST_GATES) before applying, and say so when cancelled;
``closed-*`` accounts are refused with a JSON-RPC error before anything runs; ``flaky-*`` ones
apply, then fail. ``paid`` reports progress as it reads the ledger.
"""

from __future__ import annotations

import os
import sqlite3
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, ToolAnnotations

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.remote_agents import listen_gate, open_gate

KEY_META = "io.tether/idempotency-key"
server = MCPServer("bank")


def ledger() -> sqlite3.Connection:
    db = sqlite3.connect(os.environ["TETHER_TEST_LEDGER"], isolation_level=None)
    db.execute("CREATE TABLE IF NOT EXISTS paid (key TEXT PRIMARY KEY, account TEXT, cents INT)")
    return db


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def balance(account: str) -> int:
    db = ledger()
    row = db.execute("SELECT COALESCE(SUM(cents), 0) FROM paid WHERE account = ?",
                     (account,)).fetchone()
    return int(row[0])


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False,
                                         idempotent_hint=True))
async def pay(account: str, cents: int, ctx: Context) -> str:
    meta = ctx.request_context.meta or {}
    key = str(meta.get(KEY_META) or f"no-key:{account}")
    if account.startswith("closed-"):  # refused before anything runs
        raise MCPError(code=INVALID_PARAMS, message=f"account {account} is closed",
                       data={"account": account})
    if account.startswith("hold-"):
        release = await listen_gate("release")
        open_gate("started", account)
        try:
            await release
        except BaseException:
            open_gate("cancelled", account)
            raise
    db = ledger()
    db.execute("INSERT OR IGNORE INTO paid VALUES (?, ?, ?)", (key, account, cents))
    if account.startswith("flaky-"):  # applied, then the tool fails: an isError result
        raise ToolError("ledger replica timed out")
    return f"paid {cents} to {account}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def paid(account: str, ctx: Context) -> int:
    """The sum paid to an account, with a progress notification per step of the lookup."""
    for step in range(3):
        await ctx.report_progress(step + 1, 3, f"step {step + 1}")
    return await balance(account)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:  # Streamable HTTP on 127.0.0.1:PORT/mcp
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
