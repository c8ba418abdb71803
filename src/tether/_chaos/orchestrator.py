"""One chaos trial's orchestrator: a real process, killed with SIGKILL at the plan's point.

Run as ``python -m tether._chaos.orchestrator DIR PLAN_JSON JOURNAL_URL``. Its children refund
orders at a simulated provider that writes the shared ledger; the harness reconciles after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import threading
from collections import Counter
from pathlib import Path

import tether
from tether._chaos.ledger import Ledger
from tether._chaos.plan import Plan

KILL_POINTS = {
    "kill_before_dispatch": "before_dispatch",
    "kill_during_dispatch": "during_dispatch",
    "kill_after_effect": "after_effect",
    "kill_in_reconcile": "probe",
}


class Trial:
    def __init__(self, directory: Path, plan: Plan) -> None:
        self.plan = plan
        self.ledger = Ledger(directory / "ledger.db")
        self.seen: Counter[str] = Counter()
        self.rng = random.Random(plan.seed)

    def point(self, name: str) -> None:
        """SIGKILL this process at the plan's point, on its n-th occurrence."""
        self.seen[name] += 1
        if KILL_POINTS.get(self.plan.fault) == name and self.seen[name] == self.plan.kill_nth:
            os.kill(os.getpid(), signal.SIGKILL)

    async def provider_refund(self, order_id: str, cents: int, key: str) -> str:
        await asyncio.sleep(self.plan.latency)  # the request in transit
        self.point("during_dispatch")
        ref = self.ledger.apply(key, order_id, cents)
        self.point("after_effect")
        await asyncio.sleep(self.plan.reply)  # the reply in transit
        return ref

    async def probe(self, order_id: str, cents: int, *,
                    idempotency_key: str) -> tether.ProbeResult:
        self.point("probe")
        if self.plan.probe_mode == "raise":
            raise RuntimeError("provider lookup unavailable")
        if self.plan.probe_mode == "hang":
            await asyncio.sleep(3600)
        n = self.ledger.count(idempotency_key)
        outcome = tether.ProbeOutcome.COMPLETED if n else tether.ProbeOutcome.NOT_APPLIED
        return tether.ProbeResult(outcome, {"applications": n})


def tools(trial: Trial) -> tuple[tether.Tool, tether.Tool]:
    @tether.tool(effect=tether.Effect.EXTERNAL, probe=trial.probe)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        trial.point("before_dispatch")
        return await trial.provider_refund(order_id, cents, idempotency_key)

    @tether.tool(effect=tether.Effect.READ_ONLY)
    async def lookup(order_id: str) -> str:
        await asyncio.sleep(0)
        return order_id

    return refund, lookup


async def run(directory: Path, plan: Plan, url: str) -> None:
    trial = Trial(directory, plan)
    refund, lookup = tools(trial)
    cut = plan.fault == "stream_cut"

    async def agent(ctx: tether.Context, order: str, n: int, cut_at: int) -> str:
        await ctx.call(lookup, order_id=order)
        for j in range(n):
            if cut and j == cut_at and ctx.attempt == 1:
                raise tether.StreamCut(tether.CutReason.STREAM_INCOMPLETE)
            await ctx.call(refund, order_id=order, cents=j + 1)
        if cut and cut_at >= n and ctx.attempt == 1:
            raise tether.StreamCut(tether.CutReason.STREAM_INCOMPLETE)
        return order

    policy = tether.Policy(ack_timeout=0.5, probe_timeout=0.2, max_grace=5.0)
    redispatch = tether.RedispatchPolicy(retry_safe=frozenset({"lookup"}), settle_delay=0.01)
    async with tether.Supervisor(url, policy=policy, redispatch=redispatch,
                                 tools=[refund]) as sup:
        if plan.fault == "kill_random":
            timer = threading.Timer(plan.kill_after, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        if plan.fault == "kill_in_grace":
            loop = asyncio.get_running_loop()

            def kill_in_window(event: str, _: str) -> None:
                if event == "drain":
                    loop.call_later(plan.grace / 2, os.kill, os.getpid(), signal.SIGKILL)

            sup.listen(kill_in_window)
        handles = [await sup.delegate(agent, f"o{plan.seed}-{i}", plan.refunds,
                                      trial.rng.randint(0, plan.refunds),
                                      tools=[refund, lookup]) for i in range(plan.children)]
        await control(plan, handles)
        for handle in handles:
            with contextlib.suppress(tether.TetherError):
                await handle.result()
        await sup.journal.flush()


async def control(plan: Plan, handles: list[tether.Handle]) -> None:
    await asyncio.sleep(plan.control_after)
    first = handles[0]
    if plan.fault in ("recall", "slow_tool", "kill_in_grace"):
        await first.recall(grace=plan.grace, reason="chaos")
    elif plan.fault in ("terminate", "kill_in_reconcile", "probe_fail"):
        await first.terminate("chaos")
    elif plan.fault == "race":
        async def worker() -> None:
            try:
                await first.recall(grace=plan.grace, reason="race")
                fresh = await first.redelegate()
            except tether.ControlRefused:
                return
            with contextlib.suppress(tether.TetherError):
                await fresh.result()

        await asyncio.gather(worker(), worker())


if __name__ == "__main__":
    asyncio.run(run(Path(sys.argv[1]), Plan.from_json(sys.argv[2]), sys.argv[3]))
