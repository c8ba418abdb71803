"""tether on Temporal, against a real dev server: each activity journaled before it runs, keyed
by its place in the workflow, fenced once its run is recalled."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import RawValue, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

import tether
import tether.temporal
from tests.conftest import until
from tests.temporal_flows import Refund, RefundLocally, TwoRefunds
from tests.temporal_world import Provider, actions, quiet, start_refund, supervisor, worker


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


async def test_an_activity_that_is_no_tether_tool_is_journaled_as_external(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """Fail closed: an activity nobody declared to tether is EXTERNAL, journaled and keyed
    like a payment (its arguments as Temporal encodes them), and may hand its provider the
    key; with no probe, a call of it left in doubt would stay UNKNOWN."""
    async with supervisor(sqlite_url, provider) as sup, worker(client, sup, provider) as queue:
        handle = await start_refund(client, queue, "wf-plain", "keyed_refund")
        ref = await handle.result()
        (done,) = await actions(sup, "wf-plain")
        assert (done.tool, done.effect, done.state) == (
            "keyed_refund", tether.Effect.EXTERNAL, tether.ActionState.COMPLETED)
        assert done.args == {"args": ["A-1", 1250]} and done.result == ref
        assert provider.keys == [done.idempotency_key] == ["temporal:wf-plain:keyed_refund:1"]
        assert [e.key for e in provider.pay.entries("A-1")] == provider.keys


async def test_a_dynamic_activity_is_journaled_with_its_arguments(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """An activity with no name of its own (``dynamic=True``) gets any name a workflow calls:
    it runs through the gateway as EXTERNAL, its arguments journaled as Temporal sent them.
    It failed every attempt ("Payload is not JSON serializable": the SDK hands it its
    arguments as one list of raw payloads)."""
    seen: list[str] = []

    @activity.defn(dynamic=True)
    async def anything(args: Sequence[RawValue]) -> str:
        seen.append(tether.temporal.idempotency_key())
        return f"{activity.info().activity_type} done"

    queue = f"q-{uuid.uuid4().hex[:12]}"
    async with supervisor(sqlite_url, provider) as sup, \
            Worker(client, task_queue=queue, workflows=[Refund], activities=[anything],
                   plugins=[tether.temporal.Plugin(sup)]):
        handle = await start_refund(client, queue, "wf-dynamic", "unheard_of")
        assert await handle.result() == "unheard_of done"
        (done,) = await actions(sup, "wf-dynamic")
    assert (done.tool, done.effect, done.state) == (
        "unheard_of", tether.Effect.EXTERNAL, tether.ActionState.COMPLETED)
    assert done.args == {"args": ["A-1", 1250]}
    assert seen == [done.idempotency_key] == ["temporal:wf-dynamic:unheard_of:1"]


async def test_a_run_that_moves_to_another_worker_continues_at_a_new_epoch(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A worker that stops ends its runs' delegations without a fence: the run's next activity, on
    another worker process, re-delegates its task at the next epoch and goes on; nothing it
    did before is done again."""
    async with supervisor(journal_url, provider) as first, \
            worker(client, first, provider) as queue:
        handle = await client.start_workflow(TwoRefunds.run, args=["M-1", "M-2"],
                                             id="wf-move", task_queue=queue)
        await until(lambda: provider.pay.refund_count("M-1") == 1, "the first refund")
        # Stopped between workflow tasks (one a stopping worker held would first time out,
        # in 10 s): the run waits for its signal.
        await quiet(handle)
    async with supervisor(journal_url, provider) as second, \
            worker(client, second, provider, queue):
        await handle.signal(TwoRefunds.proceed)
        refs = await handle.result()
        assert [provider.pay.refund_count(o) for o in ("M-1", "M-2")] == [1, 1]
        assert provider.keys == ["temporal:wf-move:refund:1", "temporal:wf-move:refund:2"]
        done = await actions(second, "wf-move")
        assert [a.result for a in done] == refs
        moved = done[1].delegation_id  # the new epoch's: it ends when its run has closed
        await until(lambda: second.runtime(moved) is None, "the new epoch's end")
        await second.journal.flush()
        rows = sorted((d for d in await second.journal.delegations()
                       if d.task_id == "temporal:wf-move"), key=lambda d: d.epoch)
        assert [(d.epoch, d.state, d.control_seq, d.result) for d in rows] == [
            (0, tether.DelegationState.SUCCEEDED, 0, "worker stopped"),
            (1, tether.DelegationState.SUCCEEDED, 0, "COMPLETED")]
        assert rows[1].id == moved and done[0].delegation_id == rows[0].id


