"""pydantic-ai on Temporal through its own integration (``TemporalDurability``: model
requests and tool calls become activities), under tether's Temporal plugin: a support agent
on pydantic-ai's test model (``FunctionModel``) that refunds an order, and its workflow.

The workflow sandbox imports this module again (``workflow.unsafe.imports_passed_through``
in ``temporal_pai_flows``): the provider is set by the test, in the worker's process."""

from __future__ import annotations

from pydantic_ai import Agent, RunContext
from pydantic_ai.durable_exec.temporal import TemporalDurability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import tether
import tether.temporal
from tests.temporal_world import Provider

# pydantic-ai names its activities after the agent: a model request reads, it pays nothing
# (READ_ONLY: fenced, not journaled).
EFFECTS = {"agent__support__model_request": tether.Effect.READ_ONLY}
REFUND = "agent__support__toolset__<agent>__call_tool"


class World:
    provider: Provider | None = None
    requests = 0  # the model requests that reached the model


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The model: refund the order named, then say so."""
    World.requests += 1
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("refund", {"order_id": "P-1", "cents": 1250})])
    return ModelResponse(parts=[TextPart("refunded P-1")])


agent = Agent(FunctionModel(script), name="support", deps_type=type(None),
              capabilities=[TemporalDurability()])


@agent.tool
async def refund(ctx: RunContext[None], order_id: str, cents: int) -> str:
    """The provider's refund, under the key tether gave this activity."""
    provider = World.provider
    assert provider is not None, "the test sets the provider"
    key = tether.temporal.idempotency_key()
    provider.keys.append(key)
    ref = await provider.pay.refund(order_id, cents, idempotency_key=key)
    if provider.hold is not None:
        await provider.hold.wait()
    return ref
