"""The conformance kit (tether.conformance) against every adapter, each with its framework's
own offline test model and a ledger of its own."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from typing import Any

import httpx2
import pytest
from agents import Agent as SdkAgent
from agents import WebSearchTool, function_tool, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import tool as lc_tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from mcp import ClientSession
from mcp.client import Client
from mcp.server.mcpserver import Context as McpContext
from mcp.server.mcpserver import MCPServer
from pydantic_ai import Agent as PaiAgent
from pydantic_ai import Tool as PaiTool
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import tether
import tether.langgraph
import tether.openai_agents
import tether.pydantic_ai
from tether.conformance import (
    Answer,
    Cut,
    Handoff,
    Harness,
    Nested,
    Refund,
    RefundReceipt,
    Say,
    Shop,
    Step,
    Together,
    run_scenario,
    scenarios,
)
from tether.mcp import ServerPolicy, mcp_tools

set_tracing_disabled(True)


class AgentsSdk:
    name = "openai-agents"
    nesting = True
    handoffs = True
    structured = True

    def agent(self, shop: Shop, steps: Sequence[Step], *, deadline: float = 30.0,
              unmediated: bool = False) -> tether.Agent:
        @function_tool
        async def refund(order_id: str, cents: int) -> str:
            """Refund an order."""
            return await shop.refund(order_id, cents, tether.openai_agents.idempotency_key())

        ids = itertools.count()
        extra: list[Any] = [WebSearchTool()] if unmediated else []

        def build(name: str, steps: Sequence[Step]) -> SdkAgent[Any]:
            script: list[Any] = []
            tools: list[Any] = [refund, *extra]
            handoffs: list[Any] = []
            output: Any = None
            for step in steps:
                call_id = f"c{next(ids)}"
                if isinstance(step, Refund):
                    script.append([function_call(
                        "refund", {"order_id": step.order, "cents": 500}, call_id=call_id)])
                elif isinstance(step, Say):
                    script.append([assistant_message(step.text)])
                elif isinstance(step, Cut):
                    script.append(ModelStep.raise_error(httpx2.ConnectError("refused")))
                elif isinstance(step, Nested):
                    sub = build(f"{name}_sub", step.steps)
                    tools.append(sub.as_tool("sub_agent", "Does part of the work."))
                    script.append([function_call("sub_agent", {"input": "go"},
                                                 call_id=call_id)])
                elif isinstance(step, Together):
                    calls = []
                    for n, nested in enumerate(step.calls):
                        sub = build(f"{name}_sub{n}", nested.steps)
                        tools.append(sub.as_tool(f"sub_agent_{n}", "Does part of the work."))
                        calls.append(function_call(f"sub_agent_{n}", {"input": "go"},
                                                   call_id=f"{call_id}_{n}"))
                    script.append(calls)
                elif isinstance(step, Handoff):
                    helper = build(f"{name}_helper", step.steps)
                    handoffs.append(helper)
                    script.append([function_call(f"transfer_to_{helper.name}", {},
                                                 call_id=call_id)])
                elif isinstance(step, Answer):  # a dataclass: the SDK wraps it in "response"
                    output = RefundReceipt
                    script.append([assistant_message(json.dumps(
                        {"response": {"order_id": step.order, "cents": 500}}))])
            return SdkAgent(name=name, tools=tools, handoffs=handoffs,
                            model=ScriptedModel(script), output_type=output)

        return tether.openai_agents.as_tether_agent(
            build("main", steps), probes={"refund": shop.pay.lookup},
            deadlines={"refund": deadline}, unmediated=["web_search"] if unmediated else ())


class ScriptedChat(FakeMessagesListChatModel):
    """langchain-core's fake chat model, able to bind tools and to fail in transit."""

    failures: dict[int, BaseException] = {}  # noqa: RUF012 - a pydantic field

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> Any:
        failure = self.failures.pop(self.i, None)
        if failure is not None:
            self.i += 1
            raise failure
        return super()._generate(messages, stop, run_manager, **kwargs)


class LangGraph:
    name = "langgraph"
    nesting = False
    handoffs = False

    def agent(self, shop: Shop, steps: Sequence[Step], *, deadline: float = 30.0,
              unmediated: bool = False) -> tether.Agent:
        @lc_tool
        async def refund(order_id: str, cents: int) -> str:
            """Refund an order."""
            return await shop.refund(order_id, cents, tether.langgraph.idempotency_key())

        @lc_tool
        async def search(query: str) -> str:
            """Search the web."""
            return "nothing"

        responses: list[BaseMessage] = []
        failures: dict[int, BaseException] = {}
        for n, step in enumerate(steps):
            if isinstance(step, Refund):
                responses.append(AIMessage(content="", tool_calls=[{
                    "name": "refund", "args": {"order_id": step.order, "cents": 500},
                    "id": f"c{n}"}]))
            elif isinstance(step, Say):
                responses.append(AIMessage(content=step.text))
            elif isinstance(step, Cut):
                failures[n] = ConnectionRefusedError("refused")
                responses.append(AIMessage(content="(never seen)"))
        model = ScriptedChat(responses=responses, failures=failures)

        async def call_model(state: MessagesState) -> dict[str, Any]:
            return {"messages": [await model.ainvoke(state["messages"])]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", call_model)
        graph.add_node("tools", tether.langgraph.tool_node([refund]))
        graph.add_edge(START, "agent")
        graph.add_conditional_edges("agent", tools_condition)
        graph.add_edge("tools", "agent")
        if unmediated:
            graph.add_node("search", ToolNode([search]))
        return tether.langgraph.as_tether_agent(
            graph.compile(), probes={"refund": shop.pay.lookup}, deadlines={"refund": deadline})


def delegating(sub: PaiAgent[None, str]) -> Any:
    async def sub_agent(prompt: str) -> str:
        """Does part of the work."""
        return str(await tether.pydantic_ai.delegate(sub, prompt))

    return sub_agent


class PydanticAi:
    name = "pydantic-ai"
    nesting = True
    handoffs = False
    structured = True

    def agent(self, shop: Shop, steps: Sequence[Step], *, deadline: float = 30.0,
              unmediated: bool = False) -> tether.Agent:
        if unmediated:  # pydantic-ai's hosted tools are toolsets tether refuses
            raise tether.errors.UserError("no unmediated tool in a pydantic-ai agent")
        ids = itertools.count()
        subs: dict[str, PaiAgent[None, Any]] = {}

        async def refund(order_id: str, cents: int) -> str:
            """Refund an order."""
            return await shop.refund(order_id, cents, tether.pydantic_ai.idempotency_key())

        def build(name: str, steps: Sequence[Step]) -> PaiAgent[None, Any]:
            responses: list[ModelResponse | BaseException] = []
            tools: list[Any] = [refund]
            output: Any = str
            for step in steps:
                call_id = f"c{next(ids)}"
                if isinstance(step, Refund):
                    responses.append(ModelResponse(parts=[ToolCallPart(
                        "refund", {"order_id": step.order, "cents": 500}, call_id)]))
                elif isinstance(step, Say):
                    responses.append(ModelResponse(parts=[TextPart(step.text)]))
                elif isinstance(step, Cut):
                    responses.append(ConnectionRefusedError("refused"))
                elif isinstance(step, Nested):
                    subs["sub_agent"] = build(f"{name}_sub", step.steps)
                    tools.append(delegating(subs["sub_agent"]))
                    responses.append(ModelResponse(parts=[ToolCallPart(
                        "sub_agent", {"prompt": "go"}, call_id)]))
                elif isinstance(step, Together):
                    parts = []
                    for n, nested in enumerate(step.calls):
                        subs[f"sub_agent_{n}"] = build(f"{name}_sub{n}", nested.steps)
                        tools.append(PaiTool(delegating(subs[f"sub_agent_{n}"]),
                                             name=f"sub_agent_{n}"))
                        parts.append(ToolCallPart(f"sub_agent_{n}", {"prompt": "go"},
                                                  f"{call_id}_{n}"))
                    responses.append(ModelResponse(parts=parts))
                elif isinstance(step, Answer):
                    output = RefundReceipt
                    responses.append(ModelResponse(parts=[ToolCallPart(
                        "final_result", {"order_id": step.order, "cents": 500}, call_id)]))

            def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
                step = responses.pop(0)
                if isinstance(step, BaseException):
                    raise step
                return step

            return PaiAgent(FunctionModel(respond), name=name, tools=tools, output_type=output)

        main = build("main", steps)
        return tether.pydantic_ai.as_tether_agent(
            main, probes={"refund": shop.pay.lookup}, deadlines={"refund": deadline},
            delegates=subs)


class McpGateway:
    """tether's MCP gateway in front of a real MCP server (in process, over the SDK's memory
    transport), driven by a plain tether agent that plays the script as a model would."""

    name = "mcp-gateway"
    nesting = True
    handoffs = False

    def __init__(self) -> None:
        self._open: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def _session(self, server: MCPServer) -> ClientSession:
        ready: asyncio.Future[ClientSession] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()

        async def hold() -> None:  # entered and left in one task, as anyio requires
            async with Client(server) as client:
                ready.set_result(client.session)
                await stop.wait()

        task = asyncio.create_task(hold())
        self._open.append((stop, task))
        waiting: set[asyncio.Future[Any]] = {ready, task}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            task.result()  # raises why the session did not open
        return ready.result()

    async def aclose(self) -> None:
        for stop, task in self._open:
            stop.set()
            await task
        self._open.clear()

    async def agent(self, shop: Shop, steps: Sequence[Step], *, deadline: float = 30.0,
                    unmediated: bool = False) -> tether.Agent:
        server = MCPServer("shop")

        @server.tool()
        async def refund(order_id: str, cents: int, ctx: McpContext) -> str:
            meta = ctx.request_context.meta or {}
            key = meta.get("io.tether/idempotency-key")
            return await shop.refund(order_id, cents, key if isinstance(key, str) else None)

        (tool,) = await mcp_tools(await self._session(server), ServerPolicy(
            "shop", probes={"refund": shop.pay.lookup}, deadlines={"refund": deadline}))
        extra = ("web_search",) if unmediated else ()

        def build(name: str, steps: Sequence[Step]) -> tether.Agent:
            script = list(steps)  # shared by the attempts, as a scripted model is
            subs = {n: build(f"{name}_sub", step.steps)
                    for n, step in enumerate(steps) if isinstance(step, Nested)}
            together = {(n, i): build(f"{name}_sub{i}", nested.steps)
                        for n, step in enumerate(steps) if isinstance(step, Together)
                        for i, nested in enumerate(step.calls)}

            async def run(ctx: tether.Context, request: str) -> Any:
                results: list[Any] = []
                while script:
                    n, step = len(steps) - len(script), script.pop(0)
                    if isinstance(step, Refund):
                        results.append(await ctx.call(tool, order_id=step.order, cents=500))
                    elif isinstance(step, Say):
                        return step.text
                    elif isinstance(step, Cut):
                        raise tether.StreamCut(tether.protocol.CutReason.CONNECT_ERROR,
                                               tether.protocol.Partial("", tuple(results)))
                    elif isinstance(step, Nested):
                        handle = await ctx.delegate(subs[n], "go")
                        results.append(await handle.result())
                    elif isinstance(step, Together):
                        async def one(sub: tether.Agent) -> Any:
                            return await (await ctx.delegate(sub, "go")).result()

                        results.extend(await asyncio.gather(*(
                            one(together[n, i]) for i in range(len(step.calls)))))
                return None

            return tether.Agent(name, run, (tool, *subs.values(), *together.values(), *extra))

        return build("main", steps)


HARNESSES: list[Harness] = [AgentsSdk(), LangGraph(), PydanticAi(), McpGateway()]
CASES = [(h, s) for h in HARNESSES for s in scenarios(h)]


@pytest.mark.parametrize(("harness", "scenario"), CASES,
                         ids=[f"{h.name}-{s}" for h, s in CASES])
async def test_conformance(harness: Harness, scenario: str, sqlite_url: str) -> None:
    await run_scenario(scenario, harness, sqlite_url)
