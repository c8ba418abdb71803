"""LangGraph specifics beyond the conformance kit: unmediated ToolNodes refused, a tool's error
message after it ran is in doubt, bad arguments never reach the gateway, and a checkpoint thread
is the tether task, so a re-delegated run resumes and replays what completed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import interrupt

import tether
from tether.conformance import Shop
from tether.langgraph import as_tether_agent, idempotency_key, subgraph, tool_node

from .test_conformance import ScriptedChat

A = tether.ActionState


def calls(*calls: tuple[str, dict[str, Any]]) -> AIMessage:
    return AIMessage(content="", tool_calls=[
        {"name": name, "args": args, "id": f"c{n}"} for n, (name, args) in enumerate(calls)])


def graph_of(responses: list[BaseMessage], tools_node: Any, **compile_args: Any) -> Any:
    model = ScriptedChat(responses=responses)

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", tools_node)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(**compile_args)


def refund_tool(shop: Shop) -> Any:
    @lc_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        return await shop.refund(order_id, cents, idempotency_key())

    return refund


def test_a_tool_node_that_does_not_route_through_tether_is_refused() -> None:
    graph = graph_of([], ToolNode([refund_tool(Shop())]))
    with pytest.raises(tether.errors.UserError, match="ToolNode 'tools' does not route through"):
        as_tether_agent(graph)
    with pytest.raises(tether.errors.UserError, match="no tool named wire"):
        as_tether_agent(graph_of([], tool_node([refund_tool(Shop())])),
                        effects={"wire": tether.Effect.EXTERNAL})


async def test_a_tool_calling_another_tool_unmediated_is_refused(sqlite_url: str) -> None:
    ran: list[str] = []

    @lc_tool
    async def wire(to: str) -> str:
        """Wire money."""
        ran.append(to)
        return "wired"

    @lc_tool
    async def pay(to: str) -> str:
        """Pay someone (by wiring, behind tether's back)."""
        return str(await wire.ainvoke({"to": to}))

    graph = graph_of([calls(("pay", {"to": "bob"})), AIMessage(content="paid")],
                     tool_node([pay]))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(graph), "pay bob")
        with pytest.raises(tether.DelegationError, match="without passing tether's gateway"):
            await handle.result()
    assert ran == []


async def test_an_error_message_from_a_tool_that_ran_is_in_doubt_and_probed(
        sqlite_url: str) -> None:
    shop = Shop(fail=RuntimeError("reply lost"))
    graph = graph_of([calls(("refund", {"order_id": "A", "cents": 500})),
                      AIMessage(content="could not confirm")],
                     tool_node([refund_tool(shop)], handle_tool_errors=True))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(graph, probes={"refund": shop.pay.lookup}),
                                    "refund A")
        assert await handle.result() == "could not confirm"  # the model heard of the error
        report = await handle.report()
    (action,) = report.actions
    assert action.state is A.COMPLETED  # in doubt, then the provider's ledger settled it
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"


async def test_arguments_the_tool_refuses_never_reach_the_gateway(sqlite_url: str) -> None:
    shop = Shop()
    graph = graph_of([calls(("refund", {"order_id": "A", "cents": "lots"})),
                      AIMessage(content="bad call")], tool_node([refund_tool(shop)]))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(graph), "refund A")
        assert await handle.result() == "bad call"
        report = await handle.report()
    assert report.actions == () and shop.keys == []


