"""Deliberate bugs of the runtime, planted by the chaos harness through the gateway's
interceptors (never through the environment), to prove that chaos catches what they break."""

from __future__ import annotations

from typing import Any

from tether._runtime import gateway
from tether._runtime.tools import Tool

RUNTIME_BUGS = ("intent_after_dispatch",)


async def intent_after_dispatch(tool: Tool, key: str, kwargs: dict[str, Any],
                                journaled: gateway.Journaled) -> Any:
    """Breaks I1: the tool runs first, and only then is its intent written (with the result
    already known, recorded as the journaled call's outcome)."""
    result = await tool.fn(**kwargs, idempotency_key=key)

    async def already(**_: Any) -> Any:
        return result

    return await journaled(gateway.replaced(tool, already))


def install(bug: str) -> None:
    """Plant ``bug`` in this process's gateway, if it is one of the runtime's."""
    if bug == "intent_after_dispatch":
        gateway.INTERCEPTORS.append(intent_after_dispatch)
