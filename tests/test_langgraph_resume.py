"""LangGraph resumes that must neither pay twice nor skip a payment: a subgraph run again in a
later step, a checkpoint thread the checkpointer lost, a static breakpoint; and a task waiting
for input that stays recognisably waiting (and only such a task) once its calls are probed."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import interrupt

import tether
from tether.conformance import Shop
from tether.langgraph import as_tether_agent, subgraph, tool_node

from .test_langgraph import calls, graph_of, refund_tool, reviewed_graph

A = tether.ActionState


class FreshIdsChat(BaseChatModel):
    """A model as real providers serve one: each answer's tool calls get fresh ids. It refunds
    A (500), then B (5000), then says so, judging by the tool results it has seen."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    @property
    def _llm_type(self) -> str:
        return "fresh-ids"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        done = sum(isinstance(m, ToolMessage) for m in messages)
        todo = [("A", 500), ("B", 5000)][done:]
        message = AIMessage(content="A and B refunded") if not todo else AIMessage(
            content="", tool_calls=[{"name": "refund", "id": f"call_{uuid.uuid4().hex}",
                                     "args": {"order_id": todo[0][0], "cents": todo[0][1]}}])
        return ChatResult(generations=[ChatGeneration(message=message)])


class BillingChat(FreshIdsChat):
    """Refunds A (500) under a fresh tool call id, then says it is done."""

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        message = AIMessage(content="billing done") if isinstance(messages[-1], ToolMessage) \
            else AIMessage(content="", tool_calls=[{"name": "refund", "id": uuid.uuid4().hex,
                                                    "args": {"order_id": "A", "cents": 500}}])
        return ChatResult(generations=[ChatGeneration(message=message)])



def twice_billed_desk(shop: Shop, **deadlines: float) -> Any:
    """desk: ``first`` (the billing subgraph refunds A 500), ``ask`` (interrupt: another
    refund?), ``second`` (billing again: another refund of A 500, a payment of its own)."""
    model = BillingChat()

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    billing = StateGraph(MessagesState)
    billing.add_node("agent", call_model)
    billing.add_node("tools", tool_node([refund_tool(shop)]))
    billing.add_edge(START, "agent")
    billing.add_conditional_edges("agent", tools_condition)
    billing.add_edge("tools", "agent")
    sub = subgraph(billing.compile(), name="billing", probes={"refund": shop.pay.lookup},
                   deadlines=deadlines)

    def ask(state: MessagesState) -> dict[str, Any]:
        interrupt("another refund of A?")
        return {}

    desk = StateGraph(MessagesState)
    desk.add_node("first", sub)
    desk.add_node("ask", ask)
    desk.add_node("second", sub)
    desk.add_edge(START, "first")
    desk.add_edge("first", "ask")
    desk.add_edge("ask", "second")
    desk.add_edge("second", END)
    return desk.compile(checkpointer=InMemorySaver())


async def test_a_subgraph_run_again_in_a_later_step_makes_its_own_payment(
        sqlite_url: str) -> None:
    """The resumed run's first subgraph delegation is the ``second`` step's: counted from 0 in
    the new attempt, it would take the ``first`` step's task and keys, and its refund would be
    "replayed" from the first one, never made. A subgraph's task is named by its step's place
    in the thread, so the second refund is paid, under a key of its own."""
    shop = Shop()
    child = as_tether_agent(twice_billed_desk(shop), name="desk")
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A", task_id="desk-1")
        assert isinstance(await first.result(), tether.Interrupted)
        before = await first.report()
        second = await first.redelegate(resume="yes")
        assert await second.result() == "billing done"
        after = await second.report()
        events = await sup.journal.events([c.delegation_id for c in after.children])
    assert [[a.state for a in c.actions] for c in after.children] == [[A.COMPLETED]]
    ((paid,),) = [c.actions for c in before.children]
    ((again,),) = [c.actions for c in after.children]
    assert again.idempotency_key != paid.idempotency_key
    assert shop.pay.refund_count("A") == 2
    assert "replay" not in [e.kind for e in events]


