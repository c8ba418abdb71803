"""``tether demo``: the seed's three failures, done naively and then with tether.

Every scene runs against a simulated payment provider with latency and its own ledger, and is
judged by that ledger, not by what the orchestrator believes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tether._cli.safe import safe
from tether._core.errors import ControlRefused, DelegationError, InvalidTransition
from tether._core.model import ActionState, Effect
from tether._core.redispatch import CutReason, RedispatchPolicy, StreamCut
from tether._core.report import Report
from tether._runtime.gateway import Context
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Tool, agent, tool
from tether.testing import PaymentService

CENTS = 1250


@dataclass
class Tally:
    intended: int = 1
    applied: int = 0
    unrecorded: int = 0  # applied at the provider, yet absent from the orchestrator's record

    @property
    def duplicated(self) -> int:
        return max(0, self.applied - self.intended)

    def to_json(self) -> dict[str, int]:
        return {"intended": self.intended, "applied": self.applied,
                "duplicated": self.duplicated, "unrecorded": self.unrecorded}


@dataclass
class Scene:
    id: str
    title: str
    naive: Tally
    tether: Tally
    delegation: str = ""
    outcome: str = ""
    checks: list[tuple[str, bool]] = field(default_factory=list)

    @property
    def prevented(self) -> bool:
        return all(ok for _, ok in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "naive": self.naive.to_json(),
                "tether": {**self.tether.to_json(), "delegation": self.delegation,
                           "outcome": self.outcome},
                "checks": [{"name": n, "ok": ok} for n, ok in self.checks],
                "prevented": self.prevented}


class Shop:
    """The demo's tools over one payment provider."""

    def __init__(self, pay: PaymentService) -> None:
        self.pay = pay
        self.lookup_delay = 0.0

        @tool(effect=Effect.READ_ONLY)
        async def get_order(order_id: str) -> dict[str, Any]:
            await asyncio.sleep(self.lookup_delay)
            return {"order_id": order_id, "total": CENTS}

        @tool(effect=Effect.EXTERNAL, probe=pay.lookup, compensate=pay.reverse)
        async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
            return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

        self.get_order: Tool = get_order
        self.refund: Tool = refund

    async def refund_agent(self, ctx: Context, order_id: str) -> str:
        order = await ctx.call(self.get_order, order_id=order_id)
        ref: str = await ctx.call(self.refund, order_id=order_id, cents=order["total"])
        return ref

    async def naive_agent(self, order_id: str) -> str:
        """What frameworks do today: the agent calls the provider; a cancel kills the task."""
        await asyncio.sleep(self.lookup_delay)
        return await self.pay.refund(order_id, CENTS, idempotency_key=secrets.token_hex(8))

    def tools(self) -> list[Tool]:
        return [self.get_order, self.refund]


def _refund_completed(report: Report) -> bool:
    return any(a.tool == "refund" and a.state is ActionState.COMPLETED
               for a in report.all_actions())


def _ledger_checks(scene: Scene, pay: PaymentService, order: str, report: Report) -> None:
    journaled = sum(1 for a in report.all_actions()
                    if a.tool == "refund" and a.state is ActionState.COMPLETED)
    scene.tether.applied = pay.refund_count(order)
    scene.tether.unrecorded = max(0, scene.tether.applied - journaled)
    scene.delegation, scene.outcome = report.delegation_id, report.outcome.value
    scene.checks += [
        ("customer refunded exactly once (provider ledger)", scene.tether.applied == 1),
        ("every applied refund has a COMPLETED journal record", scene.tether.unrecorded == 0),
        ("report lists nothing as unknown", not report.needs_attention),
    ]


async def scene_a(sup: Supervisor, shop: Shop) -> Scene:
    """Recall mid-payment, then hand the refund to a person unless the bot's went through."""
    scene = Scene("a", "recall mid-payment (ghost action)", Tally(), Tally())
    pay = shop.pay
    order = f"A-{secrets.token_hex(3)}"
    pay.mark()
    naive = asyncio.create_task(shop.naive_agent(order))
    await pay.sent()
    naive.cancel()  # "recalled": the framework reports the task cancelled
    await pay.refund(order, CENTS, idempotency_key=secrets.token_hex(8))  # the person refunds
    await pay.settle()
    scene.naive.applied = pay.refund_count(order)

    order = f"A-{secrets.token_hex(3)}"
    pay.mark()
    child = await sup.delegate(shop.refund_agent, order, tools=shop.tools())
    await pay.sent()
    report = await child.recall(grace=2.0, reason="customer asked for a person")
    if not _refund_completed(report):
        await pay.refund(order, CENTS, idempotency_key=f"person:{order}")
    await pay.settle()
    scene.checks.append(("refund in flight finished within grace and was recorded",
                         _refund_completed(report) and report.outcome.value == "RECALLED"))
    _ledger_checks(scene, pay, order, report)
    return scene