async def test_a_re_delegated_thread_resumes_and_replays_completed_refunds(
        sqlite_url: str) -> None:
    """A completes, B hangs, the child is terminated mid-node: the checkpoint is still before
    the tools node. Re-delegating the task resumes the same thread: A's call replays its
    journaled result (the provider is not asked again), B runs for the first time."""
    shop = Shop()
    hold = asyncio.Event()

    @lc_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        if order_id == "B" and not hold.is_set():
            shop.started.set()
            await asyncio.Event().wait()  # hangs until the child is terminated
        return await shop.refund(order_id, cents, idempotency_key())

    graph = graph_of([calls(("refund", {"order_id": "A", "cents": 500}),
                            ("refund", {"order_id": "B", "cents": 500})),
                      AIMessage(content="A and B refunded")],
                     tool_node([refund]), checkpointer=InMemorySaver())
    child = as_tether_agent(graph, probes={"refund": shop.pay.lookup},
                            deadlines={"refund": 0.2})
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A and B", task_id="thread-7")
        await shop.started.wait()
        async with asyncio.timeout(30):
            while shop.pay.refund_count("A") == 0:
                await sup.wake(0.01)
        await first.terminate(reason="host going down")
        hold.set()
        second = await first.redelegate()
        assert await second.result() == "A and B refunded"
        report = await second.report()
        events = await sup.journal.events([second.id])
    assert shop.pay.refund_count("A") == 1 and shop.pay.refund_count("B") == 1
    assert [a.args["order_id"] for a in report.actions if a.state is A.COMPLETED] == ["B"]
    assert [e.kind for e in events].count("replay") == 1


@pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")
async def test_a_prebuilt_react_agent_runs_through_the_gateway(sqlite_url: str) -> None:
    from langgraph.prebuilt import create_react_agent

    shop = Shop()
    model = ScriptedChat(responses=[calls(("refund", {"order_id": "A", "cents": 500})),
                                    AIMessage(content="refunded A")])
    graph = create_react_agent(model, tools=tool_node([refund_tool(shop)]))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(graph, probes={"refund": shop.pay.lookup}),
                                    "refund A")
        assert await handle.result() == "refunded A"
        report = await handle.report()
    assert [(a.tool, a.state) for a in report.actions] == [("refund", A.COMPLETED)]
    assert shop.keys == [report.actions[0].idempotency_key]


async def test_a_subgraph_node_is_a_nested_delegation_fenced_by_the_root(
        sqlite_url: str) -> None:
    shop = Shop(gate=asyncio.Event())
    billing = graph_of([calls(("refund", {"order_id": "A", "cents": 500})),
                        calls(("refund", {"order_id": "B", "cents": 500})),
                        AIMessage(content="billing done")], tool_node([refund_tool(shop)]))
    parent = StateGraph(MessagesState)
    parent.add_node("billing", subgraph(billing, name="billing",
                                        probes={"refund": shop.pay.lookup}))
    parent.add_edge(START, "billing")
    child = as_tether_agent(parent.compile(), name="desk")
    async with tether.Supervisor(sqlite_url) as sup:
        draining = asyncio.Event()
        sup.listen(lambda event, about: draining.set() if event == "drain" else None)
        handle = await sup.delegate(child, "refund A and B")
        async with asyncio.timeout(30):
            await shop.started.wait()
        recall = asyncio.ensure_future(handle.recall(grace=30))
        async with asyncio.timeout(30):
            await draining.wait()
        shop.gate.set()  # type: ignore[union-attr]
        report = await recall
    assert report.actions == ()
    (sub,) = report.children
    assert sub.agent == "billing"
    assert [(a.args["order_id"], a.state) for a in sub.actions] == [("A", A.COMPLETED)]
    assert shop.pay.refund_count("B") == 0 and shop.keys == [sub.actions[0].idempotency_key]


async def test_a_subgraph_node_returns_its_messages_to_the_parent(sqlite_url: str) -> None:
    shop = Shop()
    billing = graph_of([calls(("refund", {"order_id": "A", "cents": 500})),
                        AIMessage(content="billing done")], tool_node([refund_tool(shop)]))
    parent = StateGraph(MessagesState)
    parent.add_node("billing", subgraph(billing, name="billing"))
    parent.add_edge(START, "billing")
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(parent.compile(), name="desk"), "refund A")
        assert await handle.result() == "billing done"
        report = await handle.report()
    (sub,) = report.children
    assert [(a.tool, a.state) for a in sub.actions] == [("refund", A.COMPLETED)]