async def test_a_subgraph_step_done_again_keeps_its_keys(sqlite_url: str) -> None:
    """The ``second`` step's refund is in flight when the task is terminated; re-delegated,
    the thread does that step again, as the same nested task: its call keeps its key (probed:
    it never reached the provider, so it runs now), not the ``first`` step's, already paid."""
    shop = Shop()
    child = as_tether_agent(twice_billed_desk(shop, refund=0.2), name="desk")
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A", task_id="desk-2")
        assert isinstance(await first.result(), tether.Interrupted)
        shop.gate, shop.started = asyncio.Event(), asyncio.Event()
        second = await first.redelegate(resume="yes")
        async with asyncio.timeout(30):
            await shop.started.wait()
        stopped = await second.terminate(reason="host going down")
        shop.gate.set()
        third = await second.redelegate()
        assert await third.result() == "billing done"
        done = await third.report()
    assert shop.pay.refund_count("A") == 2
    (cut,) = [a for c in stopped.children for a in c.actions]
    (paid,) = [a for c in done.children for a in c.actions]
    assert paid.idempotency_key == cut.idempotency_key and paid.state is A.COMPLETED


async def test_a_place_that_is_not_letters_and_digits_is_refused(sqlite_url: str) -> None:
    async def helper(ctx: tether.Context) -> str:
        return "helped"

    inner = tether.Agent("helper", helper, ())

    async def outer(ctx: tether.Context) -> Any:
        with pytest.raises(tether.errors.UserError, match="place must be letters and digits"):
            await ctx.delegate_at("a/b#0", inner)
        return await (await ctx.delegate_at("step7", inner)).result()

    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(tether.Agent("outer", outer, (inner,)))
        assert await handle.result() == "helped"
        (child,) = (await handle.report()).children
    assert child.task_id.endswith("/helper@step7")

@pytest.mark.parametrize("breakpoint", ["interrupt_before", "interrupt_after"])
def test_a_static_breakpoint_is_refused_when_the_agent_is_built(breakpoint: str) -> None:
    """A graph stopped at a static breakpoint returned its state so far as a SUCCEEDED result,
    its next step (the refund) silently never run: ``interrupt()`` is what waits for input."""
    graph = graph_of([], tool_node([refund_tool(Shop())]), checkpointer=InMemorySaver(),
                     **{breakpoint: ["tools"]})
    with pytest.raises(tether.errors.UserError, match=f"static breakpoint \\({breakpoint}\\) at "
                       "'tools': use interrupt"):
        as_tether_agent(graph)