async def scene_b(sup: Supervisor, shop: Shop) -> Scene:
    """Terminate after the provider applied the refund but before its reply arrived."""
    scene = Scene("b", "terminate before the receipt (lost receipt)", Tally(), Tally())
    pay = shop.pay
    order = f"B-{secrets.token_hex(3)}"
    pay.mark()
    pay.reply_delay = 3.0
    naive = asyncio.create_task(shop.naive_agent(order))
    await pay.applied()
    naive.cancel()
    pay.reply_delay = 0.0
    # No receipt came back, so the naive orchestrator's record says nothing happened, and it
    # issues the refund again.
    scene.naive.unrecorded = pay.refund_count(order)
    await pay.refund(order, CENTS, idempotency_key=secrets.token_hex(8))
    scene.naive.applied = pay.refund_count(order)

    order = f"B-{secrets.token_hex(3)}"
    pay.mark()
    pay.reply_delay = 3.0
    try:
        child = await sup.delegate(shop.refund_agent, order, tools=shop.tools())
        await pay.applied()
        report = await child.terminate("operator stopped the agent")
    finally:
        pay.reply_delay = 0.0
    if not _refund_completed(report):
        await pay.refund(order, CENTS, idempotency_key=f"retry:{order}")
    probed = [a for a in report.all_actions() if a.evidence and a.tool == "refund"]
    scene.checks.append(("probe found the applied refund: COMPLETED with evidence",
                         bool(probed) and probed[0].state is ActionState.COMPLETED))
    _ledger_checks(scene, pay, order, report)
    return scene


async def scene_c(sup: Supervisor, shop: Shop) -> Scene:
    """Two orchestrator workers race to recall and re-delegate the same task."""
    scene = Scene("c", "concurrent recall and re-delegate (recall race)", Tally(), Tally())
    pay = shop.pay
    shop.lookup_delay = 0.3
    try:
        order = f"C-{secrets.token_hex(3)}"
        original = asyncio.create_task(shop.naive_agent(order))

        async def naive_worker() -> None:
            original.cancel()
            await shop.naive_agent(order)

        await asyncio.gather(naive_worker(), naive_worker())
        scene.naive.applied = pay.refund_count(order)

        order = f"C-{secrets.token_hex(3)}"
        child = await sup.delegate(shop.refund_agent, order, tools=shop.tools())
        winners: list[Report] = []
        refused: list[str] = []

        async def worker() -> None:
            try:
                await child.recall(grace=1.0, reason="re-planning")
                fresh = await child.redelegate()
            except (ControlRefused, InvalidTransition) as exc:
                refused.append(type(exc).__name__)
                return
            await fresh.wait()
            winners.append(await fresh.report())

        await asyncio.gather(worker(), worker())
    finally:
        shop.lookup_delay = 0.0
    scene.checks.append(("exactly one worker won; the other was refused",
                         len(winners) == 1 and len(refused) == 1))
    if winners:
        _ledger_checks(scene, pay, order, winners[0])
    return scene


