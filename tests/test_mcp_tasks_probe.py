"""The task probe of `tether mcp-proxy` (``mcp_tasks``), against a journal and an upstream whose
``tasks/get`` answers are set by the test: a probe settles a call only by the task that call
became, never by another call's (I3, I8)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from mcp import ClientSession

import tether
from tether._core.model import ProbeOutcome
from tether._integrations.mcp_gateway import McpToolError
from tether._integrations.mcp_relay import RawResult
from tether._integrations.mcp_tasks import TaskBook
from tether._runtime.reconcile import probe_all
from tether._runtime.tools import ProbeResult

A = tether.ActionState


class Upstream:
    """Answers ``tasks/get`` from ``tasks``; a task it does not know is an error."""

    def __init__(self, tasks: dict[str, dict[str, Any]]) -> None:
        self.tasks = tasks
        self.asked: list[str] = []

    async def send_request(self, request: Any, result_type: Any, **_: Any) -> RawResult:
        task_id = request.params["taskId"]
        self.asked.append(task_id)
        return RawResult.model_validate(self.tasks[task_id])


async def nothing_paid(idempotency_key: str, **_: Any) -> ProbeResult:
    """The operator's probe: no payment under the key (yet)."""
    return ProbeResult(ProbeOutcome.NOT_APPLIED, {"ledger": "no payment"})


@pytest.mark.parametrize("next_proxy", [False, True])
async def test_a_retry_cut_before_its_task_is_known_is_not_settled_by_the_first_calls_task(
        journal_url: str, keys: tether.KeyRing, next_proxy: bool) -> None:
    """A client key's first call became task T1, which failed (an internal error): the task is
    over and the operator's probe found nothing paid, so that call is NOT_APPLIED and the key
    free. The client retries with the same key; the retry is cut before its own task's id is
    known (its client cancelled, or the proxy died, before the handle came back). Its task may
    still be running upstream: T1 says nothing about it, so the retry stays in doubt."""
    upstream = Upstream({"T1": {"taskId": "T1", "status": "failed",
                                "error": {"code": -32603, "message": "ledger down"}}})
    book = TaskBook("bank", cast(ClientSession, upstream))
    calls: list[str] = []

    async def pay(account: str, idempotency_key: str) -> Any:
        calls.append(idempotency_key)
        if len(calls) == 1:
            await book.record(idempotency_key, "T1")
            raise McpToolError("the upstream's task T1 failed: ledger down")
        raise McpToolError("cut before the task handle came back")

    probed = tether.Tool("pay", tether.Effect.EXTERNAL, pay, probe=book.probe("pay", nothing_paid))
    states: list[tuple[A, dict[str, Any]]] = []
    async with tether.Supervisor(journal_url, keys=keys) as sup:
        book.sup = sup

        async def agent(ctx: tether.Context) -> None:
            book.delegation_id = ctx.delegation_id
            for _ in range(2):
                with pytest.raises(McpToolError):
                    await ctx.call(probed, account="A-1", idempotency_key="client:K")
                probing = probed
                if next_proxy:  # the next proxy on the journal: nothing known in memory
                    fresh = TaskBook("bank", cast(ClientSession, upstream), sup,
                                     ctx.delegation_id)
                    probing = tether.Tool("pay", tether.Effect.EXTERNAL, pay,
                                          probe=fresh.probe("pay", nothing_paid))
                doubtful = await sup.journal.unsettled(ctx.delegation_id)
                await probe_all(sup.journal, doubtful, {"pay": probing}, sup.clock, 5.0)
                (last,) = [a for a in await sup.journal.actions([ctx.delegation_id])
                           if a.id == doubtful[0].id]
                states.append((last.state, dict(last.evidence or {})))

        child = await sup.delegate(agent, tools=[probed])
        await child.wait()
        await child.result()
    (first, first_evidence), (retry, retry_evidence) = states
    assert first is A.NOT_APPLIED and first_evidence["task"] == "T1"
    assert retry is A.IN_DOUBT, retry_evidence  # never NOT_APPLIED by T1's word
    assert retry_evidence.get("task") != "T1", retry_evidence
