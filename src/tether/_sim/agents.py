"""The agents and tools of a trial: ``pay`` (sent to the simulated provider, probed by key),
``lookup`` (READ_ONLY), and the ``root`` and ``child`` agents that make payments and start
children as their plan says. Everything they do is on the trial's loop, rng and knobs."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from typing import Any, Protocol

import tether
from tether._core.model import Policy, ProbeOutcome
from tether._core.redispatch import CutReason, StreamCut
from tether._runtime.gateway import ACTION
from tether._runtime.tools import Agent, ProbeResult, Tool
from tether._sim.facts import one
from tether._sim.loop import HOST, WALL0, Host, HostClock, SimLoop
from tether._sim.world import Knobs, Provider, Request


class Stage(Protocol):
    """What the agents use of their trial (``trial.Trial``)."""

    loop: SimLoop
    rng: random.Random
    k: Knobs
    policy: Policy
    anchor: sqlite3.Connection
    provider: Provider
    reliable: bool
    broken: list[str]
    asked: dict[str, tuple[Host, float, float]]
    first_asked: dict[tuple[str, str], float]

    def pause_prober(self, key: str) -> None: ...

    def answered(self) -> Any: ...


class _Reply:
    def __init__(self, future: asyncio.Future[str]) -> None:
        self.future = future

    def resolve(self, value: str) -> None:
        if not self.future.done():
            self.future.set_result(value)


def build(trial: Stage) -> tuple[Tool, Agent, Agent]:
    """The pay tool and the root and child agents of ``trial``."""
    loop, rng, k = trial.loop, trial.rng, trial.k

    async def send(task: str, n: int, *, idempotency_key: str) -> str:
        action_id = ACTION.get() or "?"
        row = one(trial.anchor.execute("SELECT deadline_at FROM actions WHERE id = ?",
                                       (action_id,)))
        expires = float(row[0]) - WALL0  # the journaled deadline, on the true clock
        host = HOST.get()
        sent = HostClock(loop, host).wall() if host is not None else loop.time() + WALL0
        if sent >= float(row[0]):  # by the executor's own clock, which wrote the deadline
            trial.broken.append(
                f"{action_id} ({idempotency_key}) sent at {sent - WALL0:.3f} by its "
                f"executor's clock, past its dispatch deadline {expires:.3f}")
        lo, hi = k.latency
        delay = rng.uniform(lo, hi)
        if rng.random() < k.late:  # held in the network, some until just past expiry
            delay = max(delay, expires - loop.time() + rng.uniform(-0.3, 0.05))
        reply: asyncio.Future[str] = loop.create_future()
        trial.provider.send(Request(idempotency_key, action_id, f"{task}#{n}", expires,
                                    _Reply(reply)), delay, rng.uniform(lo, hi))
        try:
            async with asyncio.timeout(k.tool_timeout):
                state = await reply
        except TimeoutError:
            raise ConnectionError(f"no reply for {idempotency_key}") from None
        if state == "refused":
            raise tether.ToolRejected(f"provider refused {idempotency_key}")
        return "paid"

    async def probe(task: str, n: int, *, idempotency_key: str) -> ProbeResult:
        limit = trial.policy.probe_timeout
        host = HOST.get()
        if host is not None and not trial.reliable:
            trial.asked[idempotency_key] = (host, loop.time(), HostClock(loop, host).wall())
            trial.first_asked.setdefault((idempotency_key, host.name), loop.time())
        if not trial.reliable:
            r = rng.random()
            if r < k.probe_raise:
                await asyncio.sleep(0.002)
                raise ConnectionError("probe failed")
            if r < k.probe_raise + k.probe_hang:
                await asyncio.sleep(limit * 3)
        latency = rng.uniform(0.0, k.probe_latency)
        if trial.reliable:
            latency = min(latency, limit / 2)
        await asyncio.sleep(latency / 2)
        applied, voided = trial.provider.lookup(idempotency_key, k.void)
        trial.pause_prober(idempotency_key)
        await asyncio.sleep(latency / 2)
        if applied:
            return ProbeResult(ProbeOutcome.COMPLETED, result="paid")
        return ProbeResult(ProbeOutcome.NOT_APPLIED, voided=voided)

    pay = Tool("pay", tether.Effect.EXTERNAL, send, probe,
                          dispatch_deadline=k.deadline)

    async def balance(task: str, n: int) -> int:
        await asyncio.sleep(rng.uniform(0.0, 0.01))
        return len(trial.provider.ledger)

    lookup = Tool("lookup", tether.Effect.READ_ONLY, balance)

    async def pays(ctx: tether.Context, plan: dict[str, Any]) -> str:
        cut = plan.get("cut") if ctx.attempt == 1 else None
        if cut == -1:
            raise StreamCut(CutReason.STREAM_INCOMPLETE)
        for j in range(plan["pays"]):
            if cut == j:
                raise StreamCut(CutReason.STREAM_INCOMPLETE)
            await asyncio.sleep(rng.uniform(0.0, 0.05))  # the model thinks
            if plan["reads"]:  # a READ_ONLY call first: an event, not an action to account
                await ctx.call(lookup, task=ctx.task_id, n=j)
            try:
                async with asyncio.timeout(plan.get("patience")):
                    await ctx.call(pay, task=ctx.task_id, n=j)
                    await trial.answered()
            except TimeoutError:
                return "gave up"  # the payment goes on without this code
        if cut == plan["pays"]:
            raise StreamCut(CutReason.STREAM_INCOMPLETE)
        return "paid"

    @tether.agent(tools=[pay, lookup])
    async def child(ctx: tether.Context, plan: dict[str, Any]) -> str:
        return await pays(ctx, plan)

    @tether.agent(tools=[pay, lookup, child])
    async def root(ctx: tether.Context, plan: dict[str, Any]) -> str:
        if not plan["kids"]:
            return await pays(ctx, plan)
        handles = [await ctx.delegate(child, kid) for kid in plan["kids"]]
        for h in handles:
            await h.result()
        return "done"

    return pay, root, child
