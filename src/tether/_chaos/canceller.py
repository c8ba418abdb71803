"""A second orchestrator process that stops a delegation it does not run: a Supervisor of its
own on the trial's journal and ``handle_for(id).terminate()`` (or ``.cancel()``).

Run as ``python -m tether._chaos.canceller DIR PLAN_JSON JOURNAL_URL DELEGATION_ID TASK_ID
HOW``, HOW being ``terminate`` or ``cancel``. It notes when it asked and when it was answered."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import tether
from tether._chaos.plan import Plan
from tether._chaos.world import Trial, build, policy


async def main(directory: Path, plan: Plan, url: str, delegation_id: str, task_id: str,
               how: str) -> None:
    trial = Trial(directory, plan, "canceller")
    refund, _, _ = build(trial)
    async with tether.Supervisor(url, policy=policy(plan), tools=[refund],
                                 recover=False) as sup:
        handle = sup.handle_for(delegation_id)
        trial.note("control_sent", task_id, how=how, delegation=delegation_id)
        try:
            if how == "cancel":
                report = await handle.cancel("chaos: cancel from another process")
            else:
                report = await handle.terminate("chaos: terminate from another process")
        except tether.TetherError as exc:
            trial.note("control_returned", task_id, how=how, error=f"{type(exc).__name__}: {exc}")
            return
        trial.note("control_returned", task_id, how=how, outcome=report.outcome.value,
                   verdict=report.verdict)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Plan.from_json(sys.argv[2]), *sys.argv[3:7]))
