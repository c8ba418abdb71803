"""A chaos trial's simulated provider, its tools and the child agent, the same in every process
of the trial: the orchestrator, the `tether worker` processes (through ``tether._chaos.agents``)
and the harness's reconcilers. Each builds them from the trial's folder and plan."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import tether
from tether._chaos.ledger import Ledger
from tether._chaos.plan import CLOCK_TOLERANCE, DEADLINE_SLACK, LATE_APPLY_MAX, Plan

ENV_DIR = "TETHER_CHAOS_DIR"
ENV_PLAN = "TETHER_CHAOS_PLAN"
AGENT_NAME = "chaos_child"

# The runtime is learning to take a tool's dispatch deadline (seconds after the intent within
# which a call may still apply). Declared only once tether.Tool has the field.
TOOL_DEADLINE: dict[str, Any] = (
    {"dispatch_deadline": LATE_APPLY_MAX}
    if "dispatch_deadline" in {f.name for f in dataclasses.fields(tether.Tool)} else {})

KILL_POINTS = {
    "kill_before_dispatch": "before_dispatch",
    "kill_during_dispatch": "during_dispatch",
    "kill_after_effect": "after_effect",
    "kill_in_reconcile": "probe",
}


class Trial:
    """One process's view of the trial. ``role`` names it in the trace ("orchestrator",
    "worker", "reconciler", ...); only the orchestrator kills itself at the plan's points, and
    only it has probes that fail (the next supervisor's probes work)."""

    def __init__(self, directory: Path, plan: Plan, role: str, *, buffered: bool = False) -> None:
        self.directory = directory
        self.plan = plan
        self.role = role
        self.ledger = Ledger(directory / "ledger.db")
        self.seen: Counter[str] = Counter()
        self.rng = random.Random(plan.seed)
        # Buffered notes wait for close(): for a process that runs while another one may be
        # stopped inside a write to the ledger (it would wait for that lock).
        self._buffer: list[tuple[float, str, str, dict[str, Any]]] | None = (
            [] if buffered else None)
        # Called once, when this process first puts a request in the network: late_apply
        # times its control from there, so the fault happens however slow the machine is.
        self.on_first_send: Callable[[], None] | None = None
        # Awaited after each refund returns, before the code goes on: the commit of its
        # receipt, as the MCP proxy waits for it before answering its client (``pg_lost``).
        self.answered: Callable[[], Awaitable[None]] | None = None

    @classmethod
    def from_env(cls, role: str) -> Trial:
        return cls(Path(os.environ[ENV_DIR]), Plan.from_json(os.environ[ENV_PLAN]), role)

    def env(self) -> dict[str, str]:
        """For a helper process of this trial (a worker imports the agents from it)."""
        return {**os.environ, ENV_DIR: str(self.directory), ENV_PLAN: self.plan.to_json()}

    @property
    def who(self) -> str:
        return self.role if self.role == "orchestrator" else f"{self.role}:{os.getpid()}"

    def note(self, what: str, key: str = "", **detail: Any) -> None:
        if self._buffer is not None:
            self._buffer.append((time.time(), what, key, detail))
            return
        self.ledger.note(self.who, what, key, **detail)

    def close(self) -> None:
        for at, what, key, detail in self._buffer or []:
            self.ledger.note(self.who, what, key, at=at, **detail)
        self._buffer = None
        self.ledger.close()

    def point(self, name: str) -> None:
        """SIGKILL this process at the plan's point, on its n-th occurrence."""
        self.seen[name] += 1
        if (self.role == "orchestrator" and KILL_POINTS.get(self.plan.fault) == name
                and self.seen[name] == self.plan.kill_nth):
            os.kill(os.getpid(), signal.SIGKILL)

    async def provider_refund(self, order_id: str, cents: int, key: str, stamp: float) -> str:
        """The provider applies a request within LATE_APPLY_MAX of the tool's first line
        (``stamp``), or never: an older one is refused, whoever sends it when."""
        plan = self.plan
        expires = stamp + LATE_APPLY_MAX - DEADLINE_SLACK
        await asyncio.sleep(plan.latency)  # the request in transit
        self.point("during_dispatch")
        if plan.late > 0 or plan.bug == "overdue_apply":
            ref = await self._through_network(order_id, cents, key, expires)
        else:
            if time.time() > expires:
                self.note("refused", key, reason="past its deadline")
                raise tether.ToolRejected(f"the provider refused {key}: past its deadline")
            ref = self.ledger.apply(key, order_id, cents, self.who)
        self.point("after_effect")
        await asyncio.sleep(plan.reply)  # the reply in transit
        return ref

    async def _through_network(self, order_id: str, cents: int, key: str,
                               expires: float) -> str:
        delay = self.plan.late
        if self.plan.bug == "overdue_apply":
            delay = 1.5 * LATE_APPLY_MAX
        n = self.ledger.send(key, order_id, cents, delay=delay, expires_at=expires, by=self.who)
        hook, self.on_first_send = self.on_first_send, None
        if hook is not None:
            hook()
        while True:  # cancelling the call leaves the request in the network
            state, ref = self.ledger.request(n)
            if state == "applied" and ref is not None:
                return ref
            if state == "dropped":
                raise tether.ToolRejected(f"the provider dropped {key}: past its deadline")
            await asyncio.sleep(0.005)

    async def probe(self, order_id: str, cents: int, *,
                    idempotency_key: str) -> tether.ProbeResult:
        self.point("probe")
        mode = self.plan.probe_mode if self.role == "orchestrator" else "ok"
        if mode == "raise":
            self.note("probe", idempotency_key, answer="raised")
            raise RuntimeError("provider lookup unavailable")
        if mode == "hang":
            self.note("probe", idempotency_key, answer="hangs")
            await asyncio.sleep(3600)
        n = self.ledger.count(idempotency_key)
        if self.plan.bug == "blind_probe":
            n = sum(1 for k, _, by in self.ledger.applications()
                    if k == idempotency_key and by != "network")
        outcome = tether.ProbeOutcome.COMPLETED if n else tether.ProbeOutcome.NOT_APPLIED
        self.note("probe", idempotency_key, answer=outcome.value, applications=n,
                  in_network=self.ledger.in_network())
        return tether.ProbeResult(outcome, {"applications": n})


def tools(trial: Trial) -> tuple[tether.Tool, tether.Tool]:
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        stamp = time.time()
        trial.point("before_dispatch")
        return await trial.provider_refund(order_id, cents, idempotency_key, stamp)

    async def lookup(order_id: str) -> str:
        await asyncio.sleep(0)
        return order_id

    paid = tether.Tool("refund", tether.Effect.EXTERNAL, refund, trial.probe)
    return (dataclasses.replace(paid, **TOOL_DEADLINE),
            tether.Tool("lookup", tether.Effect.READ_ONLY, lookup))


def cuts(plan: Plan) -> bool:
    """Whether the children's first attempts end in a cut model stream."""
    return plan.fault in ("stream_cut", "cancel_in_delay") or (
        plan.fault == "exit_in_flight" and plan.variant == "cut")


def child_agent(trial: Trial, refund: tether.Tool, lookup: tether.Tool) -> tether.Agent:
    cut = cuts(trial.plan)

    async def chaos_child(ctx: tether.Context, order: str, n: int, cut_at: int) -> str:
        if cut and cut_at < 0 and ctx.attempt == 1:  # before any tool ran: re-dispatched
            trial.note("cut", ctx.task_id, attempt=ctx.attempt)
            raise tether.StreamCut(tether.protocol.CutReason.STREAM_INCOMPLETE)
        await ctx.call(lookup, order_id=order)
        for j in range(n):
            if cut and j == cut_at and ctx.attempt == 1:
                trial.note("cut", ctx.task_id, attempt=ctx.attempt)
                raise tether.StreamCut(tether.protocol.CutReason.STREAM_INCOMPLETE)
            await ctx.call(refund, order_id=order, cents=j + 1)
            if trial.answered is not None:
                await trial.answered()
                trial.note("answered", ctx.task_id, refund=j + 1)
                await asyncio.sleep(trial.plan.think)
        if cut and cut_at >= n and ctx.attempt == 1:
            trial.note("cut", ctx.task_id, attempt=ctx.attempt)
            raise tether.StreamCut(tether.protocol.CutReason.STREAM_INCOMPLETE)
        return order

    return tether.Agent(AGENT_NAME, chaos_child, (refund, lookup))


def build(trial: Trial) -> tuple[tether.Tool, tether.Tool, tether.Agent]:
    refund, lookup = tools(trial)
    return refund, lookup, child_agent(trial, refund, lookup)


def policy(plan: Plan) -> tether.Policy:
    """The supervisors' bounds; a cross-process trial's lease is short, like its workers'."""
    if plan.lease > 0:
        return tether.Policy(ack_timeout=0.5, probe_timeout=0.2, max_grace=5.0, lease=plan.lease,
                             clock_tolerance=CLOCK_TOLERANCE)
    return tether.Policy(ack_timeout=0.5, probe_timeout=0.2, max_grace=5.0,
                         clock_tolerance=CLOCK_TOLERANCE)
