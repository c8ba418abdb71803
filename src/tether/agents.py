"""The former name of ``tether.openai_agents``, kept importable."""

from __future__ import annotations

from tether.openai_agents import as_tether_agent, cut_reason, idempotency_key

__all__ = ["as_tether_agent", "cut_reason", "idempotency_key"]
