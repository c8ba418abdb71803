"""The workflow of bench/temporal_activity.py, in a module of its own: Temporal's sandbox
imports a workflow's module again, so it imports the SDK alone and names activities by name."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow


@workflow.defn
class Steps:
    @workflow.run
    async def run(self, activity: str, n: int) -> int:
        total = 0
        for i in range(n):
            total += await workflow.execute_activity(
                activity, args=[i], start_to_close_timeout=timedelta(seconds=30))
        return total