class Desk:
    """Scene (d)'s tools: read-only research, and one write that must not happen twice."""

    def __init__(self) -> None:
        self.writes: list[str] = []

        @tool(effect=Effect.READ_ONLY)
        async def read_file(path: str) -> str:
            return f"notes from {path}"

        @tool(effect=Effect.READ_ONLY)
        async def web_fetch(url: str) -> str:
            return f"page at {url}"

        @tool(effect=Effect.EXTERNAL)
        async def write_file(path: str, text: str, *, idempotency_key: str) -> None:
            self.writes.append(path)

        @agent(tools=[read_file])
        async def git_investigator(ctx: Context, question: str) -> str:
            return str(await ctx.call(read_file, path=question))

        self.read_file, self.web_fetch, self.write_file = read_file, web_fetch, write_file
        self.git_investigator = git_investigator

    async def researcher(self, ctx: Context) -> str:
        await ctx.call(self.read_file, path="design.md")
        await (await ctx.delegate(self.git_investigator, "history")).result()
        if ctx.attempt == 1:  # an intermediary reaps the stream: no text came back
            raise StreamCut(CutReason.STREAM_INCOMPLETE)
        return "findings"

    async def writer(self, ctx: Context) -> str:
        await ctx.call(self.read_file, path="draft.md")
        await ctx.call(self.write_file, path="report.md", text="v1")
        raise StreamCut(CutReason.STREAM_INCOMPLETE)


async def scene_d(sup: Supervisor) -> Scene:
    """A cut stream with zero output: re-dispatch the read-only child, never the writer."""
    scene = Scene("d", "stream cut with zero output (blind re-dispatch)", Tally(), Tally())
    desk = Desk()
    policy = RedispatchPolicy(retry_safe=frozenset({"read_file", "web_fetch"}),
                              settle_delay=0.2)

    async def naive_writer() -> None:
        await desk.write_file.fn(path="report.md", text="v1", idempotency_key=secrets.token_hex(4))
        raise StreamCut(CutReason.STREAM_INCOMPLETE)

    for _ in range(2):  # naive: a cut child "produced nothing", so run it once more
        try:
            await naive_writer()
        except StreamCut:
            continue
    scene.naive.applied = desk.writes.count("report.md")
    desk.writes.clear()

    research = await sup.delegate(desk.researcher, redispatch=policy, model="demo-model",
                                  tools=[desk.read_file, desk.web_fetch, desk.git_investigator])
    found = await research.result()
    writer = await sup.delegate(desk.writer, redispatch=policy, model="demo-model",
                                tools=[desk.read_file, desk.write_file])
    with contextlib.suppress(DelegationError):
        await writer.result()
    events = await sup.journal.events(writer.attempts)
    codes = [e.detail.get("code") for e in events if e.kind == "redispatch_decision"]
    scene.tether.applied = desk.writes.count("report.md")
    scene.delegation, scene.outcome = writer.id, f"not re-dispatched: {', '.join(map(str, codes))}"
    scene.checks += [
        ("read-only research child re-dispatched once, as a fresh child, and succeeded",
         found == "findings" and len(research.attempts) == 2
         and research.attempts[0] != research.attempts[1]),
        ("writer not re-dispatched; the journal says why (side_effect_started)",
         len(writer.attempts) == 1 and codes == ["side_effect_started"]),
        ("the write happened exactly once", scene.tether.applied == 1),
    ]
    return scene


async def run_demo(journal_url: str, as_json: bool, console: Console) -> bool:
    pay = PaymentService(latency=0.15)
    shop = Shop(pay)
    async with Supervisor(journal_url, tools=shop.tools()) as sup:
        scenes = [await scene_a(sup, shop), await scene_b(sup, shop), await scene_c(sup, shop),
                  await scene_d(sup)]
        location = sup.journal.location
    ok = all(s.prevented for s in scenes)
    if as_json:
        sys.stdout.write(json.dumps({"journal": location, "ok": ok,
                                     "scenes": [s.to_json() for s in scenes]}, indent=2) + "\n")
        return ok
    table = Table(title="tether demo: side effects judged by the outside world's own record")
    for col in ("scene", "naive: applied / intended", "tether: applied / intended",
                "tether outcome", "prevented"):
        table.add_column(col)
    for s in scenes:
        table.add_row(safe(f"({s.id}) {s.title}"), f"[red]{s.naive.applied}[/red] / 1",
                      f"[green]{s.tether.applied}[/green] / 1", safe(s.outcome),
                      "[green]yes[/green]" if s.prevented else "[bold red]NO[/bold red]")
    console.print(table)
    for s in scenes:
        for name, passed in s.checks:
            console.print(f"  ({s.id}) {'[green]ok[/green]' if passed else '[red]FAIL[/red]'} "
                          f"{safe(name)}")
    console.print(safe(f"journal: {location}  (try: tether ls, tether show "
                       f"{scenes[0].delegation})"), soft_wrap=True)
    return ok
