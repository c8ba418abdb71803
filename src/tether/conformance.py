"""One conformance kit for every agent-framework adapter.

An adapter's author writes a ``Harness``: given a ``Shop`` (a payment provider with its own
ledger) and a script of model turns, it returns a tether agent that runs the framework's own
offline test model on that script, with a ``refund`` tool whose body is ``Shop.refund``. The
kit then runs the same scenarios against it and judges each by the journal and the ledger:

    for name in scenarios(harness):
        await run_scenario(name, harness, "sqlite:///journal.db")

Scenarios a framework cannot express (nesting, handoffs, structured output) are listed by the
harness's flags (``structured`` may be left out: False). A harness with ``nesting`` also plays
``Together`` (sub-agents called in one model turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tether._core.errors import DelegationError, ToolRejected, UserError
from tether._core.model import ACTION_FINAL, ActionState, DelegationState, Policy
from tether._core.redispatch import Code, Partial, RedispatchPolicy
from tether._core.report import Report
from tether._runtime.declared import TOOLS_ENV
from tether._runtime.handle import Handle
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent
from tether.testing import PaymentService


@dataclass(frozen=True)
class Refund:
    """A model turn that calls ``refund(order_id=order, cents=500)``."""

    order: str


@dataclass(frozen=True)
class Say:
    """A model turn that answers ``text`` and ends the run."""

    text: str


@dataclass(frozen=True)
class Cut:
    """A model call that fails in transit (the framework's own transport error)."""


@dataclass(frozen=True)
class Nested:
    """A model turn that calls a sub-agent (as a tool) that runs ``steps`` on its own model."""

    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Together:
    """A model turn that calls several sub-agents (as tools) at once, the first ``Nested`` as
    the tool ``sub_agent_0``, the next ``sub_agent_1``..."""

    calls: tuple[Nested, ...]


@dataclass(frozen=True)
class Handoff:
    """A model turn that hands the conversation to another agent, which runs ``steps``."""

    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Answer:
    """A model turn that ends the run with the structured output ``RefundReceipt(order, 500)``
    (the agent declares ``RefundReceipt`` as its output type)."""

    order: str


@dataclass(frozen=True)
class RefundReceipt:
    """The structured output of ``Answer``: a dataclass, which pydantic validates."""

    order_id: str
    cents: int


Step = Refund | Say | Cut | Nested | Together | Handoff | Answer


@dataclass(eq=False)
class Shop:
    """The outside world: a payment provider with its own ledger, plus the knobs the scenarios
    turn (hold a refund at ``gate``, raise ``fail`` after the provider applied it)."""

    pay: PaymentService = field(default_factory=lambda: PaymentService(latency=0.0))
    gate: asyncio.Event | None = None
    fail: BaseException | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    keys: list[str | None] = field(default_factory=list)

    async def refund(self, order_id: str, cents: int, key: str | None) -> str:
        """The body of every adapter's refund tool; ``key`` is the adapter's
        ``idempotency_key()`` inside the tool."""
        self.keys.append(key)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if key is None:
            raise AssertionError("the tool ran without an idempotency key (not mediated)")
        if isinstance(self.fail, ToolRejected):
            raise self.fail
        ref = await self.pay.refund(order_id, cents, idempotency_key=key)
        if self.fail is not None:
            raise self.fail
        return ref


class Harness(Protocol):
    name: str
    nesting: bool  # the framework has sub-agents called as tools
    handoffs: bool  # the framework hands a conversation to another agent
    # (optional) structured: the framework's agents declare an output type (Answer steps)

    def agent(self, shop: Shop, steps: Sequence[Step], *, deadline: float = 30.0,
              unmediated: bool = False) -> Agent | Awaitable[Agent]:
        """A tether agent running ``steps`` on the framework's test model, with ``refund``
        probed by ``shop.pay.lookup`` and past its dispatch deadline ``deadline`` seconds after
        its intent. ``unmediated``: also give the agent a tool tether cannot see (raise
        UserError if the adapter refuses such an agent). A harness whose agents hold
        resources (a session) may be async and define ``async def aclose()``, called after
        each scenario."""
        ...


# The scenarios run in one process, which writes and judges each dispatch deadline on its own
# clock: the clock tolerance for other hosts' clocks (5 s by default) would only delay the
# re-probe past the deadline.
ONE_CLOCK = Policy(clock_tolerance=0.25)


async def _make(h: Harness, shop: Shop, steps: Sequence[Step], **options: Any) -> Agent:
    made = h.agent(shop, steps, **options)
    return await made if inspect.isawaitable(made) else made


def refunds(report: Report) -> list[tuple[str, ActionState]]:
    return [(a.args["order_id"], a.state) for a in report.actions]


async def _settled(sup: Supervisor, delegation_id: str) -> Report:
    """The report once the delegation and its actions are settled: the owner probes calls
    left in doubt again at their dispatch deadlines, in the background."""
    async with asyncio.timeout(30):
        while True:
            report = await sup.report(delegation_id)
            if report.outcome.terminal and all(a.state in ACTION_FINAL for a in report.actions):
                return report
            await sup.wake(0.02)


async def _recall_draining(sup: Supervisor, handle: Handle, grace: float) -> Any:
    """Start a recall and return once its drain began (the fence is closed)."""
    draining = asyncio.Event()

    def listener(event: str, about: str) -> None:
        if event == "drain" and about == handle.id:
            draining.set()

    sup.listen(listener)
    recall = asyncio.ensure_future(handle.recall(grace, reason="re-plan"))
    async with asyncio.timeout(30):
        await draining.wait()
    return recall


class _Loud(logging.Handler):
    """Records at ERROR and above, from any logger (a framework's, asyncio's)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(f"{record.name}: {record.getMessage()}")


@contextlib.asynccontextmanager
async def _quiet() -> AsyncIterator[None]:
    """A recall is quiet: nothing the scenario leaves running (the framework's own tasks
    included) logs an error once it ends, as a framework does for a stop raised into its
    background tasks."""
    loud = _Loud()
    before = asyncio.all_tasks()
    logging.getLogger().addHandler(loud)
    try:
        yield
        others = asyncio.all_tasks() - before
        if others:
            await asyncio.wait(others, timeout=5)
    finally:
        logging.getLogger().removeHandler(loud)
    assert not loud.said, loud.said


async def through_the_gateway(h: Harness, url: str) -> None:
    shop = Shop()
    async with Supervisor(url) as sup:
        agent = await _make(h, shop, [Refund("A"), Say("refunded A")])
        handle = await sup.delegate(agent, "refund A")
        assert await handle.result() == "refunded A"
        report = await handle.report()
    assert refunds(report) == [("A", ActionState.COMPLETED)], report
    assert shop.keys == [report.actions[0].idempotency_key]
    assert shop.pay.refund_count("A") == 1


async def recall_in_flight(h: Harness, url: str) -> None:
    shop = Shop(gate=asyncio.Event())
    agent = await _make(h, shop, [Refund("A"), Refund("B"), Say("done")])
    async with _quiet(), Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A then B")
        await shop.started.wait()
        recall = await _recall_draining(sup, handle, 30)
        shop.gate.set()  # type: ignore[union-attr]
        report = await recall
    assert report.outcome is DelegationState.RECALLED, report
    assert refunds(report) == [("A", ActionState.COMPLETED)]
    assert shop.pay.refund_count("B") == 0


async def terminate_probed(h: Harness, url: str) -> None:
    shop = Shop(gate=asyncio.Event())  # never set: the refund hangs before the provider
    agent = await _make(h, shop, [Refund("A"), Say("done")], deadline=0.5)
    async with Supervisor(url, policy=ONE_CLOCK) as sup:
        handle = await sup.delegate(agent, "refund A")
        await shop.started.wait()
        report = await handle.terminate(reason="stop")
        if not report.outcome.terminal:
            report = await _settled(sup, handle.id)
    (action,) = report.actions
    assert action.state is ActionState.NOT_APPLIED, report
    assert action.evidence is not None and action.evidence["probe"] == "NOT_APPLIED"
    assert shop.pay.refund_count("A") == 0


async def cut_before_any_tool(h: Harness, url: str) -> None:
    shop = Shop()
    agent = await _make(h, shop, [Cut(), Refund("A"), Say("refunded A")])
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A",
                                    redispatch=RedispatchPolicy(settle_delay=0.001))
        assert await handle.result() == "refunded A"
        events = await sup.journal.events(handle.attempts)
        attempts = handle.attempts
    assert len(attempts) == 2
    codes = [e.detail["code"] for e in events if e.kind == "redispatch_decision"]
    assert codes[0] == Code.REDISPATCH_NO_TOOL_RAN.value
    assert shop.pay.refund_count("A") == 1


async def cut_after_a_side_effect(h: Harness, url: str) -> None:
    shop = Shop()
    agent = await _make(h, shop, [Refund("A"), Cut()])
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A",
                                    redispatch=RedispatchPolicy(settle_delay=0.001))
        partial = await handle.result()
        report = await handle.report()
        events = await sup.journal.events(handle.attempts)
        attempts = handle.attempts
    assert len(attempts) == 1 and isinstance(partial, Partial)
    assert report.outcome is DelegationState.SUCCEEDED_PARTIAL
    assert [e.detail["code"] for e in events if e.kind == "redispatch_decision"] == [
        Code.PARTIAL_SALVAGED.value]
    assert shop.pay.refund_count("A") == 1


async def raises_after_applying(h: Harness, url: str) -> None:
    shop = Shop(fail=RuntimeError("reply lost"))
    async with Supervisor(url) as sup:
        handle = await sup.delegate(await _make(h, shop, [Refund("A"), Say("could not confirm")]),
                                    "refund A")
        with contextlib.suppress(DelegationError):  # the run may end, or tell the model
            await handle.result()
        report = await _settled(sup, handle.id)
    (action,) = report.actions
    assert action.state is ActionState.COMPLETED, report  # applied, despite the exception
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"


async def rejected_is_failed(h: Harness, url: str) -> None:
    """FAILED where the framework can say "certainly not applied"; a protocol that cannot
    (MCP's isError) leaves it in doubt until the probe finds it NOT_APPLIED."""
    shop = Shop(fail=ToolRejected("card declined"))
    async with Supervisor(url, policy=ONE_CLOCK) as sup:
        handle = await sup.delegate(
            await _make(h, shop, [Refund("A"), Say("declined")], deadline=0.5), "refund A")
        with contextlib.suppress(DelegationError):
            await handle.result()
        report = await _settled(sup, handle.id)
    not_applied = ([("A", ActionState.FAILED)], [("A", ActionState.NOT_APPLIED)])
    assert refunds(report) in not_applied, report
    assert shop.pay.refund_count("A") == 0


async def unmediated_never_re_dispatched(h: Harness, url: str) -> None:
    shop = Shop()
    try:
        agent = await _make(h, shop, [Cut(), Say("never reached")], unmediated=True)
    except UserError:
        return  # refused before it could run: as good
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "look it up", redispatch=RedispatchPolicy(
            retry_safe=frozenset({"refund"}), settle_delay=0.001))
        with contextlib.suppress(DelegationError):
            await handle.result()
        attempts = handle.attempts
        events = await sup.journal.events(attempts)
    assert len(attempts) == 1
    codes = [e.detail["code"] for e in events if e.kind == "redispatch_decision"]
    assert codes and codes[0] != Code.REDISPATCH_NO_TOOL_RAN.value


async def nested_own_keys(h: Harness, url: str) -> None:
    shop = Shop()
    agent = await _make(h, shop, [Nested((Refund("A"), Refund("B"), Say("A and B"))),
                                  Say("all done")])
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A and B")
        assert await handle.result() == "all done"
        report = await handle.report()
    (sub,) = report.children
    assert refunds(sub) == [("A", ActionState.COMPLETED), ("B", ActionState.COMPLETED)]
    keys = [a.idempotency_key for a in sub.actions]
    assert len(set(keys)) == 2 and shop.keys == keys


async def nested_fenced_by_root_recall(h: Harness, url: str) -> None:
    shop = Shop(gate=asyncio.Event())
    agent = await _make(h, shop, [Nested((Refund("A"), Refund("B"), Say("done"))), Say("done")])
    async with _quiet(), Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A and B")
        await shop.started.wait()
        recall = await _recall_draining(sup, handle, 30)
        shop.gate.set()  # type: ignore[union-attr]
        report = await recall
    (sub,) = report.children
    assert refunds(sub) == [("A", ActionState.COMPLETED)], report
    assert shop.pay.refund_count("B") == 0


async def parallel_nested_recall_is_quiet(h: Harness, url: str) -> None:
    """Two sub-agents called in one model turn, each with a refund in flight; the recall's
    drain has stopped them both when the refunds go on. Both refunds complete, both
    sub-agents end RECALLED, and nothing is logged (a stop raised into the framework's
    parallel tool tasks was logged by the Agents SDK as a fatal background failure)."""
    for _ in range(5):  # which sub-agent stops first differs from run to run
        shop = Shop(gate=asyncio.Event())
        agent = await _make(h, shop, [Together((Nested((Refund("A"), Say("a"))),
                                                Nested((Refund("B"), Say("b"))))),
                                      Say("done")])
        async with _quiet(), Supervisor(url) as sup:
            handle = await sup.delegate(agent, "refund A and B")
            async with asyncio.timeout(30):
                while len(shop.keys) < 2:
                    await sup.wake(0.01)
            recall = asyncio.ensure_future(handle.recall(30, reason="re-plan"))
            async with asyncio.timeout(30):
                while getattr(sup.runtime(handle.id), "stop", None) is None:
                    await sup.wake(0.01)
            shop.gate.set()  # type: ignore[union-attr]
            report = await recall
        assert report.outcome is DelegationState.RECALLED, report
        assert sorted(o for c in report.children for o in refunds(c)) == [
            ("A", ActionState.COMPLETED), ("B", ActionState.COMPLETED)], report
        assert [c.outcome for c in report.children] == [DelegationState.RECALLED] * 2
        assert shop.pay.refund_count("A") == shop.pay.refund_count("B") == 1


async def handoff_mediated(h: Harness, url: str) -> None:
    shop = Shop()
    agent = await _make(h, shop, [Handoff((Refund("A"), Say("refunded A")))])
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A")
        assert await handle.result() == "refunded A"
        report = await handle.report()
    assert refunds(report) == [("A", ActionState.COMPLETED)]
    assert shop.keys == [report.actions[0].idempotency_key]


async def keys_unique_across_nesting(h: Harness, url: str) -> None:
    shop = Shop()
    agent = await _make(h, shop, [Refund("A"), Nested((Refund("A"), Say("again"))), Say("done")])
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A twice")
        assert await handle.result() == "done"
        report = await handle.report()
    (sub,) = report.children
    keys = [a.idempotency_key for a in (*report.actions, *sub.actions)]
    assert len(keys) == 2 and len(set(keys)) == 2 and shop.keys == keys
    assert shop.pay.refund_count("A") == 2  # two refunds asked for, two distinct keys


async def structured_output(h: Harness, url: str) -> None:
    """A declared output type comes back as itself, rebuilt from the JSON the journal keeps."""
    shop = Shop()
    agent = await _make(h, shop, [Refund("A"), Answer("A")])
    async with Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund A")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
        report = await handle.report()
    assert result == RefundReceipt("A", 500) and type(result) is RefundReceipt, result
    assert row.result == {"order_id": "A", "cents": 500}, row.result
    assert refunds(report) == [("A", ActionState.COMPLETED)]


# Where the next supervisor finds the agent's tools in the scenarios below: what a deployment
# names in $TETHER_TOOLS (here, this module's attribute, as a new process would import it).
DECLARED: list[Agent] = []


def _all_actions(report: Report) -> list[Any]:
    return [*report.actions, *(a for c in report.children for a in _all_actions(c))]


async def _probed_by_the_next_supervisor(h: Harness, url: str, steps: Sequence[Step]) -> None:
    """A terminate leaves a refund in doubt (not applied yet, before its deadline); the request
    then lands at the provider and the supervisor closes. The next ``Supervisor(journal)``,
    told where the agent's tools live by ``$TETHER_TOOLS`` alone, probes it: COMPLETED."""
    shop = Shop(gate=asyncio.Event())  # never set: the reply never comes
    async with Supervisor(url) as sup:
        handle = await sup.delegate(await _make(h, shop, steps), "refund A")
        await shop.started.wait()
        report = await handle.terminate(reason="stop")
    (action,) = _all_actions(report)
    assert action.state is ActionState.IN_DOUBT, report
    await shop.pay.refund("A", 500, idempotency_key=action.idempotency_key)  # it lands
    DECLARED[:] = [await _make(h, Shop(pay=shop.pay), steps)]  # as a new process builds it
    saved = os.environ.get(TOOLS_ENV)
    os.environ[TOOLS_ENV] = f"{__name__}:DECLARED"
    try:
        async with Supervisor(url) as sup:
            report = await sup.report(handle.id)
    finally:
        DECLARED.clear()
        if saved is None:
            del os.environ[TOOLS_ENV]
        else:
            os.environ[TOOLS_ENV] = saved
    (action,) = _all_actions(report)
    assert action.state is ActionState.COMPLETED, report
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"
    # The node that holds the call was probed (RECONCILED), the ones above it terminated.
    assert report.outcome in (DelegationState.TERMINATED, DelegationState.RECONCILED), report
    assert DelegationState.NEEDS_ATTENTION not in {c.outcome for c in report.children}, report


async def probed_by_the_next_supervisor(h: Harness, url: str) -> None:
    await _probed_by_the_next_supervisor(h, url, [Refund("A"), Say("done")])


async def nested_probed_by_the_next_supervisor(h: Harness, url: str) -> None:
    await _probed_by_the_next_supervisor(h, url, [Nested((Refund("A"), Say("done"))),
                                                  Say("done")])


Scenario = Callable[[Harness, str], Awaitable[None]]
BASIC: dict[str, Scenario] = {
    "through_the_gateway": through_the_gateway,
    "recall_in_flight": recall_in_flight,
    "terminate_probed": terminate_probed,
    "cut_before_any_tool": cut_before_any_tool,
    "cut_after_a_side_effect": cut_after_a_side_effect,
    "raises_after_applying": raises_after_applying,
    "rejected_is_failed": rejected_is_failed,
    "unmediated_never_re_dispatched": unmediated_never_re_dispatched,
    "probed_by_the_next_supervisor": probed_by_the_next_supervisor,
}
NESTING: dict[str, Scenario] = {
    "nested_own_keys": nested_own_keys,
    "nested_fenced_by_root_recall": nested_fenced_by_root_recall,
    "keys_unique_across_nesting": keys_unique_across_nesting,
    "nested_probed_by_the_next_supervisor": nested_probed_by_the_next_supervisor,
    "parallel_nested_recall_is_quiet": parallel_nested_recall_is_quiet,
}
HANDOFFS: dict[str, Scenario] = {"handoff_mediated": handoff_mediated}
STRUCTURED: dict[str, Scenario] = {"structured_output": structured_output}


def scenarios(harness: Harness) -> list[str]:
    """The scenarios that apply to ``harness``."""
    names = list(BASIC)
    if harness.nesting:
        names += list(NESTING)
    if harness.handoffs:
        names += list(HANDOFFS)
    if getattr(harness, "structured", False):
        names += list(STRUCTURED)
    return names


async def run_scenario(name: str, harness: Harness, journal_url: str) -> None:
    """Run one scenario; an AssertionError says what the adapter got wrong."""
    scenario = {**BASIC, **NESTING, **HANDOFFS, **STRUCTURED}[name]
    try:
        await scenario(harness, journal_url)
    finally:
        aclose = getattr(harness, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["Answer", "Cut", "Handoff", "Harness", "Nested", "Refund", "RefundReceipt", "Say",
           "Shop", "Step", "Together", "run_scenario", "scenarios"]