async def test_wrong_arguments_to_the_temporal_api_are_one_clear_error(
        sqlite_url: str, provider: Provider) -> None:
    with pytest.raises(tether.errors.UserError, match=r"needs an open tether\.Supervisor"):
        tether.temporal.Plugin("sqlite:///x.db")  # type: ignore[arg-type]
    async with supervisor(sqlite_url, provider) as sup:
        with pytest.raises(tether.errors.UserError, match="not a tether tool"):
            tether.temporal.Plugin(sup, tools=[print])  # type: ignore[list-item]
        with pytest.raises(tether.errors.UserError, match=r"activity names to tether\.Effect"):
            tether.temporal.Plugin(sup, effects={"x": "READ_ONLY"})  # type: ignore[dict-item]
        with pytest.raises(tether.errors.UserError, match="refund is a tool"):
            tether.temporal.Plugin(sup, tools=[provider.refund],
                                   effects={"refund": tether.Effect.READ_ONLY})
        async def by_args(args: list[Any], *, idempotency_key: str) -> tether.ProbeResult:
            return tether.ProbeResult(tether.ProbeOutcome.UNKNOWN, {})

        probe = tether.temporal.ActivityProbe(by_args, dispatch_deadline=60.0)
        with pytest.raises(tether.errors.UserError, match="must be an async function"):
            tether.temporal.ActivityProbe(print, dispatch_deadline=60.0)  # type: ignore[arg-type]
        lookup = provider.refund.probe  # a tool's probe: called with the tool's arguments
        assert lookup is not None
        with pytest.raises(tether.errors.UserError, match=r"called as probe\(args="):
            tether.temporal.ActivityProbe(lookup, dispatch_deadline=60.0)
        with pytest.raises(tether.errors.UserError, match="dispatch_deadline"):
            tether.temporal.ActivityProbe(by_args, dispatch_deadline=0)
        with pytest.raises(tether.errors.UserError,
                           match=r"tether\.temporal\.ActivityProbe values"):
            tether.temporal.Plugin(sup, probes={"x": by_args})  # type: ignore[dict-item]
        with pytest.raises(tether.errors.UserError, match="refund is a tool, whose probe"):
            tether.temporal.Plugin(sup, tools=[provider.refund], probes={"refund": probe})
        with pytest.raises(tether.errors.UserError, match="READ_ONLY, which is never in doubt"):
            tether.temporal.Plugin(sup, effects={"look": tether.Effect.READ_ONLY},
                                   probes={"look": probe})
        lazy = await Client.connect("127.0.0.1:1", lazy=True)
        with pytest.raises(tether.errors.UserError, match="no activity nowhere is registered"):
            Worker(lazy, task_queue="q", workflows=[Refund],
                   plugins=[tether.temporal.Plugin(sup, tools=[provider.refund],
                                                   probes={"nowhere": probe})])

        @activity.defn(name="refund")
        async def plain(order_id: str, cents: int) -> str:
            return "ref"

        # A namesake: the supervisor probes calls of "refund" with the tool it was given.
        with pytest.raises(tether.errors.UserError, match="knows a tool refund with another"):
            Worker(lazy, task_queue="q", workflows=[Refund], activities=[plain],
                   plugins=[tether.temporal.Plugin(sup, probes={"refund": probe})])
        with pytest.raises(tether.errors.UserError, match="expected a Temporal WorkflowHandle"):
            await tether.temporal.recall("wf-1", supervisor=sup,  # type: ignore[arg-type]
                                         grace=1.0)
    handle = Client.__new__(Client).get_workflow_handle("wf-1")  # no server asked
    with pytest.raises(tether.errors.UserError, match=r"open tether\.Supervisor"):
        await tether.temporal.terminate(handle, supervisor=sup)  # closed


async def test_a_plain_function_activity_opens_its_run_and_gets_its_key(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """A ``def`` activity (run in a thread) as a run's first step: it opens the run's
    delegation like any other (the SDK offers no client to such an activity) and reads its
    key from the thread."""
    async with supervisor(sqlite_url, provider) as sup, worker(client, sup, provider) as queue:
        handle = await start_refund(client, queue, "wf-sync", "ledger_note")
        assert await handle.result() == "noted A-1"
        (done,) = await actions(sup, "wf-sync")
        assert (done.tool, done.state) == ("ledger_note", tether.ActionState.COMPLETED)
        assert provider.keys == ["temporal:wf-sync:ledger_note:1"]


async def test_a_local_activity_is_journaled_and_keyed_by_its_place_too(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    provider.reject_first = 1  # and its retry, done by the workflow's worker, keeps the key
    async with supervisor(sqlite_url, provider) as sup, worker(client, sup, provider) as queue:
        handle = await client.start_workflow(RefundLocally.run, args=["L-1", 1250],
                                             id="wf-local", task_queue=queue)
        ref = await handle.result()
        assert provider.keys == ["temporal:wf-local:refund:1"] * 2
        assert [(a.state, a.result) for a in await actions(sup, "wf-local")] == [
            (tether.ActionState.FAILED, None), (tether.ActionState.COMPLETED, ref)]
        assert provider.pay.refund_count("L-1") == 1


async def test_a_run_of_a_workflow_id_with_other_arguments_is_refused_at_the_same_place(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """A run of a workflow id is the same task: the call at the same place with other
    arguments is refused (the Stripe rule), never paid as if it were new."""
    async with supervisor(sqlite_url, provider) as sup, worker(client, sup, provider) as queue:
        await (await start_refund(client, queue, "wf-args")).result()
        other = await client.start_workflow(
            Refund.run, args=["refund", "A-1", 9999], id="wf-args", task_queue=queue,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE)
        with pytest.raises(WorkflowFailureError) as failed:
            await other.result()
        cause = failed.value.cause
        assert isinstance(cause, ActivityError) and isinstance(cause.cause, ApplicationError)
        assert cause.cause.non_retryable and "different arguments" in str(cause.cause)
        assert [e.cents for e in provider.pay.entries("A-1")] == [1250]
