"""Compensation: undo a report's COMPLETED actions with each tool's compensating call, as an
ordinary journaled delegation (``Supervisor.compensate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from tether._core.model import ActionState
from tether._core.report import Report
from tether._runtime.tools import Agent, Tool

if TYPE_CHECKING:
    from tether._runtime.gateway import Context
    from tether._runtime.handle import Handle


class Delegates(Protocol):
    # Here rather than in ports: it returns a Handle, which ports must not import.
    async def delegate(self, agent: Agent, /, *, task_id: str | None = None) -> Handle: ...


async def compensate(sup: Delegates, report: Report,
                     tools: Mapping[str, Tool]) -> Report | None:
    """The compensating delegation for a report's COMPLETED actions, with keys derived from the
    originals (so compensating twice is refused, not repeated); None if nothing to undo."""
    plan = []
    for action in report.all_actions():
        tool = tools.get(action.tool)
        if action.state is ActionState.COMPLETED and tool and tool.compensate:
            plan.append((Tool(f"{tool.name}.compensate", tool.effect, tool.compensate), action))
    if not plan:
        return None
    granted = {t.name: t for t, _ in plan}

    async def compensator(ctx: Context) -> int:
        for t, action in plan:
            await ctx.call(t, idempotency_key=f"{action.idempotency_key}:compensate",
                           **action.args)
        return len(plan)

    handle = await sup.delegate(
        Agent("compensate", compensator, tuple(granted.values())),
        task_id=f"compensate:{report.task_id}:{report.epoch}",
    )
    await handle.wait()
    return await handle.report()
