"""LangGraph integration (``pip install 'tether[langgraph]'``).

Build ToolNodes with ``tool_node(tools)``, compile the graph, then
``child = tether.langgraph.as_tether_agent(graph, effects={"refund": Effect.EXTERNAL},
probes={"refund": lookup})`` and ``await sup.delegate(child, "the user's request")``.
"""

from __future__ import annotations

try:
    from tether._integrations.langgraph import (
        Subgraph,
        as_tether_agent,
        awrap_tool_call,
        cut_reason,
        idempotency_key,
        subgraph,
        tool_node,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without the extra
    if exc.name is None or exc.name.split(".")[0] not in ("langgraph", "langchain_core"):
        raise
    raise ModuleNotFoundError("tether.langgraph needs LangGraph: "
                              "pip install 'tether[langgraph]'", name=exc.name) from None

__all__ = ["Subgraph", "as_tether_agent", "awrap_tool_call", "cut_reason", "idempotency_key",
           "subgraph", "tool_node"]
