"""A LangGraph graph as a tether child, offline: langchain-core's fake chat model stands in
for the model. The first model call is cut in transit before any tool ran, so tether
re-dispatches a fresh attempt; the refund then goes through the gateway with its key.

    python examples/langgraph_refund.py   (needs pip install 'tether[langgraph]')
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

import tether
from tether.langgraph import as_tether_agent, idempotency_key, tool_node
from tether.testing import PaymentService

pay = PaymentService(latency=0.0)


class FlakyModel(FakeMessagesListChatModel):
    """The fake chat model, whose first call fails as a dropped connection would."""

    dropped: bool = False

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> Any:
        if not self.dropped:
            self.dropped = True
            raise ConnectionResetError("connection reset by peer")
        return super()._generate(messages, stop, run_manager, **kwargs)


@tool
async def refund(order_id: str, cents: int) -> str:
    """Refund an order at the payment provider."""
    key = idempotency_key()  # the provider deduplicates on it
    assert key is not None
    return await pay.refund(order_id, cents, idempotency_key=key)


model = FlakyModel(responses=[
    AIMessage(content="", tool_calls=[{"name": "refund", "id": "call-1",
                                       "args": {"order_id": "A-1001", "cents": 1250}}]),
    AIMessage(content="Refunded 12.50 on A-1001."),
])


async def call_model(state: MessagesState) -> dict[str, Any]:
    return {"messages": [await model.ainvoke(state["messages"])]}


graph = StateGraph(MessagesState)
graph.add_node("agent", call_model)
graph.add_node("tools", tool_node([refund]))  # every call through tether's gateway
graph.add_edge(START, "agent")
graph.add_conditional_edges("agent", tools_condition)
graph.add_edge("tools", "agent")
refunder = as_tether_agent(graph.compile(), effects={"refund": tether.Effect.EXTERNAL},
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
