"""pydantic-ai specifics beyond the conformance kit: ModelRetry did not apply (FAILED), a run
the application cancels is a ceiling (never re-dispatched), toolsets tether cannot mediate are
refused, and the agent's own tools and dependencies reach the run."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_ai import Agent as PaiAgent
from pydantic_ai import ModelRetry, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import ExternalToolset

import tether
from tether.conformance import Shop
from tether.pydantic_ai import as_tether_agent, idempotency_key

A = tether.ActionState


def scripted(*responses: ModelResponse) -> FunctionModel:
    queue = list(responses)

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return queue.pop(0)

    return FunctionModel(respond)


def refund_call(order: str, cents: int = 500) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart("refund", {"order_id": order, "cents": cents})])


async def test_model_retry_did_not_apply(sqlite_url: str) -> None:
    shop = Shop()
    agent = PaiAgent(scripted(refund_call("A", 0), refund_call("A", 500),
                              ModelResponse(parts=[TextPart("refunded")])), name="refunder")

    @agent.tool_plain
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        if cents <= 0:
            raise ModelRetry("cents must be positive")
        return await shop.refund(order_id, cents, idempotency_key())

    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent, probes={"refund": shop.pay.lookup}),
                                    "refund A")
        assert await handle.result() == "refunded"
        report = await handle.report()
    assert [(a.args["cents"], a.state) for a in report.actions] == [
        (0, A.FAILED), (500, A.COMPLETED)]
    assert shop.pay.refund_count("A") == 1


async def test_a_run_the_application_cancels_is_never_re_dispatched(sqlite_url: str) -> None:
    agent: PaiAgent[None, str] = PaiAgent(
        scripted(ModelResponse(parts=[ToolCallPart("stop", {})]),
                 ModelResponse(parts=[TextPart("never")])), name="stopper")

    @agent.tool
    async def stop(ctx: RunContext[None]) -> str:
        """Give up."""
        ctx.cancel()
        return "stopping"

    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent, effects={
            "stop": tether.Effect.READ_ONLY}), "go",
            redispatch=tether.RedispatchPolicy(settle_delay=0.001))
        with pytest.raises(tether.DelegationError, match="RunCancelled"):
            await handle.result()
        events = await sup.journal.events(handle.attempts)
    assert len(handle.attempts) == 1
    assert [e.detail["code"] for e in events if e.kind == "redispatch_decision"] == [
        tether.Code.CEILING.value]


def test_a_toolset_tether_cannot_mediate_is_refused() -> None:
    agent = PaiAgent(scripted(), name="a", toolsets=[ExternalToolset([])])
    with pytest.raises(tether.UserError, match="cannot mediate toolset ExternalToolset"):
        as_tether_agent(agent)
    with pytest.raises(tether.UserError, match="no tool named wire"):
        as_tether_agent(PaiAgent(scripted(), name="b"), effects={"wire": tether.Effect.EXTERNAL})


async def test_deps_and_events_reach_the_run(sqlite_url: str) -> None:
    agent: PaiAgent[dict[str, str], str] = PaiAgent(
        scripted(ModelResponse(parts=[ToolCallPart("whoami", {})]),
                 ModelResponse(parts=[TextPart("you are acct-7")])),
        name="a", deps_type=dict)
    nodes: list[Any] = []

    @agent.tool
    async def whoami(ctx: RunContext[dict[str, str]]) -> str:
        """The caller's account."""
        return ctx.deps["account"]

    child = as_tether_agent(agent, effects={"whoami": tether.Effect.READ_ONLY},
                            deps={"account": "acct-7"}, on_event=nodes.append)
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, "who am I?")
        assert await handle.result() == "you are acct-7"
    assert len(nodes) >= 3
