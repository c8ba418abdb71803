"""pydantic-ai integration (``pip install 'tether[pydantic-ai]'``).

``child = tether.pydantic_ai.as_tether_agent(agent, effects={"refund": Effect.EXTERNAL},
probes={"refund": lookup})``, then ``await sup.delegate(child, "the user's request")``.
"""

from __future__ import annotations

try:
    from tether._integrations.pydantic_ai import (
        TetherToolset,
        as_tether_agent,
        cut_reason,
        delegate,
        idempotency_key,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without the extra
    if exc.name is None or exc.name.split(".")[0] not in ("pydantic_ai", "pydantic_core"):
        raise
    raise ModuleNotFoundError("tether.pydantic_ai needs pydantic-ai: "
                              "pip install 'tether[pydantic-ai]'", name=exc.name) from None

__all__ = ["TetherToolset", "as_tether_agent", "cut_reason", "delegate", "idempotency_key"]