async def test_a_resumed_thread_keys_calls_by_their_checkpoint_step_not_by_attempt(
        sqlite_url: str) -> None:
    """Step 1 refunds A (checkpointed); step 2 refunds C and B, and the recall's grace ends with
    B in flight. The re-delegated thread resumes at step 2: C has the key it had (replayed, not
    paid again), B its own (not A's ``:refund:0``, which an attempt-local count would give it),
    and A, checkpointed, is not called at all."""
    shop = Shop()
    hold, b_started = asyncio.Event(), asyncio.Event()

    @lc_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        if order_id == "B" and not hold.is_set():
            b_started.set()
            await asyncio.Event().wait()  # in flight until the grace ends
        return await shop.refund(order_id, cents, idempotency_key())

    graph = graph_of([calls(("refund", {"order_id": "A", "cents": 500})),
                      calls(("refund", {"order_id": "C", "cents": 300}),
                            ("refund", {"order_id": "B", "cents": 500})),
                      AIMessage(content="A, B and C refunded")],
                     tool_node([refund]), checkpointer=InMemorySaver())
    child = as_tether_agent(graph, probes={"refund": shop.pay.lookup},
                            deadlines={"refund": 0.2})
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A, B and C", task_id="thread-8")
        async with asyncio.timeout(30):
            await b_started.wait()
            while shop.pay.refund_count("C") == 0:
                await sup.wake(0.01)
        recalled = await first.recall(grace=0.1, reason="host going down")
        hold.set()
        second = await first.redelegate()
        assert await second.result() == "A, B and C refunded"
        report = await second.report()
        events = await sup.journal.events([second.id])
    assert [a.args["order_id"] for a in recalled.actions] == ["A", "C", "B"]
    assert [shop.pay.refund_count(o) for o in "ABC"] == [1, 1, 1]
    keys = [a.idempotency_key for a in (*recalled.actions, *report.actions)]
    assert len(set(keys[:3])) == 3 and set(keys[3:]) <= set(keys[1:3])  # C and B keep theirs
    assert [a.args["order_id"] for a in report.actions if a.state is A.COMPLETED] == ["B"]
    assert [e.kind for e in events].count("replay") == 1  # C


def reviewed_graph(responses: list[BaseMessage], tools_node: Any, **compile_args: Any) -> Any:
    """agent -> review -> tools -> agent: a person approves any refund of 1000 cents or more
    (``interrupt``) before the tools node runs it; "no" ends the run."""
    model = ScriptedChat(responses=responses)

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    async def review(state: MessagesState) -> dict[str, Any]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        big = [c for c in last.tool_calls if c["args"]["cents"] >= 1000]
        if big and interrupt({"approve": [c["args"]["order_id"] for c in big]}) != "yes":
            return {"messages": [AIMessage(content="declined")]}
        return {}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "tools" if getattr(last, "tool_calls", None) else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("review", review)
    graph.add_node("tools", tools_node)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "review", END: END})
    graph.add_conditional_edges("review", route)
    graph.add_edge("tools", "agent")
    return graph.compile(**compile_args)


def big_refund_graph(shop: Shop, **compile_args: Any) -> Any:
    return reviewed_graph([calls(("refund", {"order_id": "A", "cents": 500})),
                           calls(("refund", {"order_id": "B", "cents": 5000})),
                           AIMessage(content="A and B refunded")],
                          tool_node([refund_tool(shop)]), **compile_args)


async def test_an_interrupted_graph_waits_for_input_and_resumes_with_the_answer(
        sqlite_url: str) -> None:
    """A is refunded, then the graph stops at ``interrupt()`` to ask about B: the task is
    INTERRUPTED with the question, not SUCCEEDED with ''. ``redelegate(resume="yes")`` runs the
    thread on from the interrupt with the answer: B is refunded, A is not paid again."""
    shop = Shop()
    child = as_tether_agent(big_refund_graph(shop, checkpointer=InMemorySaver()),
                            probes={"refund": shop.pay.lookup})
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A and B", task_id="thread-9")
        asked = await first.result()
        waiting = await first.report()
        assert isinstance(asked, tether.Interrupted)
        assert list(asked.questions.values()) == [{"approve": ["B"]}]
        assert waiting.outcome is tether.DelegationState.INTERRUPTED
        second = await first.redelegate(resume="yes")
        assert await second.result() == "A and B refunded"
        report = await second.report()
    assert report.outcome is tether.DelegationState.SUCCEEDED
    assert [a.args["order_id"] for a in waiting.actions] == ["A"]
    assert [a.args["order_id"] for a in report.actions] == ["B"]
    assert [shop.pay.refund_count(o) for o in "AB"] == [1, 1]


