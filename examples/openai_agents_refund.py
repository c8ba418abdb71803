"""An OpenAI Agents SDK agent as a tether child, offline: the SDK's ScriptedModel stands in
for the model. A triage agent hands the conversation off to a refunder. The first model call
is cut in transit before any tool ran, so tether re-dispatches a fresh attempt; the handoff
target's refund then goes through the gateway with its key, like any tool the agent can reach.

    python examples/openai_agents_refund.py   (needs pip install 'tether[openai-agents]')
"""

from __future__ import annotations

import asyncio
import os
import tempfile

import httpx2
from agents import Agent, function_tool, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

import tether
from tether.openai_agents import as_tether_agent, idempotency_key
from tether.testing import PaymentService

set_tracing_disabled(True)  # offline: no trace export
pay = PaymentService(latency=0.0)


@function_tool
async def refund(order_id: str, cents: int) -> str:
    """Refund an order at the payment provider."""
    key = idempotency_key()  # the provider deduplicates on it
    assert key is not None
    return await pay.refund(order_id, cents, idempotency_key=key)


refunds = Agent(name="refunds", instructions="Refund what the user asks for.", tools=[refund],
                model=ScriptedModel([
                    [function_call("refund", {"order_id": "A-1001", "cents": 1250},
                                   call_id="call-2")],
                    [assistant_message("Refunded 12.50 on A-1001.")],
                ]))
triage = Agent(name="triage", instructions="Route the user to the right agent.",
               handoffs=[refunds], model=ScriptedModel([
                   ModelStep.raise_error(httpx2.ConnectError("connection reset by peer")),  # cut
                   [function_call("transfer_to_refunds", {}, call_id="call-1")],
               ]))
refunder = as_tether_agent(triage, effects={"refund": tether.Effect.EXTERNAL},
                           probes={"refund": pay.lookup}, name="refunder")


async def main() -> None:
    async with tether.Supervisor("sqlite:///journal.db") as sup:
        handle = await sup.delegate(refunder, "Please refund order A-1001.")
        print("result:", await handle.result())
        print("attempts:", len(handle.attempts))
        for attempt in handle.attempts:
            report = await sup.report(attempt)
            print(f"  {attempt}: {report.outcome.value}, "
                  f"{[(a.tool, a.state.value) for a in report.actions]}")
    print("provider ledger:", [(e.order_id, e.cents) for e in pay.entries()])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        asyncio.run(main())
