"""Agents and tools run by `tether worker` processes in the tests, imported by both sides.

The outside world is shared through files: the payment provider's ledger is a SQLite file
(TETHER_TEST_LEDGER) and the tests steer a tool through named pipes in TETHER_TEST_GATES, so
a test waits for "the refund was applied" as an event, never by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
from pathlib import Path

import tether
from tether.testing import PaymentService


@functools.cache
def ledger(path: str | None = None) -> PaymentService:
    return PaymentService(latency=0.0, path=path or os.environ["TETHER_TEST_LEDGER"])


def gate_path(name: str) -> Path:
    return Path(os.environ["TETHER_TEST_GATES"]) / name


def make_gates(directory: Path, *names: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.mkfifo(directory / name)


async def listen_gate(name: str) -> asyncio.Future[str]:
    """Open the named pipe now (so a writer can reach it) and read one line later; the read is
    cancellable. Opened read-write so that it never sees end-of-file without a writer."""
    loop = asyncio.get_running_loop()
    fd = os.open(gate_path(name), os.O_RDWR | os.O_NONBLOCK)
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))

    async def read() -> str:
        try:
            return (await reader.readline()).decode().strip()
        finally:
            transport.close()

    return asyncio.ensure_future(read())


async def wait_gate(name: str) -> str:
    return await (await listen_gate(name))


def open_gate(name: str, line: str = "go") -> None:
    """Write one line to the named pipe. Its reader must already have it open."""
    fd = os.open(gate_path(name), os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


async def _probe(order_id: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
    return await ledger().lookup(order_id, cents, idempotency_key=idempotency_key)


# The tests release a held refund well within 3 s of its intent, so the provider keeps the
# tool's promise: nothing applies after the dispatch deadline.
@tether.tool(effect=tether.Effect.EXTERNAL, probe=_probe, dispatch_deadline=3.0)
async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
    """Orders named ``hold-*`` wait for the test before the provider sees them; ``reply-*``
    are applied at once and their reply then waits for the test (or never comes)."""
    if order_id.startswith("hold-"):
        release = await listen_gate("release")
        open_gate("started", order_id)
        await release
    ref = await ledger().refund(order_id, cents, idempotency_key=idempotency_key)
    if order_id.startswith("reply-"):
        release = await listen_gate("release")
        open_gate("started", f"applied {order_id}")
        await release
    return ref


@tether.agent(tools=[refund])
async def refunder(ctx: tether.Context, order_id: str, then: str | None = None) -> list[str]:
    """One refund, then (optionally) a second one; a recall in between stops the second."""
    refs = [await ctx.call(refund, order_id=order_id, cents=500)]
    if then is not None:
        if then.startswith("after-gate-"):
            nxt = await listen_gate("next")
            open_gate("started", f"first done {order_id}")
            await nxt
        refs.append(await ctx.call(refund, order_id=then, cents=300))
    return refs


AGENTS = [refunder]
TOOLS = [refund]


async def redelegate(journal: str, delegation_id: str, gate: str) -> None:
    """An orchestrator process racing another to re-delegate one task."""
    async with tether.Supervisor(journal, recover=False) as sup:
        waiting = await listen_gate(gate)
        print("ready", flush=True)
        await waiting
        try:
            handle = await sup.handle_for(delegation_id).redelegate()
        except tether.errors.StaleEpoch as exc:
            print(f"lost {type(exc).__name__}", flush=True)
        else:
            print(f"won {handle.id}", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(redelegate(*sys.argv[1:4]))
