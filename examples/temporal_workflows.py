"""The workflow of examples/temporal_refund.py, in a module of its own: Temporal's sandbox
imports a workflow's module again, so it imports the SDK alone and names activities by name."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow


@workflow.defn
class RefundWorkflow:
    @workflow.run
    async def run(self, activity: str, order_id: str, cents: int) -> str:
        ref: str = await workflow.execute_activity(
            activity, args=[order_id, cents], start_to_close_timeout=timedelta(seconds=30))
        return ref
