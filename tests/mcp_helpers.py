"""Shared by the MCP tests: connect to a stdio MCP server, the test bank and its ledger."""

from __future__ import annotations

import os
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.client.stdio import StdioServerParameters, stdio_client

import tether

ROOT = Path(__file__).resolve().parent.parent
# For the processes a test starts: this checkout's tether (its src, ahead of an editable
# install of another checkout) and its tests package.
PYTHONPATH = os.pathsep.join((str(ROOT / "src"), str(ROOT)))


@asynccontextmanager
async def connect(command: str, *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
                  **callbacks: Any) -> AsyncIterator[ClientSession]:
    """``callbacks``: the ClientSession's (sampling_callback, message_handler, ...); ``env``:
    more environment for the server."""
    # The SDK passes a server only a safe subset of the environment: name what it needs.
    mine = {k: v for k, v in os.environ.items() if k.startswith("TETHER_TEST_")}
    params = StdioServerParameters(command=command, args=list(args), cwd=cwd,
                                   env={**mine, "PYTHONPATH": PYTHONPATH, **(env or {})})
    async with stdio_client(params) as (read, write), ClientSession(
            read, write, **callbacks) as session:
        await session.initialize()
        yield session


def bank() -> AbstractAsyncContextManager[ClientSession]:
    return connect(sys.executable, "-m", "tests.mcp_bank")


def paid(ledger: Path, account: str) -> list[tuple[str, int]]:
    db = sqlite3.connect(ledger)
    try:
        return db.execute("SELECT key, cents FROM paid WHERE account = ?", (account,)).fetchall()
    except sqlite3.OperationalError:  # no payment yet: the server creates the table lazily
        return []
    finally:
        db.close()


def probe_for(ledger: Path) -> Any:
    async def probe(account: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
        rows = [r for r in paid(ledger, account) if r[0] == idempotency_key]
        if rows:
            return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"ledger": rows[0][0]})
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"ledger": "no entry"})

    return probe


def text(result: mcp_types.CallToolResult) -> str:
    return " ".join(c.text for c in result.content if isinstance(c, mcp_types.TextContent))
