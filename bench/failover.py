"""What a caller sees while the PostgreSQL journal fails over: ``python bench/failover.py``.

Starts a private server (initdb in a temporary directory, its own port), runs children that
make payments back to back through the gateway (each one's write-ahead intent is a journal
commit), and, once the flow is steady, restarts the server (``fast``, ``immediate``) or
terminates every backend. Reports, per fault and run: the interruption (the longest gap between
two payments reaching the provider around the fault), the payments made, the errors callers saw
(0 expected: the fault is shorter than the reconnection window) and the writer's reconnections.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import tether
from tether._chaos.pgserver import PrivateServer
from tether.testing import PaymentService


async def one_run(server: PrivateServer, fault: str, children: int, steady: float,
                  keys: Path) -> tuple[float, int, int, int]:
    pay = PaymentService(latency=0.0)
    seen: list[float] = []
    stop = asyncio.Event()

    @tether.tool(effect=tether.Effect.EXTERNAL, probe=pay.lookup)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        seen.append(time.monotonic())
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

    errors = 0

    @tether.agent(tools=[refund])
    async def payer(ctx: tether.Context, name: str) -> int:
        nonlocal errors
        n = 0
        while not stop.is_set():
            try:
                await ctx.call(refund, order_id=f"{name}-{n}", cents=100)
            except tether.TetherError:
                errors += 1
            n += 1
        return n

    url = f"{server.url}?schema=b_{uuid.uuid4().hex[:12]}&keys={keys}"
    async with tether.Supervisor(url, tools=[refund], recover=False) as sup:
        handles = [await sup.delegate(payer, f"c{i}") for i in range(children)]
        await asyncio.sleep(steady)
        at = time.monotonic()
        if fault == "terminate":
            await asyncio.to_thread(server.terminate)
        else:
            await asyncio.to_thread(server.restart, fault)
        await asyncio.sleep(steady)
        stop.set()
        for h in handles:
            await h.result()
        reconnects = sup.journal._runner.reconnects
    around = [t for t in seen if at - steady / 2 <= t]
    gap = max((b - a for a, b in itertools.pairwise(around)), default=0.0)
    return gap, len(seen), errors, reconnects


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--children", type=int, default=8)
    parser.add_argument("--steady", type=float, default=1.0, help="seconds before and after")
    args = parser.parse_args()
    with PrivateServer() as server, tempfile.TemporaryDirectory() as tmp:
        print("| fault | runs | interruption, median (max) | payments | caller errors | "
              "reconnections |")
        print("| --- | --- | --- | --- | --- | --- |")
        for fault in ("fast", "immediate", "terminate"):
            rows = [await one_run(server, fault, args.children, args.steady, Path(tmp))
                    for _ in range(args.runs)]
            gaps = [r[0] for r in rows]
            name = "terminate backends" if fault == "terminate" else f"restart -m {fault}"
            print(f"| {name} | {args.runs} | {statistics.median(gaps) * 1000:.0f} ms "
                  f"({max(gaps) * 1000:.0f} ms) | {sum(r[1] for r in rows)} | "
                  f"{sum(r[2] for r in rows)} | {sum(r[3] for r in rows)} |")


if __name__ == "__main__":
    asyncio.run(main())
