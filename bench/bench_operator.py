"""The operator's figures: `tether ls` (first page) on a journal of many delegations, and the
journal's size per action. Run by bench/run.py; alone: .venv/bin/python bench/bench_operator.py
"""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

import tether
from tether._cli.render import delegation_table
from tether._cli.safe import print_table
from tether._core.model import ActionState, DelegationState, Effect
from tether._journal import ops
from tether._journal.journal import Journal
from tether._journal.rows import NewAction, NewDelegation
from tether._journal.sqlite import SqliteDb
from tether._journal.triage import DelegationQuery
from tether._runtime.state import new_id

ROOT = Path(__file__).resolve().parent.parent


async def create(url: str) -> None:
    async with Journal(url):
        pass


def fill(path: Path, n: int) -> None:
    """``n`` delegations with one completed EXTERNAL action each, written by the journal's own
    operations (in large transactions: the figure is about reading, not writing)."""
    asyncio.run(create(f"sqlite:///{path}"))
    conn = sqlite3.connect(path, isolation_level=None)
    start = time.time() - n
    db = SqliteDb(conn)
    for base in range(0, n, 10_000):
        conn.execute("BEGIN")
        for i in range(base, min(n, base + 10_000)):
            now = start + i
            did = new_id("d")
            ops.create_delegation(db, NewDelegation(
                id=did, task_id=new_id("t"), parent_id=None, attempt=1,
                agent=("refund", "mail", "search")[i % 3], surface=("pay",),
                args={"args": [f"order-{i}"], "kwargs": {}}, owner_id="o_bench", now=now))
            aid = new_id("a")
            ops.begin_action(db, NewAction(
                id=aid, delegation_id=did, epoch=0, ordinal=0, tool="pay",
                effect=Effect.EXTERNAL, args_json=json.dumps({"order": f"order-{i}"}),
                args_hash=f"{i:064x}", idem_key=f"t{i}:pay:0", now=now, deadline_at=now + 30), 5.0)
            ops.finish_action(db, aid, ActionState.COMPLETED, now + 0.01, f"ref-{i}")
            ops.set_state(db, did, DelegationState.SUCCEEDED, now + 0.02)
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def first_page(url: str, limit: int) -> float:
    """Seconds from opening the journal to the first page rendered (what `tether ls` does
    after the interpreter has started)."""
    start = time.perf_counter()
    async with Journal(url, create=False) as j:
        rows = await j.page(DelegationQuery(limit=limit))
    print_table(Console(file=io.StringIO(), width=120), delegation_table(rows))
    return time.perf_counter() - start


@tether.tool(effect=tether.Effect.EXTERNAL)
async def pay(i: int, *, idempotency_key: str) -> int:
    return i


async def pays_once(ctx: tether.Context, i: int) -> None:
    await ctx.call(pay, i=i)


async def _written(url: str, n: int) -> None:
    async with tether.Supervisor(url, keys=tether.KeyRing.ephemeral()) as sup:
        for base in range(0, n, 1_000):  # a thousand children at a time, as a busy service
            handles = await asyncio.gather(*(sup.delegate(pays_once, i, tools=[pay])
                                             for i in range(base, min(n, base + 1_000))))
            await asyncio.gather(*(h.result() for h in handles))


def runtime_bytes(directory: Path, n: int) -> float:
    """Bytes per delegation of one completed EXTERNAL action as the runtime writes it: its
    rows, events, chain entries and sealed head (``fill`` writes the rows alone)."""
    path = directory / f"runtime-{n}.db"
    asyncio.run(_written(f"sqlite:///{path}?synchronous=off", n))
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path.stat().st_size / n


def operator_figures(directory: Path, n: int, reps: int = 5) -> dict[str, Any]:
    path = directory / f"ops-{n}.db"
    fill(path, n)
    url = f"sqlite:///{path}"
    pages = [asyncio.run(first_page(url, 50)) for _ in range(reps)]
    proc = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tether", "ls", "--journal", url],
                       capture_output=True, check=True, cwd=ROOT)
        proc.append(time.perf_counter() - t0)
    size = path.stat().st_size
    return {"delegations": n, "ls_first_page_s": statistics.median(pages),
            "ls_first_page_max_s": max(pages), "ls_process_s": statistics.median(proc),
            "journal_bytes_per_action": size / n,
            "journal_bytes_per_action_chained": runtime_bytes(directory, min(n, 5_000))}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(operator_figures(Path(tmp), int(sys.argv[1]) if len(sys.argv) > 1
                                          else 100_000), indent=2))
