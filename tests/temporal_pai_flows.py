"""The workflow of ``temporal_pai_world``'s agent (workflow code: deterministic, sandboxed)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow

    from tests.temporal_pai_world import agent


@workflow.defn
class SupportFlow(PydanticAIWorkflow):
    __pydantic_ai_agents__ = (agent,)

    @workflow.run
    async def run(self, prompt: str) -> str:
        result = await agent.run(prompt)
        return result.output
