"""A pydantic-ai agent as a tether child, offline: pydantic-ai's FunctionModel stands in for
the model. The model first asks for a refund of 0 cents; the tool answers ModelRetry, which
tether records as FAILED (it did not apply); the corrected refund then goes through the
gateway with its key, and the provider's ledger holds exactly one refund.

    python examples/pydantic_ai_refund.py   (needs pip install 'tether[pydantic-ai]')
"""

from __future__ import annotations

import asyncio
import os
import tempfile

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import tether
from tether.pydantic_ai import as_tether_agent, idempotency_key
from tether.testing import PaymentService

pay = PaymentService(latency=0.0)
script = [
    ModelResponse(parts=[ToolCallPart("refund", {"order_id": "A-1001", "cents": 0})]),
    ModelResponse(parts=[ToolCallPart("refund", {"order_id": "A-1001", "cents": 1250})]),
    ModelResponse(parts=[TextPart("Refunded 12.50 on A-1001.")]),
]


def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return script.pop(0)


agent = Agent(FunctionModel(scripted), name="refunder",
              instructions="Refund what the user asks for.")


@agent.tool_plain
async def refund(order_id: str, cents: int) -> str:
    """Refund an order at the payment provider."""
    if cents <= 0:
        raise ModelRetry("the amount must be positive")  # nothing was sent
    key = idempotency_key()  # the provider deduplicates on it
    assert key is not None
    return await pay.refund(order_id, cents, idempotency_key=key)


refunder = as_tether_agent(agent, effects={"refund": tether.Effect.EXTERNAL},
                           probes={"refund": pay.lookup})


async def main() -> None:
    async with tether.Supervisor("sqlite:///journal.db") as sup:
        handle = await sup.delegate(refunder, "Please refund order A-1001.")
        print("result:", await handle.result())
        report = await handle.report()
        print(f"{report.outcome.value}:",
              [(a.tool, a.args["cents"], a.state.value) for a in report.actions])
    print("provider ledger:", [(e.order_id, e.cents) for e in pay.entries()])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        asyncio.run(main())
