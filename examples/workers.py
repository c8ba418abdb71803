"""A child run by a `tether worker` process, recalled by the orchestrator, offline on SQLite.
With PostgreSQL the same code runs across hosts (see the README).

    python examples/workers.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import tether

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from worker_agents import AGENTS, slow_report  # noqa: E402  (shared with the worker)


async def main(work: Path) -> None:
    journal = f"sqlite:///{work / 'journal.db'}"
    async with tether.Supervisor(journal) as sup:
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "worker", "--journal", journal,
            "--agents", "worker_agents:AGENTS", cwd=HERE, stdout=asyncio.subprocess.PIPE)
        assert worker.stdout is not None
        print((await worker.stdout.readline()).decode().split(":")[0])  # "worker o_... ready"
        done = await sup.delegate(slow_report, "weekly", remote=True)
        print("queued task result:", await done.result())
        handle = await sup.delegate(slow_report, "forever", remote=True)
        while (await sup.journal.get(handle.id)).owner_id == sup.owner_id:
            await sup.wake(0.01)  # until a worker claims it
        report = await handle.recall(grace=2, reason="not needed any more")
        print(f"recalled on the worker: {report.outcome.value} ({report.verdict})")
        worker.terminate()
        await worker.wait()
    print("agents the worker can run:", [a.name for a in AGENTS])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        asyncio.run(main(Path(tmp)))
