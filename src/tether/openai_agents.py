"""OpenAI Agents SDK integration (``pip install 'tether[openai-agents]'``).

``child = tether.openai_agents.as_tether_agent(sdk_agent, effects={"refund": Effect.EXTERNAL},
probes={"refund": lookup})``, then ``await sup.delegate(child, "the user's request")``.
"""

from __future__ import annotations

try:
    from tether._integrations.openai_agents import as_tether_agent, cut_reason, idempotency_key
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without the extra
    if exc.name is None or exc.name.split(".")[0] not in ("agents", "openai", "httpx2"):
        raise
    raise ModuleNotFoundError("tether.openai_agents needs the OpenAI Agents SDK: "
                              "pip install 'tether[openai-agents]'", name=exc.name) from None

__all__ = ["as_tether_agent", "cut_reason", "idempotency_key"]
