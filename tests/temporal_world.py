"""The world of the Temporal tests: a payment provider with its own ledger, the tether tool
and the naive activities over it, a worker with or without tether's plugin."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import temporalio.client
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

import tether
import tether.temporal
from tests.conftest import ONE_CLOCK
from tests.temporal_flows import (
    ContinueAnyway,
    Leaver,
    Middle,
    MiddleWaits,
    Monthly,
    ParentBusy,
    ParentBusyGrand,
    ParentElsewhere,
    ParentOfRefunds,
    ParentOfWaiter,
    Refund,
    RefundAnyway,
    RefundLocally,
    TwoRefunds,
)
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
        self.holds: dict[str, asyncio.Event] = {}  # the same, for one order's refund
        self.cut = 0  # refunds whose wait for their hold was cancelled (cut)
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
            while self.hold is not None and not self.hold.is_set():
                # A call longer than its workflow's heartbeat timeout heartbeats, as a real
                # one does; otherwise Temporal times the attempt out and retries it.
                if activity.in_activity():
                    activity.heartbeat()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.hold.wait(), 0.2)
            held = self.holds.get(order_id)
            if held is not None:
                try:
                    await held.wait()
                except asyncio.CancelledError:
                    self.cut += 1
                    raise
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

        @activity.defn(name="keyed_refund")
        async def keyed_refund(order_id: str, cents: int) -> str:
            """Not a tether tool (so EXTERNAL), but it hands its provider tether's key."""
            key = tether.temporal.idempotency_key()
            self.keys.append(key)
            return await pay.refund(order_id, cents, idempotency_key=key)

        @activity.defn(name="ledger_note")
        def ledger_note(order_id: str, cents: int) -> str:
            """A plain (not async) activity, run in the worker's thread pool."""
            self.keys.append(tether.temporal.idempotency_key())
            return f"noted {order_id}"

        self.refund = refund
        self.ledger_note = ledger_note
        self.naive_refund = naive_refund
        self.keyed_refund = keyed_refund


_THREADS = concurrent.futures.ThreadPoolExecutor(4)  # for the activities that are not async


@contextlib.asynccontextmanager
async def worker(client: Client, sup: tether.Supervisor | None, provider: Provider,
                 queue: str | None = None, activities: int | None = None,
                 interceptors: Sequence[Interceptor] = ()) -> AsyncIterator[str]:
    """A worker on ``queue`` (by default a task queue of its own; its name is yielded): with
    tether's plugin on ``sup``'s journal, or, with no supervisor, plain Temporal; running at
    most ``activities`` activities at once; ``interceptors`` outside tether's."""
    queue = queue or f"q-{uuid.uuid4().hex[:12]}"
    plugins = [] if sup is None else [tether.temporal.Plugin(sup, tools=[provider.refund])]
    async with Worker(client, task_queue=queue,
                      workflows=[Refund, TwoRefunds, RefundAnyway, RefundLocally,
                                 ParentOfRefunds, Leaver, ParentElsewhere, Middle,
                                 ParentBusy, ContinueAnyway, MiddleWaits, ParentBusyGrand,
                                 ParentOfWaiter, Monthly],
                      activities=[provider.naive_refund, provider.keyed_refund,
                                  provider.ledger_note],
                      activity_executor=_THREADS, plugins=plugins,
                      interceptors=interceptors,
                      max_concurrent_activities=activities,
                      # a run whose worker stopped goes on at another within a second
                      sticky_queue_schedule_to_start_timeout=timedelta(seconds=1)):
        yield queue


class Gate(Interceptor):
    """Holds each activity in the worker's hands (started, in Temporal's eyes) until
    ``opened`` is set, before tether's plugin sees it; ``held`` is set once one is held."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.opened = asyncio.Event()

    def intercept_activity(self, next: ActivityInboundInterceptor
                           ) -> ActivityInboundInterceptor:
        gate = self

        class Held(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                gate.held.set()
                await gate.opened.wait()
                return await super().execute_activity(input)

        return Held(next)


class OpensOnHistory(temporalio.client.Interceptor):
    """Opens ``gate`` when the client reads a run's whole history."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def intercept_client(self, next: temporalio.client.OutboundInterceptor
                         ) -> temporalio.client.OutboundInterceptor:
        gate = self.gate

        class Opens(temporalio.client.OutboundInterceptor):
            def fetch_workflow_history_events(
                    self, input: temporalio.client.FetchWorkflowHistoryEventsInput
            ) -> temporalio.client.WorkflowHistoryEventAsyncIterator:
                gate.opened.set()
                return super().fetch_workflow_history_events(input)

        return Opens(next)


async def opened_on_history(client: Client, started: WorkflowHandle[Any, Any], gate: Gate
                            ) -> WorkflowHandle[Any, Any]:
    """``started``'s run, through a client of its own (an orchestrator's) whose reading of a
    run's history opens ``gate``."""
    watched = await Client.connect(client.service_client.config.target_host,
                                   interceptors=[OpensOnHistory(gate)])
    return watched.get_workflow_handle(started.id, run_id=started.result_run_id,
                                       first_execution_run_id=started.first_execution_run_id)


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


async def quiet(handle: WorkflowHandle[Any, Any], within: float = 60.0) -> None:
    """Until the run has no activity and no workflow task pending in Temporal."""
    for _ in range(int(within / 0.05)):
        raw = (await handle.describe()).raw_description
        if not raw.pending_activities and not raw.HasField("pending_workflow_task"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never quiet: workflow {handle.id}")


@contextlib.asynccontextmanager
async def both(url: str, provider: Provider
               ) -> AsyncIterator[tuple[tether.Supervisor, tether.Supervisor]]:
    """The worker's supervisor, then the orchestrator's, on one journal."""
    async with supervisor(url, provider) as host, supervisor(url, provider) as boss:
        yield host, boss


def cli(*args: str) -> tuple[int, str, str]:
    """``tether`` in this process (in a thread of its own: it runs its own event loop)."""
    from typer.testing import CliRunner

    from tether._cli.app import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr
