"""``Agent.as_tool`` under tether, with the SDK's own ScriptedModel: each option the SDK takes
is honoured (the output extractor, max turns, the failure function, structured parameters)
or refused when the tether agent is built, naming it; a clean recall of sub-agents running
in parallel is quiet (the SDK logs no fatal background failure) and honest."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from agents import Agent as SdkAgent
from agents import (
    RunConfig,
    RunHooks,
    RunResult,
    RunResultStreaming,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from agents.agent_tool_input import build_structured_input_schema_info, resolve_agent_tool_input
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from pydantic import BaseModel, TypeAdapter

import tether
from tether.openai_agents import as_tether_agent, idempotency_key
from tether.testing import PaymentService

from .conftest import until

set_tracing_disabled(True)


def answers(text: str) -> ScriptedModel:
    return ScriptedModel([[assistant_message(text)]])


def calls(tool: str, args: dict[str, Any]) -> ScriptedModel:
    """A root model that calls ``tool`` once; with stop_on_first_tool, the tool's output is
    the run's final output, so the test reads what the tool returned to its caller."""
    return ScriptedModel([[function_call(tool, args, call_id="r1")]])


async def test_custom_output_extractor_gives_the_tools_result(sqlite_url: str) -> None:
    sub = SdkAgent(name="sub", model=answers("the sub-agent's answer"))

    async def extract(result: RunResult | RunResultStreaming) -> str:
        return f"extracted: {result.final_output}"

    root = SdkAgent(name="root", model=calls("ask", {"input": "go"}),
                    tools=[sub.as_tool("ask", "Ask the sub-agent.",
                                       custom_output_extractor=extract)],
                    tool_use_behavior="stop_on_first_tool")
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(root), "go")
        assert await handle.result() == "extracted: the sub-agent's answer"
        report = await handle.report()
    (child,) = report.children  # the sub-agent's own delegation keeps its own output
    assert child.outcome is tether.DelegationState.SUCCEEDED
    assert child.result == "the sub-agent's answer"


async def test_max_turns_of_as_tool_bounds_the_sub_agents_run(sqlite_url: str) -> None:
    @function_tool
    async def lookup(order_id: str) -> str:
        """Look an order up."""
        return "found"

    sub = SdkAgent(name="sub", tools=[lookup], model=ScriptedModel([
        [function_call("lookup", {"order_id": "A"}, call_id="s1")],
        [assistant_message("two turns")]]))
    root = SdkAgent(name="root", model=calls("ask", {"input": "go"}),
                    tools=[sub.as_tool("ask", "Ask.", max_turns=1)],
                    tool_use_behavior="stop_on_first_tool")
    agent = as_tether_agent(root, effects={"lookup": tether.Effect.READ_ONLY})
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(agent, "go")
        said = await handle.result()
        report = await handle.report()
    (child,) = report.children
    assert child.outcome is tether.DelegationState.FAILED, child
    assert "max_turns" in (child.error or ""), child
    assert said.startswith("An error occurred while running the tool")  # the SDK default


async def test_run_config_and_hooks_of_as_tool_run_the_sub_agent(sqlite_url: str) -> None:
    started: list[str] = []

    class Seen(RunHooks[Any]):
        async def on_agent_start(self, context: Any, agent: Any) -> None:
            started.append(agent.name)

    sub = SdkAgent(name="sub")  # no model of its own: the tool's run config gives it one
    root = SdkAgent(name="root", model=calls("ask", {"input": "go"}),
                    tools=[sub.as_tool("ask", "Ask.", hooks=Seen(), run_config=RunConfig(
                        model=answers("from the tool's run config"), tracing_disabled=True))],
                    tool_use_behavior="stop_on_first_tool")
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(root), "go")
        assert await handle.result() == "from the tool's run config"
    assert started == ["sub"]  # the tool's hooks, for the sub-agent's run only


async def test_failure_error_function_of_as_tool_tells_the_model(sqlite_url: str) -> None:
    sub = SdkAgent(name="sub", model=ScriptedModel([ModelStep.raise_error(
        RuntimeError("the sub-agent's model broke"))]))

    def say(ctx: Any, error: Exception) -> str:
        return f"custom: {type(error).__name__}"

    root = SdkAgent(name="root", model=calls("ask", {"input": "go"}),
                    tools=[sub.as_tool("ask", "Ask.", failure_error_function=say)],
                    tool_use_behavior="stop_on_first_tool")
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(root), "go")
        assert await handle.result() == "custom: DelegationError"


class Lookup(BaseModel):
    order_id: str
    reason: str


async def test_structured_parameters_reach_the_sub_agent_as_the_sdk_builds_them(
        sqlite_url: str) -> None:
    sub = SdkAgent(name="sub", model=answers("looked"))
    arguments = {"order_id": "A-1", "reason": "late"}
    root = SdkAgent(name="root", model=calls("ask", arguments),
                    tools=[sub.as_tool("ask", "Ask.", parameters=Lookup)],
                    tool_use_behavior="stop_on_first_tool")
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(root), "go")
        assert await handle.result() == "looked"
        (child,) = (await handle.report()).children
        row = await sup.journal.get(child.delegation_id)
    schema = TypeAdapter(Lookup).json_schema()
    expected = await resolve_agent_tool_input(
        params=arguments, schema_info=build_structured_input_schema_info(
            schema, include_json_schema=False))
    assert row.args["args"] == [expected]


@pytest.mark.parametrize(("option", "value"), [
    ("session", SQLiteSession("s")),
    ("previous_response_id", "resp_1"),
    ("conversation_id", "conv_1"),
    ("on_stream", lambda event: None),
    ("needs_approval", True),
])
def test_options_tether_cannot_honour_are_refused_when_built(option: str, value: Any) -> None:
    sub = SdkAgent(name="sub", model=answers("x"))
    root = SdkAgent(name="root", model=answers("x"),
                    tools=[sub.as_tool("ask", "Ask.", **{option: value})])
    with pytest.raises(tether.errors.UserError) as caught:
        as_tether_agent(root)
    message = str(caught.value)
    assert f"Agent.as_tool({option}=...)" in message and "\n" not in message, message
    assert "tool ask of agent root" in message


async def recall_sub_agents(url: str, n: int) -> tuple[tether.Report, PaymentService]:
    """One model turn calls ``n`` sub-agents, each with a refund in flight; a recall lets them
    all finish."""
    pay = PaymentService(latency=0.0)
    gate, started = asyncio.Event(), [asyncio.Event() for _ in range(n)]

    def sub(i: int) -> SdkAgent[Any]:
        @function_tool(name_override="refund")
        async def refund(order_id: str, cents: int) -> str:
            """Refund an order."""
            started[i].set()
            await gate.wait()
            key = idempotency_key()
            assert key is not None
            return await pay.refund(order_id, cents, idempotency_key=key)

        return SdkAgent(name=f"sub{i}", tools=[refund], model=ScriptedModel([
            [function_call("refund", {"order_id": f"A{i}", "cents": 5}, call_id="s")],
            [assistant_message("refunded")]]))

    root = SdkAgent(name="root", tools=[sub(i).as_tool(f"ask{i}", "Ask.") for i in range(n)],
                    model=ScriptedModel([
                        [function_call(f"ask{i}", {"input": "go"}, call_id=f"r{i}")
                         for i in range(n)],
                        [assistant_message("never reached")]]))
    agent = as_tether_agent(root, probes={"refund": pay.lookup})
    async with tether.Supervisor(url) as sup:
        handle = await sup.delegate(agent, "refund both")
        await asyncio.gather(*(s.wait() for s in started))
        recall = asyncio.ensure_future(handle.recall(grace=30, reason="re-plan"))
        # The drain has stopped the subtree: each sub-agent meets the stop at its next step,
        # once its refund is done.
        await until(lambda: getattr(sup.runtime(handle.id), "stop", None) is not None,
                    "the recall's drain stopped the children")
        gate.set()
        report = await recall
    # Whatever the SDK left running has ended (and reported anything it had to say).
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=10)
    return report, pay


async def test_a_clean_recall_of_parallel_sub_agents_is_quiet_and_honest(
        sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two sub-agents in parallel, ten times: the SDK logs nothing (it logged a fatal
    background failure with its traceback when a tool raised the stop into its tool task as
    the run was torn down), and the report says what happened."""
    caplog.set_level(logging.WARNING)
    for attempt in range(10):
        report, pay = await recall_sub_agents(sqlite_url, 2)
        assert report.outcome is tether.DelegationState.RECALLED, (attempt, report)
        assert [c.outcome for c in report.children] == [tether.DelegationState.RECALLED] * 2
        assert [a.state.value for c in report.children for a in c.actions] == [
            "COMPLETED"] * 2
        assert [pay.refund_count(f"A{i}") for i in range(2)] == [1] * 2
        loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records
                if r.levelno >= logging.ERROR or "fatal" in r.getMessage()]
        assert not loud, (attempt, loud)
