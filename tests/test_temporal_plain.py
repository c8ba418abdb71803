"""Runs the journal holds no call of, judged by Temporal's word: what a worker without
tether's plugin did (a deployment that mixes workers, or one rolled out halfway) must never
be reported as nothing. Each test has a plain worker pay, then recalls the run with
``tether.temporal.recall``; the report must say a person decides, however Temporal shows
the payment (a paid first attempt behind a retry tether refused, an activity id given
twice, a local activity still running, or whose workflow task failed, or that ended between
the recall's two reads, an activity scheduled between them), and when Temporal cannot
answer at all."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
import temporalio.client
from temporalio import activity
from temporalio.api.enums.v1 import EventType, PendingWorkflowTaskState
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

import tether
import tether.temporal
from tests.temporal_flows import LocalThenBug, RefundAnyway, RefundLocally, SameIdTwice
from tests.temporal_world import (
    Gate,
    Provider,
    both,
    opened_on_history,
    start_refund,
    worker,
)
from tether._integrations.temporal_activities import refused

NEEDS = (tether.DelegationState.NEEDS_ATTENTION, "REJECTED")


class AfterHistory(temporalio.client.Interceptor):
    """Runs ``hook`` once, at the client's first describe after it read a run's history:
    between the two reads a recall makes of a run the journal holds no call of."""

    def __init__(self, hook: Callable[[], Awaitable[None]]) -> None:
        self.hook = hook
        self.armed = self.done = False

    def intercept_client(self, next: temporalio.client.OutboundInterceptor
                         ) -> temporalio.client.OutboundInterceptor:
        outer = self

        class Between(temporalio.client.OutboundInterceptor):
            def fetch_workflow_history_events(
                    self, input: temporalio.client.FetchWorkflowHistoryEventsInput
            ) -> temporalio.client.WorkflowHistoryEventAsyncIterator:
                outer.armed = True
                return super().fetch_workflow_history_events(input)

            async def describe_workflow(self, input: temporalio.client.DescribeWorkflowInput
                                        ) -> temporalio.client.WorkflowExecutionDescription:
                if outer.armed and not outer.done:
                    outer.done = True
                    await outer.hook()
                return await super().describe_workflow(input)

        return Between(next)


def paying_then_held(provider: Provider, release: asyncio.Event) -> Any:
    """A plain ``refund`` activity (no tether key): it pays, then holds its reply until
    ``release``."""
    @activity.defn(name="refund")
    async def plain_refund(order_id: str, cents: int) -> str:
        ref = await provider.pay.refund(order_id, cents, idempotency_key=str(uuid.uuid4()))
        await release.wait()
        return ref

    return plain_refund


def plain(client: Client, provider: Provider, queue: str, workflows: list[Any],
          activities: list[Any] | None = None) -> Worker:
    """A worker without tether's plugin."""
    return Worker(client, task_queue=queue, workflows=workflows,
                  activities=activities or [provider.naive_refund])


async def until_history(handle: WorkflowHandle[Any, Any], kind: EventType.ValueType,
                        what: str) -> None:
    for _ in range(1200):  # a minute
        async for event in handle.fetch_history_events():
            if event.event_type == kind:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


def fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def test_an_activity_id_given_twice_does_not_hide_the_first_payment(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The first activity under id "pay" paid; the second, under the same id, waits for a
    first attempt. The one waiting must not stand for the one that paid."""
    queue, workflow_id = fresh("q"), fresh("wf-twice")
    async with both(journal_url, provider) as (_, boss), \
            plain(client, provider, queue, [SameIdTwice]):
        run = await client.start_workflow(SameIdTwice.run, args=["S-1", fresh("nowhere")],
                                          id=workflow_id, task_queue=queue)
        await until_history(run, EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, "the payment")
        report = await tether.temporal.recall(run, supervisor=boss, grace=3.0,
                                              reason="after its first refund")
    assert provider.pay.refund_count("S-1") == 1
    assert (report.outcome, report.verdict) == NEEDS, report


async def test_a_local_payment_whose_workflow_task_failed_is_not_reported_idle(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A local activity paid, then the workflow code failed: Temporal drops the task's
    commands, the local activity's marker among them, and the plain worker is gone. No
    activity and no marker show: the failed task that started does."""
    queue, workflow_id = fresh("q"), fresh("wf-bug")
    async with both(journal_url, provider) as (_, boss):
        async with plain(client, provider, queue, [LocalThenBug]):
            run = await client.start_workflow(LocalThenBug.run, args=["B-1"], id=workflow_id,
                                              task_queue=queue,
                                              task_timeout=timedelta(seconds=2))
            await until_history(run, EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
                                "the workflow task's failure")
        for _ in range(1200):  # its retried task, waiting for a worker
            task = (await run.describe()).raw_description.pending_workflow_task
            if task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_SCHEDULED:
                break
            await asyncio.sleep(0.05)
        report = await tether.temporal.recall(run, supervisor=boss, grace=3.0,
                                              reason="the worker is gone")
    assert provider.pay.refund_count("B-1") >= 1
    assert (report.outcome, report.verdict) == NEEDS, report


async def test_an_activity_scheduled_between_the_two_reads_is_counted(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The recall has read the run's history (nothing scheduled) when the workflow schedules
    its refund, which a plain worker takes and pays: the description shows it in a worker's
    hands, and it counts."""
    queue, workflow_id = fresh("q"), fresh("wf-between")
    provider.hold = asyncio.Event()

    async def meanwhile() -> None:
        await client.get_workflow_handle(workflow_id).signal(RefundAnyway.proceed)
        await provider.pay.applied()

    watched = await Client.connect(client.service_client.config.target_host,
                                   interceptors=[AfterHistory(meanwhile)])
    async with both(journal_url, provider) as (_, boss), \
            plain(client, provider, queue, [RefundAnyway]):
        started = await client.start_workflow(RefundAnyway.run, args=["A-1", "naive_refund"],
                                              id=workflow_id, task_queue=queue)
        await until_history(started, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
                            "the run waiting for its signal")
        try:
            report = await tether.temporal.recall(
                watched.get_workflow_handle(workflow_id), supervisor=boss, grace=1.0,
                reason="as it begins")
        finally:
            provider.hold.set()
    assert provider.pay.refund_count("A-1") == 1
    assert (report.outcome, report.verdict) == NEEDS, report


async def test_a_local_payment_that_ends_between_the_two_reads_is_counted(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The recall reads the history while a plain worker's local refund runs (no marker
    yet); the run then completes before the description is read (no workflow task in a
    worker's hands either): the task the history saw start counts."""
    release = asyncio.Event()
    plain_refund = paying_then_held(provider, release)

    queue, workflow_id = fresh("q"), fresh("wf-local-between")

    async def meanwhile() -> None:
        release.set()
        await client.get_workflow_handle(workflow_id).result()

    watched = await Client.connect(client.service_client.config.target_host,
                                   interceptors=[AfterHistory(meanwhile)])
    async with both(journal_url, provider) as (_, boss), \
            plain(client, provider, queue, [RefundLocally], [plain_refund]):
        await client.start_workflow(RefundLocally.run, args=["L-2", 5], id=workflow_id,
                                    task_queue=queue)
        await provider.pay.applied()
        try:
            report = await tether.temporal.recall(
                watched.get_workflow_handle(workflow_id), supervisor=boss, grace=3.0,
                reason="while it pays")
        finally:
            release.set()
    assert provider.pay.refund_count("L-2") == 1
    assert (report.outcome, report.verdict) == NEEDS, report


async def test_temporal_unable_to_answer_is_a_persons_problem_and_a_recall_again_asks(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A plain worker's run paid and closed. The recall's look at it fails (Temporal is away
    for a moment): the report says a person decides, rather than raise with the run's
    delegation recalled and Temporal never told. A recall again, with Temporal back, asks
    again, rather than take that delegation's empty record for the run's."""
    async def away() -> None:
        raise RPCError("unavailable for a moment", RPCStatusCode.UNAVAILABLE, b"")

    queue, workflow_id = fresh("q"), fresh("wf-away")
    watched = await Client.connect(client.service_client.config.target_host,
                                   interceptors=[AfterHistory(away)])
    async with both(journal_url, provider) as (_, boss), \
            plain(client, provider, queue, [RefundAnyway]):
        run = await client.start_workflow(RefundAnyway.run, args=["R-1", "naive_refund"],
                                          id=workflow_id, task_queue=queue)
        await run.signal(RefundAnyway.proceed)
        await run.result()
        first = await tether.temporal.recall(watched.get_workflow_handle(workflow_id),
                                             supervisor=boss, grace=1.0, reason="first")
        again = await tether.temporal.recall(run, supervisor=boss, grace=1.0, reason="again")
    assert provider.pay.refund_count("R-1") == 1
    assert (first.outcome, first.verdict) == NEEDS, first
    assert "could not say" in first.reason
    assert (again.outcome, again.verdict) == NEEDS, again
    assert "may have run" in again.reason


async def test_a_refused_local_activity_counts_as_not_run(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The other way: a plain workflow whose only local activity tether refused (its marker
    carries the refusal) did nothing, and the recall says so."""
    @activity.defn(name="refund")
    async def refuses(order_id: str, cents: int) -> str:
        raise refused("refused as tether's plugin refuses a fenced run's call")

    queue, workflow_id = fresh("q"), fresh("wf-refused-local")
    async with both(journal_url, provider) as (_, boss), \
            plain(client, provider, queue, [RefundLocally], [refuses]):
        run = await client.start_workflow(RefundLocally.run, args=["L-3", 5], id=workflow_id,
                                          task_queue=queue)
        with contextlib.suppress(WorkflowFailureError):
            await run.result()
        report = await tether.temporal.recall(run, supervisor=boss, grace=3.0,
                                              reason="after it was refused")
    assert report.outcome is tether.DelegationState.RECALLED, report
    assert provider.pay.refund_count("L-3") == 0


async def test_a_refund_paid_by_a_plain_first_attempt_is_not_hidden_by_a_refused_retry(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Attempt 1 of a refund runs as a worker without tether's plugin runs it: paid, then
    failed (its reply lost, say). Attempt 2 is in the hands of a worker with the plugin when a
    recall of the run (which the journal knows nothing of) comes, and is refused there, past
    the fence. Temporal keeps only the last attempt's failure: the recall must not take that
    refusal for the whole activity's and say nothing ran, when the money moved."""
    gate = Gate()
    workflow_id = f"wf-plain-first-{uuid.uuid4().hex[:8]}"
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider, interceptors=[PlainFirst(), gate]) as queue:
        started = await start_refund(client, queue, workflow_id, "naive_refund", "P-1")
        await gate.held.wait()  # attempt 2
        handle = await opened_on_history(client, started, gate)
        report = await tether.temporal.recall(handle, supervisor=boss, grace=30.0,
                                              reason="while attempt 2 is held")
        with pytest.raises(WorkflowFailureError):
            await started.result()
    assert provider.pay.refund_count("P-1") == 1  # the money moved
    assert (report.outcome, report.verdict) == (tether.DelegationState.NEEDS_ATTENTION,
                                                "REJECTED"), report
    assert "may have run" in report.reason


async def test_a_local_activity_a_plain_worker_runs_is_not_reported_idle(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A worker without tether's plugin runs the run's refund as a local activity, which
    Temporal never schedules on a task queue (no pending activity, no scheduled event; a
    marker once it ends). The refund has applied and its reply is held when the recall
    comes: the run's workflow task is in the worker's hands past the grace, and the report
    does not say the run did nothing."""
    release = asyncio.Event()
    plain_refund = paying_then_held(provider, release)

    workflow_id = f"wf-plain-local-{uuid.uuid4().hex[:8]}"
    queue = f"q-{uuid.uuid4().hex[:12]}"
    async with both(journal_url, provider) as (_, boss), \
            Worker(client, task_queue=queue, workflows=[RefundLocally],
                   activities=[plain_refund]):
        run = await client.start_workflow(RefundLocally.run, args=["L-9", 5], id=workflow_id,
                                          task_queue=queue)
        await provider.pay.applied()
        try:
            report = await tether.temporal.recall(run, supervisor=boss, grace=1.0,
                                                  reason="while its local refund runs")
        finally:
            release.set()
        with contextlib.suppress(WorkflowFailureError):
            await run.result()
    assert provider.pay.refund_count("L-9") == 1
    assert (report.outcome, report.verdict) == (tether.DelegationState.NEEDS_ATTENTION,
                                                "REJECTED"), report


class PlainFirst(Interceptor):
    """Attempt 1 of each activity runs as a worker without tether's plugin would run it
    (straight to its code, past the plugin), then fails as a lost reply would; later attempts
    go on inward (to tether's plugin)."""

    def intercept_activity(self, next: ActivityInboundInterceptor
                           ) -> ActivityInboundInterceptor:
        class Plain(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                if activity.info().attempt > 1:
                    return await super().execute_activity(input)
                await input.fn(*input.args)
                raise ApplicationError("the provider's reply was lost")  # retryable

        return Plain(next)