async def test_an_answer_is_given_only_to_a_task_that_waits_for_one(sqlite_url: str) -> None:
    shop = Shop()
    child = as_tether_agent(big_refund_graph(shop, checkpointer=InMemorySaver()))
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(child, "refund A and B")
        assert isinstance(await first.result(), tether.Interrupted)
        with pytest.raises(tether.errors.UserError, match="waits for input: redelegate"):
            await first.redelegate()
        with pytest.raises(tether.errors.UserError, match="cannot be serialized"):
            await first.redelegate(resume=object())
        second = await first.redelegate(resume="no")
        assert await second.result() == "declined"
        with pytest.raises(tether.errors.UserError, match="does not wait for input"):
            await second.redelegate(resume="yes")
    assert [shop.pay.refund_count(o) for o in "AB"] == [1, 0]


async def test_an_interrupt_without_a_checkpointer_fails_clearly(sqlite_url: str) -> None:
    shop = Shop()
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(big_refund_graph(shop)), "refund A and B")
        with pytest.raises(tether.DelegationError, match=r"interrupt\(\) and has no checkpointer"):
            await handle.result()


def two_questions_graph(saver: Any) -> Any:
    """Two nodes run at once from the start, each asking at ``interrupt()``; a third joins."""
    def ask(order: str) -> Any:
        def node(state: MessagesState) -> dict[str, Any]:
            return {"messages": [AIMessage(content=f"{order}={interrupt(f'approve {order}?')}")]}
        return node

    def join(state: MessagesState) -> dict[str, Any]:
        return {"messages": [AIMessage(content="joined")]}

    g = StateGraph(MessagesState)
    g.add_node("ask_a", ask("A"))
    g.add_node("ask_b", ask("B"))
    g.add_node("join", join)
    g.add_edge(START, "ask_a")
    g.add_edge(START, "ask_b")
    g.add_edge(["ask_a", "ask_b"], "join")
    g.add_edge("join", END)
    return g.compile(checkpointer=saver)


async def test_interrupts_of_parallel_nodes_are_all_asked_and_all_answered(
        sqlite_url: str) -> None:
    """Both questions are reported (the stream's last chunk had only one), and a task with one
    answered and one not still waits: it is never SUCCEEDED while its thread waits (a review
    found 'SUCCEEDED' with the join never run)."""
    saver = InMemorySaver()
    graph = two_questions_graph(saver)
    async with tether.Supervisor(sqlite_url) as sup:
        first = await sup.delegate(as_tether_agent(graph, name="two-q"), "go", task_id="q")
        asked = await first.result()
        assert isinstance(asked, tether.Interrupted)
        by_text = {v: k for k, v in asked.questions.items()}
        assert set(by_text) == {"approve A?", "approve B?"}
        with pytest.raises(tether.errors.UserError, match="several questions"):
            await first.redelegate(resume="yes")
        second = await first.redelegate(resume={by_text["approve A?"]: "yes"})
        still = await second.result()
        assert isinstance(still, tether.Interrupted), still
        assert list(still.questions.values()) == ["approve B?"]
        assert (await second.report()).outcome is tether.DelegationState.INTERRUPTED
        third = await second.redelegate(resume="no")
        done = await third.result()
        assert (await third.report()).outcome is tether.DelegationState.SUCCEEDED
    state = await graph.aget_state({"configurable": {"thread_id": "q"}})
    assert not state.next and not state.interrupts
    assert [m.content for m in state.values["messages"]][-3:] == ["A=yes", "B=no", "joined"] \
        or [m.content for m in state.values["messages"]][-3:] == ["B=no", "A=yes", "joined"]
    assert done == "joined"
