"""A pydantic-ai agent (its own FunctionModel) shared by a process the tests kill and the
processes that reconcile after it: ``child`` is what a deployment names in TETHER_TOOLS.

Its refund runs in a sub-agent (``ask_billing`` delegates to ``billing``), so the probe the
next supervisor needs is that of a nested agent's tool. The payment ledger lives in a SQLite
file named by TETHER_TEST_LEDGER, so every process sees the provider's own record."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from pydantic_ai import Agent as PaiAgent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import tether
from tether.pydantic_ai import as_tether_agent, delegate, idempotency_key
from tether.testing import PaymentService

# The request applies at once; its reply never comes (the process is killed meanwhile).
pay = PaymentService(latency=0.0, reply_delay=3600.0,
                     path=os.environ.get("TETHER_TEST_LEDGER", ":memory:"))


def calls_once(tool: str, args: dict[str, Any]) -> FunctionModel:
    """A model that calls ``tool`` once, then answers."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(p, ToolReturnPart) for m in messages for p in m.parts):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart(tool, args, "c1")])

    return FunctionModel(respond)


async def refund(order_id: str, cents: int) -> str:
    """Refund an order."""
    key = idempotency_key()
    assert key is not None
    return await pay.refund(order_id, cents, idempotency_key=key)


billing = PaiAgent(calls_once("refund", {"order_id": "K-9", "cents": 700}), name="billing",
                   tools=[refund])


async def ask_billing(prompt: str) -> str:
    """Ask the billing agent."""
    return str(await delegate(billing, prompt))


main_agent = PaiAgent(calls_once("ask_billing", {"prompt": "refund K-9"}), name="desk",
                      tools=[ask_billing])
child = as_tether_agent(main_agent, probes={"refund": pay.lookup},
                        delegates={"ask_billing": billing})


async def main(journal_url: str) -> None:
    """Delegate, wait until the provider applied the refund, say so, then hang until
    killed."""
    async with tether.Supervisor(journal_url, tools=[]) as sup:
        pay.mark()
        handle = await sup.delegate(child, "refund K-9")
        await pay.applied()
        print(f"applied {handle.id}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
