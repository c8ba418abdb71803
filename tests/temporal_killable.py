"""A Temporal worker in a process of its own, with tether's plugin, that the chaos tests kill
mid-activity (SIGKILL): its refund tool stops at the point ``--stop`` names, after writing
``--marker``, and waits there to be killed.

    python -m tests.temporal_killable ADDRESS QUEUE JOURNAL WORLD --stop before|after

WORLD is a folder shared with the test: the provider's ledger (``ledger.db``, a
``tether.testing.PaymentService`` file that honours keys) and ``calls`` (a line per call that
reached the tool, whichever process made it).
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

import tether
import tether.temporal
from tests.temporal_flows import Refund, TwoRefunds
from tether.testing import PaymentService

ONE_CLOCK = tether.Policy(clock_tolerance=0.25)  # as tests.conftest's


def refund_tool(world: Path, stop: str | None = None, marker: Path | None = None, *,
                hold: asyncio.Event | None = None) -> tether.Tool:
    """The refund tool over the shared ledger; with ``stop``, it halts there for good; with
    ``hold``, its reply waits, after the refund applied, until the event is set."""
    bank = PaymentService(latency=0.0, path=str(world / "ledger.db"))

    @tether.tool(effect=tether.Effect.EXTERNAL, probe=bank.lookup, dispatch_deadline=2.0)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        with (world / "calls").open("a") as calls:
            calls.write(f"{idempotency_key}\n")
        if stop == "before":
            return await halt(marker)
        ref = await bank.refund(order_id, cents, idempotency_key=idempotency_key)
        if stop == "after":
            return await halt(marker)
        if hold is not None:
            await hold.wait()
        return ref

    return refund


async def halt(marker: Path | None) -> str:
    assert marker is not None
    await asyncio.to_thread(marker.write_text, "stopped")
    await asyncio.Event().wait()  # until SIGKILL
    raise AssertionError("unreachable: the test kills this process first")


def worker(client: Client, queue: str, sup: tether.Supervisor, tool: tether.Tool) -> Worker:
    return Worker(client, task_queue=queue, workflows=[Refund, TwoRefunds],
                  plugins=[tether.temporal.Plugin(sup, tools=[tool])],
                  sticky_queue_schedule_to_start_timeout=timedelta(seconds=1))


def undeclared_worker(client: Client, queue: str, sup: tether.Supervisor, tool: tether.Tool,
                      *, probed: bool = True) -> Worker:
    """The same refund as a plain Temporal activity (a framework's, say): not a tether tool,
    so EXTERNAL, handing its provider ``tether.temporal.idempotency_key()``; its probe named
    in the plugin's ``probes`` (unless ``probed`` is False)."""
    assert tool.probe is not None
    lookup = tool.probe

    @activity.defn(name="refund")
    async def refund(order_id: str, cents: int) -> str:
        result: str = await tool.fn(order_id, cents,
                                    idempotency_key=tether.temporal.idempotency_key())
        return result

    async def probe(args: list[Any], *, idempotency_key: str) -> tether.ProbeResult:
        order_id, cents = args
        return await lookup(order_id, cents, idempotency_key=idempotency_key)

    plugin = tether.temporal.Plugin(sup, probes={"refund": tether.temporal.ActivityProbe(
        probe, dispatch_deadline=60.0)} if probed else None)
    return Worker(client, task_queue=queue, workflows=[Refund], activities=[refund],
                  plugins=[plugin], sticky_queue_schedule_to_start_timeout=timedelta(seconds=1))


async def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("address", "queue", "journal", "world"):
        parser.add_argument(name)
    parser.add_argument("--stop", choices=("before", "after"), required=True)
    parser.add_argument("--undeclared", action="store_true",
                        help="the refund as a plain activity, its probe in the plugin's probes")
    args = parser.parse_args()
    world = Path(args.world)
    tool = refund_tool(world, args.stop, world / "stopped")
    client = await Client.connect(args.address)
    async with tether.Supervisor(args.journal, policy=ONE_CLOCK,
                                 tools=[] if args.undeclared else [tool]) as sup, \
            (undeclared_worker if args.undeclared else worker)(client, args.queue, sup, tool):
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
