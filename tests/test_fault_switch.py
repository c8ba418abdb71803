"""No setting of a deployment switches write-ahead (I1) off: the chaos harness's deliberate
bugs are planted by code (tether._chaos.faults), never read from the environment."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, sqlite3, sys
import tether

DB = sys.argv[1]

@tether.tool(effect=tether.Effect.EXTERNAL)
async def pay(*, idempotency_key: str) -> bool:
    # The intent must be durable before the tool runs: read it from another connection.
    with sqlite3.connect(DB) as conn:
        rows = conn.execute("SELECT COUNT(*) FROM actions WHERE idem_key = ?",
                            (idempotency_key,)).fetchone()
    return rows[0] == 1

async def agent(ctx: tether.Context) -> bool:
    return await ctx.call(pay)

async def main() -> None:
    async with tether.Supervisor(f"sqlite:///{DB}", tools=[pay]) as sup:
        handle = await sup.delegate(agent, tools=[pay])
        print("intent-first" if await handle.result() else "tool-first")

asyncio.run(main())
"""


async def test_tether_faults_in_the_environment_changes_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "TETHER_FAULTS": "intent_after_dispatch"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SCRIPT, str(tmp_path / "journal.db"), cwd=tmp_path, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "intent-first"
