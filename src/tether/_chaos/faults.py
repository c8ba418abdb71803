"""Deliberate bugs of the runtime, planted by the chaos harness in the orchestrator's process
(the gateway's interceptors, a function of the journal's replaced; never through the
environment), to prove that chaos catches what they break."""

from __future__ import annotations

from typing import Any

from tether._journal import chainops
from tether._runtime import gateway
from tether._runtime.tools import Tool

_sealed = chainops._sealed

RUNTIME_BUGS = ("intent_after_dispatch", "relaxed_synced")


async def intent_after_dispatch(tool: Tool, key: str, kwargs: dict[str, Any],
                                journaled: gateway.Journaled) -> Any:
    """Breaks I1: the tool runs first, and only then is its intent written (with the result
    already known, recorded as the journaled call's outcome)."""
    result = await tool.fn(**kwargs, idempotency_key=key)

    async def already(**_: Any) -> Any:
        return result

    return await journaled(gateway.replaced(tool, already))


def relaxed_synced(sealer: chainops.Sealer, moved: list[tuple[str, int, str, bool]],
                   relaxed: bool) -> None:
    """Forgets that a commit skipped the disk: the heads it sealed are remembered as if a
    crash of the server could not lose them."""
    _sealed(sealer, moved, False)


def install(bug: str) -> None:
    """Plant ``bug`` in this process, if it is one of the runtime's."""
    if bug == "intent_after_dispatch":
        gateway.INTERCEPTORS.append(intent_after_dispatch)
    elif bug == "relaxed_synced":
        chainops._sealed = relaxed_synced
