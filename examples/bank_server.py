"""A small MCP server (built with the MCP SDK) whose ``pay`` tool has a real side effect: a
row in the ledger file named by BANK_LEDGER, keyed by the idempotency key tether sends."""

from __future__ import annotations

import asyncio
import os
import sqlite3

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("bank")


def ledger() -> sqlite3.Connection:
    db = sqlite3.connect(os.environ["BANK_LEDGER"], isolation_level=None)
    db.execute("CREATE TABLE IF NOT EXISTS paid (key TEXT PRIMARY KEY, account TEXT, cents INT)")
    return db


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def balance(account: str) -> int:
    row = ledger().execute("SELECT COALESCE(SUM(cents), 0) FROM paid WHERE account = ?",
                           (account,)).fetchone()
    return int(row[0])


@server.tool(annotations=ToolAnnotations(idempotent_hint=True))
async def pay(account: str, cents: int, ctx: Context) -> str:
    key = str((ctx.request_context.meta or {}).get("io.tether/idempotency-key", account))
    await asyncio.sleep(float(os.environ.get("BANK_LATENCY", "0")))
    ledger().execute("INSERT OR IGNORE INTO paid VALUES (?, ?, ?)", (key, account, cents))
    return f"paid {cents} to {account}"


if __name__ == "__main__":
    server.run()
