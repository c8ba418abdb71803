"""OpenTelemetry through the adapters, with each framework's own test model: the model's id
for a tool call is the call span's ``gen_ai.tool.call.id`` (tether's action id its own
``tether.action.id``); with pydantic-ai's own instrumentation on, its model spans nest under
tether's and each operation has one span (tether's), in each trace."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from agents import Agent as SdkAgent
from agents import function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call
from langchain_core.messages import AIMessage
from langchain_core.tools import tool as lc_tool
from pydantic_ai import Agent as PaiAgent
from pydantic_ai.capabilities.instrumentation import Instrumentation
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings, InstrumentedModel

import tether
import tether.agents
import tether.langgraph
import tether.pydantic_ai
from tether.conformance import Shop

from .otel_helpers import Otel, attempt_of, new_otel, parent_of
from .test_langgraph import graph_of

set_tracing_disabled(True)  # offline: the Agents SDK would try to export its own traces


@pytest.fixture
def otel() -> Otel:
    return new_otel()


def supervisor(sqlite_url: str, otel: Otel) -> tether.Supervisor:
    return tether.Supervisor(sqlite_url, tracer_provider=otel.tracer, meter_provider=otel.meter)


def the_refund_span(otel: Otel, report: tether.Report) -> Any:
    """The one execute_tool span of the run (whoever made it), checked against the journal."""
    (span,) = otel.operation("execute_tool")
    (action,) = report.actions
    assert span.name == "execute_tool refund"
    assert (span.attributes or {}).get("tether.action.id") == action.id
    return span


def pydantic_agent(shop: Shop, otel: Otel, how: str) -> PaiAgent[None, str]:
    queue = [ModelResponse(parts=[ToolCallPart("refund", {"order_id": "A", "cents": 500},
                                               tool_call_id="call_refund_A")]),
             ModelResponse(parts=[TextPart("refunded A")])]

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return queue.pop(0)

    settings = InstrumentationSettings(tracer_provider=otel.tracer)
    model = FunctionModel(respond)
    agent: PaiAgent[None, str] = PaiAgent(
        InstrumentedModel(model, settings) if how == "model" else model, name="refunder",
        capabilities=[Instrumentation(settings=settings)] if how == "capability" else [])
    if how == "instrument":
        agent.instrument = settings
    inner = otel.tracer.get_tracer("app")

    @agent.tool_plain
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        with inner.start_as_current_span("POST /refunds"):
            return await shop.refund(order_id, cents, tether.pydantic_ai.idempotency_key())

    return agent


@pytest.mark.parametrize("how", ["instrument", "instrument_all", "model"])
async def test_pydantic_ai_instrumented_runs_nest_with_one_span_per_operation(
        sqlite_url: str, otel: Otel, how: str) -> None:
    shop = Shop()
    agent = tether.pydantic_ai.as_tether_agent(pydantic_agent(shop, otel, how),
                                               probes={"refund": shop.pay.lookup})
    if how == "instrument_all":
        PaiAgent.instrument_all(InstrumentationSettings(tracer_provider=otel.tracer))
    try:
        async with supervisor(sqlite_url, otel) as sup:
            handle = await sup.delegate(agent, "refund A")
            assert await handle.result() == "refunded A"
            report = await handle.report()
    finally:
        PaiAgent.instrument_all(False)

    attempt = attempt_of(otel, "refunder")
    per_trace = Counter(s.context.trace_id for s in otel.operation("invoke_agent"))
    assert sorted(per_trace.values()) == [1, 1]  # the delegation's, the attempt's: tether's
    assert per_trace[attempt.context.trace_id] == 1
    paid = the_refund_span(otel, report)
    assert (paid.attributes or {}).get("gen_ai.tool.call.id") == "call_refund_A"
    assert (paid.attributes or {}).get("tether.outcome") == "COMPLETED"
    assert parent_of(paid) == attempt.context.span_id
    chats = otel.operation("chat")  # pydantic-ai's own model request spans, kept
    assert len(chats) == 2 and all(parent_of(c) == attempt.context.span_id for c in chats)
    (post,) = otel.named("POST /refunds")
    assert parent_of(post) == paid.context.span_id


async def test_pydantic_ai_instrumentation_capability_of_its_own_nests(sqlite_url: str,
                                                                      otel: Otel) -> None:
    """An agent's own Instrumentation capability is kept (a run may hold no other class under
    its id): its spans nest under tether's."""
    shop = Shop()
    agent = tether.pydantic_ai.as_tether_agent(pydantic_agent(shop, otel, "capability"),
                                               probes={"refund": shop.pay.lookup})
    async with supervisor(sqlite_url, otel) as sup:
        handle = await sup.delegate(agent, "refund A")
        assert await handle.result() == "refunded A"
    attempt = attempt_of(otel, "refunder")
    (run,) = [s for s in otel.operation("invoke_agent")  # pydantic-ai's run span
              if "tether.task" not in (s.attributes or {})]
    assert parent_of(run) == attempt.context.span_id


async def test_pydantic_ai_tool_call_id_without_its_instrumentation(sqlite_url: str,
                                                                   otel: Otel) -> None:
    shop = Shop()
    pai = pydantic_agent(shop, otel, "off")
    agent = tether.pydantic_ai.as_tether_agent(pai, probes={"refund": shop.pay.lookup})
    async with supervisor(sqlite_url, otel) as sup:
        handle = await sup.delegate(agent, "refund A")
        await handle.result()
        report = await handle.report()
    paid = the_refund_span(otel, report)
    assert (paid.attributes or {}).get("gen_ai.tool.call.id") == "call_refund_A"
    assert not otel.operation("chat")  # its instrumentation is off: none of its spans


async def test_agents_sdk_tool_call_id(sqlite_url: str, otel: Otel) -> None:
    shop = Shop()

    @function_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        return await shop.refund(order_id, cents, tether.agents.idempotency_key())

    model = ScriptedModel([
        [function_call("refund", {"order_id": "A", "cents": 500}, call_id="call_sdk_A")],
        [assistant_message("refunded A")]])
    sdk = SdkAgent(name="refunder", instructions="Refund.", tools=[refund], model=model)
    agent = tether.agents.as_tether_agent(sdk, probes={"refund": shop.pay.lookup})
    async with supervisor(sqlite_url, otel) as sup:
        handle = await sup.delegate(agent, "refund A")
        assert await handle.result() == "refunded A"
        report = await handle.report()
    paid = the_refund_span(otel, report)
    assert (paid.attributes or {}).get("gen_ai.tool.call.id") == "call_sdk_A"


async def test_langgraph_tool_call_id(sqlite_url: str, otel: Otel) -> None:
    shop = Shop()

    @lc_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        return await shop.refund(order_id, cents, tether.langgraph.idempotency_key())

    graph = graph_of([
        AIMessage(content="", tool_calls=[
            {"name": "refund", "args": {"order_id": "A", "cents": 500}, "id": "call_lg_A"}]),
        AIMessage(content="refunded A")], tether.langgraph.tool_node([refund]))
    agent = tether.langgraph.as_tether_agent(graph, probes={"refund": shop.pay.lookup})
    async with supervisor(sqlite_url, otel) as sup:
        handle = await sup.delegate(agent, "refund A")
        await handle.result()
        report = await handle.report()
    paid = the_refund_span(otel, report)
    assert (paid.attributes or {}).get("gen_ai.tool.call.id") == "call_lg_A"
