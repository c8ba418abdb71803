"""Workflows for the Temporal tests. Workflow code runs in Temporal's sandbox, which imports
this module again: it imports Temporal's SDK alone, and names activities by their names."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

RETRIES = RetryPolicy(initial_interval=timedelta(milliseconds=100), backoff_coefficient=1.0,
                      maximum_attempts=5)


def closing(abandon: bool) -> tuple[workflow.ParentClosePolicy,
                                   workflow.ChildWorkflowCancellationType]:
    """A child's policies: the SDK's defaults, or abandoned (Temporal tells the child nothing
    when its parent is cancelled or closes)."""
    if abandon:
        return (workflow.ParentClosePolicy.ABANDON,
                workflow.ChildWorkflowCancellationType.ABANDON)
    return (workflow.ParentClosePolicy.TERMINATE,
            workflow.ChildWorkflowCancellationType.WAIT_CANCELLATION_COMPLETED)


async def _refund(order: str) -> str:
    ref: str = await workflow.execute_activity(
        "refund", args=[order, 1250], start_to_close_timeout=timedelta(seconds=60),
        retry_policy=RETRIES)
    return ref


@workflow.defn
class Refund:
    """One refund by the activity named ``activity`` (tether's tool, or a naive one), tried at
    most ``attempts`` times."""

    @workflow.run
    async def run(self, activity: str, order_id: str, cents: int, attempts: int = 5) -> str:
        ref: str = await workflow.execute_activity(
            activity, args=[order_id, cents], start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=2),
            retry_policy=dataclasses.replace(RETRIES, maximum_attempts=attempts))
        return ref


@workflow.defn
class TwoRefunds:
    """A refund, then a second one once signalled ``go``: a step after a recall."""

    def __init__(self) -> None:
        self.go = False

    @workflow.signal
    def proceed(self) -> None:
        self.go = True

    @workflow.run
    async def run(self, first: str, second: str) -> list[str]:
        refs: list[str] = [await workflow.execute_activity(
            "refund", args=[first, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES)]
        await workflow.wait_condition(lambda: self.go)
        refs.append(await workflow.execute_activity(
            "refund", args=[second, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES))
        return refs


@workflow.defn
class RefundAnyway:
    """Waits for ``proceed``, then refunds (by ``activity``), even once cancelled: a step a
    fence must stop."""

    def __init__(self) -> None:
        self.go = False

    @workflow.signal
    def proceed(self) -> None:
        self.go = True

    @workflow.run
    async def run(self, order_id: str, activity: str = "refund") -> str:
        with contextlib.suppress(asyncio.CancelledError):  # goes on regardless
            await workflow.wait_condition(lambda: self.go)
        ref: str = await workflow.execute_activity(
            activity, args=[order_id, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES)
        return ref


@workflow.defn
class RefundLocally:
    """The refund as a local activity (run by the workflow's own worker, no task queue)."""

    @workflow.run
    async def run(self, order_id: str, cents: int) -> str:
        ref: str = await workflow.execute_local_activity(
            "refund", args=[order_id, cents], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES)
        return ref


@workflow.defn
class ParentOfRefunds:
    """Starts ``TwoRefunds`` as a child workflow (on its task queue), waits for it, then
    refunds ``own``: a tree whose parent has no activity before its child's. ``abandon``: the
    child is left alone when the parent is cancelled or closes (Temporal's ABANDON)."""

    @workflow.run
    async def run(self, child_id: str, first: str, second: str, own: str,
                  abandon: bool = False) -> list[str]:
        policy, cancel = closing(abandon)
        refs: list[str] = await workflow.execute_child_workflow(
            TwoRefunds.run, args=[first, second], id=child_id, parent_close_policy=policy,
            cancellation_type=cancel)
        refs.append(await workflow.execute_activity(
            "refund", args=[own, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES))
        return refs


@workflow.defn
class Leaver:
    """Refunds ``own``; starts ``TwoRefunds`` as an abandoned child if ``child_id``; waits for
    ``proceed``; refunds ``second`` if given. It may close while its child runs on."""

    def __init__(self) -> None:
        self.go = False

    @workflow.signal
    def proceed(self) -> None:
        self.go = True

    @workflow.run
    async def run(self, own: str, child_id: str, first: str, second_of_child: str,
                  second: str) -> str:
        await workflow.execute_activity("refund", args=[own, 1250],
                                        start_to_close_timeout=timedelta(seconds=60),
                                        retry_policy=RETRIES)
        if child_id:
            await workflow.start_child_workflow(
                TwoRefunds.run, args=[first, second_of_child], id=child_id,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON)
        await workflow.wait_condition(lambda: self.go)
        if second:
            await workflow.execute_activity("refund", args=[second, 1250],
                                            start_to_close_timeout=timedelta(seconds=60),
                                            retry_policy=RETRIES)
        return "done"


@workflow.defn
class Middle:
    """Refunds ``own`` if given (else a child with no activity of its own), then runs
    ``Refund`` as its own child (on ``kid_queue`` if given)."""

    @workflow.run
    async def run(self, kid_id: str, order: str, kid_queue: str = "", own: str = "") -> str:
        if own:
            await workflow.execute_activity("refund", args=[own, 1250],
                                            start_to_close_timeout=timedelta(seconds=60),
                                            retry_policy=RETRIES)
        ref: str = await workflow.execute_child_workflow(
            Refund.run, args=["refund", order, 1250, 3], id=kid_id,
            task_queue=kid_queue or None)
        return ref


@workflow.defn
class ParentElsewhere:
    """Refunds ``own``, then runs ``Refund`` as a child workflow on ``child_queue``, or,
    given ``middle``, ``Middle`` there (whose child refunds), or (``middle_here``) ``Middle``
    on this queue and its child there."""

    @workflow.run
    async def run(self, own: str, child_id: str, child_queue: str, order: str,
                  middle: str = "", middle_here: bool = False) -> list[str]:
        mine: str = await workflow.execute_activity(
            "refund", args=[own, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES)
        child: str = await (workflow.execute_child_workflow(  # Middle here, its child there
            Middle.run, args=[child_id, order, child_queue, f"{own}-mid"], id=middle)
            if middle_here
            else workflow.execute_child_workflow(
                Middle.run, args=[child_id, order], id=middle, task_queue=child_queue)
            if middle else workflow.execute_child_workflow(
                Refund.run, args=["refund", order, 1250, 3], id=child_id,
                task_queue=child_queue))
        return [mine, child]


@workflow.defn
class ParentBusy:
    """Starts ``TwoRefunds`` on ``child_queue``, refunds ``own`` meanwhile, then waits for the
    child: a parent with a call in flight while its child, elsewhere, goes on. ``abandon``:
    Temporal leaves the child running when this run is cancelled or closes; ``own_first``:
    the refund comes before the child starts, so that the parent's run is hosted first and
    the child is apart."""

    @workflow.run
    async def run(self, child_id: str, child_queue: str, first: str, second: str,
                  own: str, abandon: bool = False, own_first: bool = False) -> list[str]:
        policy, cancel = closing(abandon)
        if own_first:  # the parent's run opened before its child starts
            mine = await _refund(own)
        child = await workflow.start_child_workflow(
            TwoRefunds.run, args=[first, second], id=child_id, task_queue=child_queue,
            parent_close_policy=policy, cancellation_type=cancel)
        if not own_first:
            mine = await _refund(own)
        refs: list[str] = await child
        return [mine, *refs]


@workflow.defn
class ContinueAnyway:
    """Waits for ``proceed`` (even once cancelled), then continues as new; the run it
    continues as refunds: RefundAnyway, with the step after the wait in the next run."""

    def __init__(self) -> None:
        self.go = False

    @workflow.signal
    def proceed(self) -> None:
        self.go = True

    @workflow.run
    async def run(self, order_id: str, hop: int = 0) -> str:
        if hop == 0:
            with contextlib.suppress(asyncio.CancelledError):  # goes on regardless
                await workflow.wait_condition(lambda: self.go)
            workflow.continue_as_new(args=[order_id, 1])
        ref: str = await workflow.execute_activity(
            "refund", args=[order_id, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES)
        return ref


@workflow.defn
class MiddleWaits:
    """Refunds ``own``, waits for ``proceed``, then runs ``Refund`` of ``order`` as its own
    child on its own queue."""

    def __init__(self) -> None:
        self.go = False

    @workflow.signal
    def proceed(self) -> None:
        self.go = True

    @workflow.run
    async def run(self, kid_id: str, own: str, order: str) -> str:
        await workflow.execute_activity("refund", args=[own, 1250],
                                        start_to_close_timeout=timedelta(seconds=60),
                                        retry_policy=RETRIES)
        await workflow.wait_condition(lambda: self.go)
        ref: str = await workflow.execute_child_workflow(
            Refund.run, args=["refund", order, 1250, 3], id=kid_id)
        return ref


@workflow.defn
class ParentBusyGrand:
    """Starts ``MiddleWaits`` on ``mid_queue``, refunds ``own`` meanwhile, then waits for it:
    a grandchild started, elsewhere, while the parent's own call is in flight."""

    @workflow.run
    async def run(self, mid_id: str, kid_id: str, mid_queue: str, mid_own: str, order: str,
                  own: str) -> list[str]:
        child = await workflow.start_child_workflow(
            MiddleWaits.run, args=[kid_id, mid_own, order], id=mid_id, task_queue=mid_queue)
        mine: str = await workflow.execute_activity(
            "refund", args=[own, 1250], start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RETRIES)
        return [mine, await child]


@workflow.defn
class ParentOfWaiter:
    """Runs ``RefundAnyway`` as its child ``kid_id`` on this queue and waits for it."""

    @workflow.run
    async def run(self, kid_id: str, order: str) -> str:
        ref: str = await workflow.execute_child_workflow(RefundAnyway.run, args=[order],
                                                         id=kid_id)
        return ref


@workflow.defn
class Monthly:
    """Refunds ``order`` once per run, continuing as new until ``runs`` runs: a loop whose
    runs each make the same call at the same place in their run."""

    @workflow.run
    async def run(self, order: str, runs: int, done: int = 0) -> int:
        await workflow.execute_activity("refund", args=[order, 1250],
                                        start_to_close_timeout=timedelta(seconds=60),
                                        retry_policy=RETRIES)
        if done + 1 < runs:
            workflow.continue_as_new(args=[order, runs, done + 1])
        return done + 1


@workflow.defn
class LocalThenBug:
    """A local refund, then a bug in the workflow code: its workflow task fails (and the
    local activity's marker with it), and is tried again."""

    @workflow.run
    async def run(self, order_id: str) -> str:
        await workflow.execute_local_activity(
            "naive_refund", args=[order_id, 5], start_to_close_timeout=timedelta(seconds=60))
        raise RuntimeError("a bug in the workflow")


@workflow.defn
class SameIdTwice:
    """Two activities under one activity id: the first refunds, the second waits on a task
    queue no worker polls."""

    @workflow.run
    async def run(self, order_id: str, nowhere: str) -> str:
        await workflow.execute_activity(
            "naive_refund", args=[order_id, 5], activity_id="pay",
            start_to_close_timeout=timedelta(seconds=60))
        ref: str = await workflow.execute_activity(
            "naive_refund", args=[order_id, 5], activity_id="pay", task_queue=nowhere,
            start_to_close_timeout=timedelta(seconds=60))
        return ref
