"""tether on Temporal, against a real dev server: each activity journaled, keyed by its place,
fenced; recall and terminate as Temporal operations; seed 000's failure modes done naively on
Temporal and with tether, judged by the provider's own ledger."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

import tether
import tether.temporal
from tests.conftest import ONE_CLOCK, until
from tests.temporal_flows import Refund, TwoRefunds
from tether.testing import PaymentService


class Provider:
    """A payment provider with its own ledger (it honours idempotency keys, as real ones do),
    the tether tool over it, and a naive activity that calls it the way Temporal users do
    without tether: a fresh key per call."""

    def __init__(self) -> None:
        self.pay = PaymentService(latency=0.0)
        self.keys: list[str] = []  # the key of every call that reached the tool
        self.reject_first = 0  # this many calls are refused by the provider before applying
        self.lose_reply = 0  # this many calls apply, then their reply is lost
        self.hold: asyncio.Event | None = None  # when set, replies wait for it (after applying)
        pay = self.pay

        @tether.tool(effect=tether.Effect.EXTERNAL, probe=pay.lookup, dispatch_deadline=2.0)
        async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
            self.keys.append(idempotency_key)
            if self.reject_first > 0:
                self.reject_first -= 1
                raise tether.ToolRejected("card network unavailable; nothing was sent")
            ref = await pay.refund(order_id, cents, idempotency_key=idempotency_key)
            if self.lose_reply > 0:
                self.lose_reply -= 1
                raise ConnectionResetError("the provider's reply was lost")
            if self.hold is not None:
                await self.hold.wait()
            return ref

        @activity.defn(name="naive_refund")
        async def naive_refund(order_id: str, cents: int) -> str:
            key = str(uuid.uuid4())  # what a call without tether has: nothing stable
            self.keys.append(key)
            ref = await pay.refund(order_id, cents, idempotency_key=key)
            while self.hold is not None and not self.hold.is_set():
                activity.heartbeat()  # how Temporal delivers a cancel to an activity
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.hold.wait(), 0.2)
            return ref

        self.refund = refund
        self.naive_refund = naive_refund


@pytest.fixture
async def client(temporal_address: str) -> Client:
    return await Client.connect(temporal_address)


@pytest.fixture
def provider() -> Provider:
    return Provider()


@contextlib.asynccontextmanager
async def worker(client: Client, sup: tether.Supervisor, provider: Provider) -> AsyncIterator[str]:
    """A worker with tether's plugin on its own task queue (its name is yielded)."""
    queue = f"q-{uuid.uuid4().hex[:12]}"
    async with Worker(client, task_queue=queue, workflows=[Refund, TwoRefunds],
                      activities=[provider.naive_refund],
                      plugins=[tether.temporal.Plugin(sup, tools=[provider.refund])]):
        yield queue


def supervisor(url: str, provider: Provider) -> tether.Supervisor:
    return tether.Supervisor(url, policy=ONE_CLOCK, tools=[provider.refund])


async def start_refund(client: Client, queue: str, workflow_id: str, activity_name: str = "refund",
                       order: str = "A-1") -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        Refund.run, args=[activity_name, order, 1250], id=workflow_id, task_queue=queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE)


def keys_of(report: tether.Report) -> list[str]:
    return [a.idempotency_key for a in report.actions]


async def actions(sup: tether.Supervisor, workflow_id: str) -> Sequence[tether.ActionRecord]:
    await sup.journal.flush()
    rows = [d for d in await sup.journal.delegations()
            if d.task_id == tether.temporal.task_of(workflow_id)]
    return await sup.journal.actions([d.id for d in rows])


# -- keys ---------------------------------------------------------------------------------------
async def test_a_retry_of_an_activity_gets_the_key_of_its_first_attempt(
        client: Client, provider: Provider, journal_url: str) -> None:
    """I7 across Temporal's retries: the provider refused the first attempt (nothing sent),
    Temporal retried it; both attempts carried one key, derived from the workflow id and the
    activity's place, and the provider applied it once."""
    provider.reject_first = 1
    async with supervisor(journal_url, provider) as sup, worker(client, sup, provider) as queue:
        handle = await start_refund(client, queue, "wf-retry")
        ref = await handle.result()
        assert provider.keys == ["temporal:wf-retry:refund:1"] * 2
        assert provider.pay.refund_count("A-1") == 1
        assert [e.key for e in provider.pay.entries("A-1")] == ["temporal:wf-retry:refund:1"]
        done = await actions(sup, "wf-retry")
        assert [(a.state, a.idempotency_key) for a in done] == [
            (tether.ActionState.FAILED, "temporal:wf-retry:refund:1"),
            (tether.ActionState.COMPLETED, "temporal:wf-retry:refund:1")]
        assert done[1].result == ref


async def test_a_retry_after_a_lost_reply_replays_the_call_instead_of_paying_again(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """The provider applied the refund and its reply was lost: the call is in doubt, so
    Temporal's retry waits for its outcome (the probe finds it applied) and replays it: one
    application, and the workflow gets the provider's reference."""
    provider.lose_reply = 1
    async with supervisor(sqlite_url, provider) as sup, worker(client, sup, provider) as queue:
        handle = await start_refund(client, queue, "wf-lost")
        ref = await handle.result()
        assert provider.keys == ["temporal:wf-lost:refund:1"]  # never sent again
        assert provider.pay.refund_count("A-1") == 1
        assert ref == provider.pay.entries("A-1")[0].ref
        (done,) = await actions(sup, "wf-lost")
        assert done.state is tether.ActionState.COMPLETED and done.result == ref


# -- the fence ----------------------------------------------------------------------------------
async def test_an_activity_of_a_fenced_workflow_run_is_refused_and_never_retried(
        client: Client, provider: Provider, journal_url: str) -> None:
    """I2 on Temporal: once the run's delegation is recalled, the journal refuses its next
    activity before it reaches the tool, with an error Temporal does not retry."""
    async with supervisor(journal_url, provider) as sup, worker(client, sup, provider) as queue:
        handle = await client.start_workflow(TwoRefunds.run, args=["B-1", "B-2"],
                                             id="wf-fence", task_queue=queue)
        await until(lambda: provider.pay.refund_count("B-1") == 1, "the first refund")
        (first,) = await actions(sup, "wf-fence")
        report = await sup.handle_for(first.delegation_id).recall(grace=5.0, reason="stop")
        assert [a.tool for a in report.completed] == ["refund"]
        await handle.signal(TwoRefunds.proceed)
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        cause = failed.value.cause
        assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
        assert cause.cause.type == "tether.Refused" and cause.cause.non_retryable
        assert "recalled" in str(cause.cause)
        assert provider.pay.refund_count("B-2") == 0
        assert provider.keys == ["temporal:wf-fence:refund:1"]  # the second never reached it
        assert [a.args["order_id"] for a in await actions(sup, "wf-fence")] == ["B-1"]
