"""The DBOS anchor, run in its own process (DBOS is a process-wide singleton).

Usage: python bench/dbos_bench.py DIR STEPS WORKFLOWS WF_STEPS
Prints JSON: synchronous steps/s of one workflow, and steps/s of WORKFLOWS concurrent async
workflows of WF_STEPS steps each, on SQLite in WAL mode with synchronous=FULL, as tether uses.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import sqlalchemy
from dbos import DBOS, DBOSConfig
from sqlalchemy import event


def main() -> None:
    directory, steps, workflows, wf_steps = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    url = f"sqlite:///{directory / 'dbos.sqlite'}"
    engine = sqlalchemy.create_engine(url)

    @event.listens_for(engine, "connect")
    def pragmas(conn: object, _: object) -> None:
        cur = conn.cursor()  # type: ignore[attr-defined]
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    @DBOS.step()
    def noop(i: int) -> int:
        return i

    @DBOS.workflow()
    def sync_workflow(n: int) -> int:
        for i in range(n):
            noop(i)
        return n

    @DBOS.step()
    async def anoop(i: int) -> int:
        return i

    @DBOS.workflow()
    async def async_workflow(n: int) -> int:
        for i in range(n):
            await anoop(i)
        return n

    config: DBOSConfig = {"name": "tether-bench", "system_database_url": url,
                          "system_database_engine": engine, "run_admin_server": False}
    DBOS(config=config)
    DBOS.launch()
    sync_workflow(5)  # warm up
    t = time.perf_counter()
    sync_workflow(steps)
    sync_rate = steps / (time.perf_counter() - t)

    async def concurrent() -> float:
        t = time.perf_counter()
        await asyncio.gather(*(async_workflow(wf_steps) for _ in range(workflows)))
        return workflows * wf_steps / (time.perf_counter() - t)

    rate = asyncio.run(concurrent())
    DBOS.destroy()
    import dbos

    print(json.dumps({"sync_steps_per_s": sync_rate, "concurrent_steps_per_s": rate,
                      "version": getattr(dbos, "__version__", "3.4.0")}))


if __name__ == "__main__":
    main()
