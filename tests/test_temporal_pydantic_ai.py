"""pydantic-ai through its own Temporal integration, with tether's Temporal plugin on the
worker, against a real dev server on both journals: every activity the framework makes (its
model requests, its tool calls) is journaled before it runs, keyed by its place in the
workflow and fenced; the refund tool hands its provider tether's key; a recall during the
refund lets it finish within the grace, reports it as the provider's ledger has it, and the
run's next model request is refused."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from pydantic import BaseModel
from pydantic_ai.durable_exec.temporal import PydanticAIPayloadConverter, PydanticAIPlugin
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.worker import Worker

import tether
import tether.temporal
from tests.conftest import ONE_CLOCK, events_of
from tests.temporal_pai_flows import SupportFlow
from tests.temporal_pai_world import EFFECTS, REFUND, World
from tests.temporal_world import Provider, actions
from tether._integrations.temporal_activities import as_json

A = tether.ActionState


@pytest.fixture
async def client(temporal_address: str) -> Client:
    return await Client.connect(temporal_address, plugins=[PydanticAIPlugin()])


@pytest.fixture
def provider() -> Iterator[Provider]:
    World.provider, World.requests = Provider(), 0
    yield World.provider
    World.provider = None


def worker(client: Client, sup: tether.Supervisor, queue: str) -> Worker:
    return Worker(client, task_queue=queue, workflows=[SupportFlow],
                  plugins=[tether.temporal.Plugin(sup, effects=EFFECTS)])


async def test_an_agent_on_temporal_is_journaled_activity_by_activity(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The refund journaled under its place in the workflow and handed that key, its result
    kept as the framework's payload converter encodes it; the model's requests fenced, not
    journaled."""
    queue, workflow_id = f"q-{uuid.uuid4().hex[:12]}", f"pai-{uuid.uuid4().hex[:8]}"
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup, \
            worker(client, sup, queue):
        output = await client.execute_workflow(SupportFlow.run, args=["refund P-1"],
                                               id=workflow_id, task_queue=queue)
        done = await actions(sup, workflow_id)
    assert output == "refunded P-1"
    key = f"temporal:{workflow_id}:{REFUND}:2"
    assert provider.keys == [key] and provider.pay.refund_count("P-1") == 1
    # The model's requests are READ_ONLY (fenced, not journaled); the refund is journaled.
    assert [(a.tool, a.effect, a.state, a.idempotency_key) for a in done] == [
        (REFUND, tether.Effect.EXTERNAL, A.COMPLETED, key)]
    assert World.requests == 2
    assert done[0].result == {"result": provider.pay.entries("P-1")[0].ref,
                              "kind": "tool_return"}  # pydantic-ai's own type, as JSON


async def test_a_recall_during_the_agents_refund_reports_it_and_stops_the_agent(
        client: Client, provider: Provider, journal_url: str) -> None:
    queue, workflow_id = f"q-{uuid.uuid4().hex[:12]}", f"pai-{uuid.uuid4().hex[:8]}"
    provider.hold = asyncio.Event()
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as host, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK) as boss, \
            worker(client, host, queue):
        drained = events_of(host)
        handle = await client.start_workflow(SupportFlow.run, args=["refund P-1"],
                                             id=workflow_id, task_queue=queue)
        await provider.pay.applied()  # the refund applied; its reply is held
        (call,) = await actions(boss, workflow_id)
        recall = asyncio.ensure_future(tether.temporal.recall(
            handle, supervisor=boss, grace=10.0, reason="customer withdrew"))
        await drained("drain", call.delegation_id).wait()  # fenced, the refund in flight
        provider.hold.set()
        report = await recall
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        # Cancelled in Temporal, or failed first by the fence refusing the next request.
        assert (await handle.describe()).status in (WorkflowExecutionStatus.CANCELED,
                                                    WorkflowExecutionStatus.FAILED)
    assert report.outcome is tether.DelegationState.RECALLED
    assert [(a.tool, a.state) for a in report.completed] == [(REFUND, A.COMPLETED)]
    (entry,) = provider.pay.entries("P-1")  # the ledger: one refund, the one reported
    assert report.completed[0].result["result"] == entry.ref and entry.key == provider.keys[0]
    assert World.requests == 1  # the model's next request never reached it


class Refunded(BaseModel):
    ref: str
    cents: int


def test_a_replayed_result_decodes_in_the_workflow_to_the_type_it_had() -> None:
    """What the journal keeps of an activity's result, and a replay by key hands Temporal:
    the worker's payload converter's JSON of it (pydantic-ai's converter here), which Temporal
    encodes to the same payload, decoded in the workflow to the same value and type."""
    converter = PydanticAIPayloadConverter()
    original = Refunded(ref="re_1", cents=1250)
    kept = as_json(original, converter)
    assert kept == {"ref": "re_1", "cents": 1250}
    assert converter.to_payloads([kept]) == converter.to_payloads([original])
    (decoded,) = converter.from_payloads(converter.to_payloads([kept]), [Refunded])
    assert decoded == original
    assert as_json(b"\x00raw", converter) == b"\x00raw"  # not JSON: kept as it was
    assert as_json(None, converter) is None
