"""Recall a child whose tools come from an MCP server: the in-flight payment finishes inside
the grace window, the next one is refused, and the report says exactly what happened.

    python examples/mcp_gateway.py        (offline; needs pip install 'tether[mcp]')
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import tether
from tether.mcp import ServerPolicy, mcp_tools

HERE = Path(__file__).resolve().parent


async def main(work: Path) -> None:
    ledger = work / "bank.db"
    server = StdioServerParameters(
        command=sys.executable, args=[str(HERE / "bank_server.py")],
        env={"BANK_LEDGER": str(ledger), "BANK_LATENCY": "0.5"})
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        # The bank is not trusted: its annotations say pay is idempotent, the operator says
        # it moves money. Untrusted tools default to EXTERNAL anyway; this makes it explicit.
        policy = ServerPolicy("bank", trusted=False, effects={"pay": tether.Effect.EXTERNAL})
        tools = {t.name: t for t in await mcp_tools(session, policy)}

        async def payroll(ctx: tether.Context) -> None:
            for account in ("alice", "bob", "carol"):
                await ctx.call(tools["bank.pay"], account=account, cents=1000)

        async with tether.Supervisor(f"sqlite:///{work / 'journal.db'}") as sup:
            child = await sup.delegate(payroll, tools=list(tools.values()))
            # Recall while the first payment is in flight (its intent is in the journal).
            while not (await sup.journal.facts(child.id)).pending:
                await sup.wake(0.01)
            report = await child.recall(grace=5, reason="payroll run cancelled")
    print(f"outcome: {report.outcome.value} ({report.verdict})")
    for action in report.actions:
        print(f"  {action.tool} {action.args['account']}: {action.state.value} "
              f"key={action.idempotency_key}")
    paid = sqlite3.connect(ledger).execute("SELECT account FROM paid ORDER BY account")
    print("bank ledger:", ", ".join(r[0] for r in paid.fetchall()))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        asyncio.run(main(Path(tmp)))