def fresh_ids_graph(shop: Shop, saver: InMemorySaver) -> Any:
    model = FreshIdsChat()

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def review(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        if any(c["args"]["cents"] >= 1000 for c in last.tool_calls):
            interrupt("approve?")
        return {}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("review", review)
    graph.add_node("tools", tool_node([refund_tool(shop)]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges(
        "agent", lambda s: "review" if s["messages"][-1].tool_calls else END)
    graph.add_edge("review", "tools")
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=saver)


async def test_a_thread_the_checkpointer_lost_is_not_started_over(sqlite_url: str) -> None:
    """A is refunded, the graph waits for approval of B, and the checkpointer loses the thread
    (another process's in-memory saver, a deleted thread). Starting the graph over would have
    the model ask for A again under a fresh tool call id, so a new key: A paid twice, and the
    answer given to nobody. The resume is refused instead, in one line."""
    shop, saver = Shop(), InMemorySaver()
    child = as_tether_agent(fresh_ids_graph(shop, saver), probes={"refund": shop.pay.lookup})
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A and B", task_id="thread-lost")
        assert isinstance(await first.result(), tether.Interrupted)
        await saver.adelete_thread("thread-lost")
        second = await first.redelegate(resume="yes")
        with pytest.raises(tether.DelegationError, match="checkpoint thread 'thread-lost' is "
                           "empty, yet the task ran before"):
            await second.result()
        report = await second.report()
    assert report.actions == ()
    assert [shop.pay.refund_count(o) for o in "AB"] == [1, 0]


async def test_an_interrupted_task_whose_call_was_probed_still_waits(sqlite_url: str) -> None:
    """A's refund answered an error after it applied: in doubt, probed, COMPLETED. The task
    then stopped to ask about B. It waits for an answer still: INTERRUPTED (never pruned,
    shown as waiting), not RECONCILED as if it were done."""
    shop = Shop(fail=RuntimeError("reply lost"))
    graph = reviewed_graph([calls(("refund", {"order_id": "A", "cents": 500})),
                            calls(("refund", {"order_id": "B", "cents": 5000})),
                            AIMessage(content="A and B refunded")],
                           tool_node([refund_tool(shop)], handle_tool_errors=True),
                           checkpointer=InMemorySaver())
    child = as_tether_agent(graph, probes={"refund": shop.pay.lookup})
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A and B")
        assert isinstance(await first.result(), tether.Interrupted)
        await first.wait()
        report = await first.report()
        assert [(a.state, a.evidence is not None) for a in report.actions] == \
            [(A.COMPLETED, True)]
        assert report.outcome is tether.DelegationState.INTERRUPTED
        later = time.time() + 3600
        assert await sup.journal.prunable([first.id], later, later) == []
        shop.fail = None
        second = await first.redelegate(resume="yes")
        assert await second.result() == "A and B refunded"
        # Answered: the first attempt waits for nothing now, and goes with its task.
        # Answered: both epochs go together (the second replays the first's receipts).
        assert await sup.journal.prunable([first.id], later, later) == [first.id, second.id]
    assert [shop.pay.refund_count(o) for o in "AB"] == [1, 1]


async def test_an_interrupted_task_a_probe_could_not_settle_asks_again(
        sqlite_url: str) -> None:
    """A's refund is UNKNOWN (its probe cannot tell): the task needs a person, NEEDS_ATTENTION.
    Re-delegated without an answer, the thread, still at its interrupt, asks again; answered,
    it goes on, A's step (checkpointed as done) not run again."""
    shop = Shop(fail=RuntimeError("reply lost"))

    async def unsure(**_: Any) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.UNKNOWN, {"provider": "down"})

    graph = reviewed_graph([calls(("refund", {"order_id": "A", "cents": 500})),
                            calls(("refund", {"order_id": "B", "cents": 5000})),
                            AIMessage(content="A and B refunded")],
                           tool_node([refund_tool(shop)], handle_tool_errors=True),
                           checkpointer=InMemorySaver())
    child = as_tether_agent(graph, probes={"refund": unsure}, deadlines={"refund": 0.2})
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A and B")
        asked = await first.result()
        await first.wait()
        assert (await first.report()).outcome is tether.DelegationState.NEEDS_ATTENTION
        shop.fail = None
        second = await first.redelegate()
        assert await second.result() == asked
        third = await second.redelegate(resume="yes")
        assert await third.result() == "A and B refunded"
    assert [shop.pay.refund_count(o) for o in "AB"] == [1, 1]


async def test_a_reconciled_result_shaped_like_questions_is_not_taken_for_them(
        sqlite_url: str) -> None:
    """A plain agent's result that happens to be ``{"interrupted": {...}}``, its delegation
    RECONCILED because a call was probed, is a result: the task is re-delegated as any other,
    not refused as waiting for input."""
    shop = Shop(fail=RuntimeError("reply lost"))

    async def pay(order_id: str, cents: int, idempotency_key: str) -> str:
        return await shop.refund(order_id, cents, idempotency_key)

    refund = tether.Tool("refund", tether.Effect.EXTERNAL, pay, probe=shop.pay.lookup)

    async def clerk(ctx: tether.Context, order: str) -> Any:
        with contextlib.suppress(RuntimeError):  # the reply was lost: tether probes it
            await ctx.call(refund, order_id=order, cents=500)
        return {"interrupted": {"by": "the customer"}}

    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(tether.Agent("clerk", clerk, (refund,)), "A")
        await first.wait()
        assert (await first.report()).outcome is tether.DelegationState.RECONCILED
        with pytest.raises(tether.errors.UserError, match="does not wait for input"):
            await first.redelegate(resume="yes")
        second = await first.redelegate()
        assert await second.result() == {"interrupted": {"by": "the customer"}}
    assert shop.pay.refund_count("A") == 1


async def test_two_calls_of_one_step_under_one_id_are_refused_before_either_runs(
        sqlite_url: str) -> None:
    """A checkpointed call's key is its step and its tool call id, which the model chooses: two
    calls of one step under one id shared a key, the second refused midway (different
    arguments) or "replayed" from the first (the same ones), never made. The step is refused
    before either runs."""
    shop = Shop()
    step = AIMessage(content="", tool_calls=[
        {"name": "refund", "args": {"order_id": "A", "cents": 500}, "id": "call_1"},
        {"name": "refund", "args": {"order_id": "B", "cents": 500}, "id": "call_1"}])
    graph = graph_of([step, AIMessage(content="done")], tool_node([refund_tool(shop)]),
                     checkpointer=InMemorySaver())
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(graph), "refund A and B")
        with pytest.raises(tether.DelegationError, match="tool call id 'call_1' to two calls"):
            await handle.result()
        report = await handle.report()
    assert report.actions == () and shop.keys == []
