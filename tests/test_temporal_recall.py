"""Seed 000's three failure modes on Temporal, each done the way Temporal users do it today
(cancel the workflow, run it again) and with ``tether.temporal``, judged by the provider's own
ledger. The worker and the orchestrator hold supervisors of their own on one journal, as two
processes would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any

import pytest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)
from temporalio.service import RPCError

import tether
import tether.temporal
from tests.conftest import events_of, until
from tests.temporal_flows import ContinueAnyway, Monthly, RefundAnyway, TwoRefunds
from tests.temporal_world import (
    Gate,
    Provider,
    actions,
    both,
    cli,
    opened_on_history,
    start_refund,
    supervisor,
    worker,
)


async def closed(handle: WorkflowHandle[Any, Any]) -> WorkflowExecutionStatus | None:
    """The run's status once it has closed."""
    with contextlib.suppress(WorkflowFailureError):
        await handle.result()
    return (await handle.describe()).status


async def test_a_recalled_workflow_run_again_refunds_once_with_tether_twice_without(
        client: Client, provider: Provider, journal_url: str) -> None:
    """(1) Ghost action: the run is recalled mid-refund, the refund finishes anyway, and the
    orchestrator, believing it stopped, runs the workflow again. Plain Temporal: a second
    refund. tether: the recall let the refund finish within its grace and reported it, and
    the new run replays it by key."""
    pay = provider.pay
    async with worker(client, None, provider) as queue:
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "naive-ghost", "naive_refund", "N-1")
        await pay.applied()
        await handle.cancel()  # the recall a Temporal user has
        assert await closed(handle) is WorkflowExecutionStatus.CANCELED
        provider.hold = None
        await (await start_refund(client, queue, "naive-ghost", "naive_refund", "N-1")).result()
        assert pay.refund_count("N-1") == 2  # the customer is refunded twice

    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        drained = events_of(host)
        pay.mark()
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "wf-ghost", order="T-1")
        await pay.applied()
        (call,) = await actions(boss, "wf-ghost")
        recall = asyncio.create_task(tether.temporal.recall(
            handle, supervisor=boss, grace=10.0, reason="customer withdrew"))
        await drained("drain", call.delegation_id).wait()  # fenced; the refund is in flight
        provider.hold.set()  # and it finishes within the grace window
        report = await recall
        assert report.outcome is tether.DelegationState.RECALLED
        assert [a.idempotency_key for a in report.completed] == ["temporal:wf-ghost:refund:1"]
        # Cancelled, or done first: its one refund finished within the grace window.
        assert await closed(handle) in (WorkflowExecutionStatus.CANCELED,
                                        WorkflowExecutionStatus.COMPLETED)
        again = await start_refund(client, queue, "wf-ghost", order="T-1")
        assert await again.result() == report.completed[0].result  # replayed, not paid
        assert pay.refund_count("T-1") == 1 == len(report.completed)


async def test_a_cut_refund_whose_reply_was_lost_is_reported_completed_not_cancelled(
        client: Client, provider: Provider, journal_url: str) -> None:
    """(2) Lost receipt: the provider applied the refund, and the workflow is stopped before
    the reply comes back. Plain Temporal: the activity is cancelled, the run CANCELED, and no
    record says the money moved. tether: terminate cuts the call, which is then in doubt;
    the probe asks the provider, and the report says COMPLETED with its evidence."""
    pay = provider.pay
    async with worker(client, None, provider) as queue:
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "naive-lost", "naive_refund", "N-2")
        await pay.applied()
        await handle.cancel()
        assert await closed(handle) is WorkflowExecutionStatus.CANCELED  # "nothing happened"
        assert pay.refund_count("N-2") == 1  # yet the money moved

    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        pay.mark()
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "wf-lost", order="T-2")
        await pay.applied()
        report = await tether.temporal.terminate(handle, supervisor=boss, reason="cut it")
        assert report.outcome is tether.DelegationState.RECONCILED
        (done,) = report.completed
        assert done.idempotency_key == "temporal:wf-lost:refund:1"
        assert done.evidence is not None and done.evidence["provider_ref"] == \
            pay.entries("T-2")[0].ref
        # Terminated, or failed first by the cut activity's refusal.
        assert await closed(handle) in (WorkflowExecutionStatus.TERMINATED,
                                        WorkflowExecutionStatus.FAILED)
        assert pay.refund_count("T-2") == 1 == len(report.completed)


async def test_two_orchestrators_recall_and_run_a_workflow_again_and_one_refund_happens(
        client: Client, provider: Provider, journal_url: str) -> None:
    """(3) Recall race: two orchestrators recall the same run at once, then each runs the
    workflow again. Plain Temporal: each new run refunds. tether: one recall intent is
    accepted (the other is told the current sequence, or finds it recalled), and every new
    run replays the first refund."""
    pay = provider.pay
    async with worker(client, None, provider) as queue:
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "naive-race", "naive_refund", "N-3")
        await pay.applied()
        await asyncio.gather(handle.cancel(), handle.cancel())
        await closed(handle)
        provider.hold = None
        for _ in range(2):
            await (await start_refund(client, queue, "naive-race", "naive_refund",
                                      "N-3")).result()
        assert pay.refund_count("N-3") == 3

    async with both(journal_url, provider) as (host, boss), \
            supervisor(journal_url, provider) as rival, \
            worker(client, host, provider) as queue:
        pay.mark()
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "wf-race", order="T-3")
        await pay.applied()
        (call,) = await actions(boss, "wf-race")
        racing = [asyncio.create_task(tether.temporal.recall(
            handle, supervisor=who, grace=10.0, reason=f"orchestrator {n}"))
            for n, who in enumerate((boss, rival))]
        await events_of(host)("drain", call.delegation_id).wait()
        provider.hold.set()
        outcomes = await asyncio.gather(*racing, return_exceptions=True)
        reports = [o for o in outcomes if isinstance(o, tether.Report)]
        assert reports, outcomes
        for other in outcomes:
            if not isinstance(other, tether.Report):
                assert isinstance(other, tether.errors.ControlRefused), other
                assert "sequence" in str(other) and "1" in str(other), other
        assert len(await boss.journal.controls(call.delegation_id)) == 1  # one winner
        for report in reports:
            assert [a.tool for a in report.completed] == ["refund"]
        await closed(handle)  # cancelled by the winner: a new run of its id waits for that
        for _ in range(2):
            await (await start_refund(client, queue, "wf-race", order="T-3")).result()
        assert pay.refund_count("T-3") == 1


async def test_a_recall_before_any_activity_fences_the_run_before_temporal_hears_of_it(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """A run none of whose activities reached tether has no delegation yet: the recall opens
    one for it and fences it before the workflow is cancelled, so a step the workflow takes
    anyway is refused. The report is a recall's: nothing ran."""
    async with both(sqlite_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        handle = await client.start_workflow(RefundAnyway.run, args=["E-1"], id="wf-early",
                                             task_queue=queue)
        report = await tether.temporal.recall(handle, supervisor=boss, grace=5.0,
                                              reason="before it began")
        assert (report.outcome, report.actions, report.task_id) == (
            tether.DelegationState.RECALLED, (), "temporal:wf-early")
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        assert "recalled or terminated" in str(failed.value.cause.__cause__)
        assert provider.keys == [] and provider.pay.refund_count("E-1") == 0
        assert await actions(boss, "wf-early") == []


async def test_a_recall_waits_for_an_activity_in_a_workers_hands_before_its_run_is_journaled(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The run's first activity is in its worker's hands (started, in Temporal's eyes) but
    has not reached tether's plugin, so the journal holds nothing of the run, when a recall
    comes and reads the run's history. The recall fenced the run first and, within its
    grace, waits for the activity to close (tether refuses it) before it judges the run by
    that history: it reports a recall in which nothing ran, not a run a person must look
    at."""
    gate = Gate()
    workflow_id = f"wf-held-{uuid.uuid4().hex[:8]}"
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider, interceptors=[gate]) as queue:
        started = await start_refund(client, queue, workflow_id, order="G-1")
        await gate.held.wait()
        handle = await opened_on_history(client, started, gate)
        report = await tether.temporal.recall(handle, supervisor=boss, grace=30.0,
                                              reason="while its activity is held")
        with pytest.raises(WorkflowFailureError):
            await started.result()
    assert gate.opened.is_set()
    assert (report.outcome, report.actions) == (tether.DelegationState.RECALLED, ()), report
    assert provider.keys == [] and provider.pay.refund_count("G-1") == 0


async def test_a_recall_during_an_activity_retry_pays_once_and_reports_the_payment(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The refund applied and its reply was lost, so Temporal retries it, and the retry waits
    on the call's key; a recall lands meanwhile. Whichever comes first, the call in doubt is
    probed (applied), the report says so, and the retry never pays again."""
    provider.lose_reply = 1
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        handle = await start_refund(client, queue, "wf-retrying", order="R-1")
        await until(lambda: provider.lose_reply == 0, "the reply lost")
        report = await tether.temporal.recall(handle, supervisor=boss, grace=10.0,
                                              reason="while it retries")
        assert [(a.tool, a.state) for a in report.actions] == [
            ("refund", tether.ActionState.COMPLETED)]
        assert report.outcome in (tether.DelegationState.RECALLED,
                                  tether.DelegationState.RECONCILED)
        await closed(handle)
        assert provider.keys == ["temporal:wf-retrying:refund:1"]
        assert provider.pay.refund_count("R-1") == 1


async def test_tether_recall_from_a_shell_stops_a_temporal_run_in_both(
        client: Client, provider: Provider, journal_url: str, temporal_address: str) -> None:
    """`tether recall ID --temporal ADDRESS`, as an operator types it: the run is fenced in the
    journal, its in-flight refund finishes within the grace and is reported, and only then is
    the workflow cancelled in Temporal. A wrong address, a wrong namespace and --no-wait are
    one error line each, before anything is signed; without --temporal the command says that
    Temporal was not told."""
    pay = provider.pay
    async with supervisor(journal_url, provider) as host, \
            worker(client, host, provider) as queue:
        drained = events_of(host)
        provider.hold = asyncio.Event()
        handle = await start_refund(client, queue, "wf-shell", order="S-1")
        await pay.applied()
        (call,) = await actions(host, "wf-shell")
        did = call.delegation_id
        for bad, says in ((["--temporal", "127.0.0.1:1"], "cannot reach Temporal at"),
                          (["--temporal", temporal_address, "--namespace", "nowhere"],
                           "does not know workflow wf-shell"),
                          (["--temporal", temporal_address, "--no-wait"], "--no-wait")):
            code, out, err = await asyncio.to_thread(
                cli, "recall", did, "--reason", "r", "--journal", journal_url, *bad)
            assert code == 2 and out == "" and says in err, (bad, err)
            assert len(err.strip().splitlines()) == 1, err
        assert await host.journal.controls(did) == []
        recall = asyncio.ensure_future(asyncio.to_thread(
            cli, "recall", did, "--grace", "10", "--reason", "customer withdrew",
            "--temporal", temporal_address, "--journal", journal_url, "--json"))
        await drained("drain", did).wait()  # fenced; the refund is in flight
        assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING
        provider.hold.set()  # it finishes within the grace
        code, out, err = await recall
        assert code == 0, err
        answer = json.loads(out)
        assert answer["report"]["outcome"] == "RECALLED"
        done = set(answer["report"]["completed"])
        assert [a["idempotency_key"] for a in answer["report"]["actions"]
                if a["id"] in done] == ["temporal:wf-shell:refund:1"]
        run_id = (await handle.describe()).run_id
        assert answer["temporal"] == f"Temporal: workflow wf-shell run {run_id} cancelled.", \
            answer
        assert await closed(handle) in (WorkflowExecutionStatus.CANCELED,
                                        WorkflowExecutionStatus.COMPLETED)
        assert pay.refund_count("S-1") == 1
        # Without --temporal: fenced in the journal, and said so.
        provider.hold = asyncio.Event()
        second = await start_refund(client, queue, "wf-shell-2", order="S-2")
        await pay.applied()
        (call,) = await actions(host, "wf-shell-2")
        code, out, err = await asyncio.to_thread(
            cli, "terminate", call.delegation_id, "--reason", "stop", "--journal",
            journal_url, "--json")
        assert code == 0, err
        answer = json.loads(out)
        assert "Temporal was not told" in answer["temporal"], answer
        provider.hold.set()
        # Temporal was not told: the run goes on, and its next step is refused (it fails).
        assert await closed(second) in (WorkflowExecutionStatus.FAILED,
                                        WorkflowExecutionStatus.COMPLETED)


async def test_a_recalled_run_stays_out_after_an_older_run_of_its_id_is_recalled_too(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Run 2 of an id is recalled before it acted; then someone recalls the closed run 1 by
    its handle, which opens (and fences) a later epoch for run 1. Run 2's step is refused all
    the same: every epoch of a run is looked at, not only the task's newest."""
    pay = provider.pay
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        # Run 1 refunds through another activity, so that run 2's refund has a key of its own.
        first = await start_refund(client, queue, "wf-twice", "keyed_refund", "Y-1")
        await first.result()
        second = await client.start_workflow(RefundAnyway.run, args=["Y-2"], id="wf-twice",
                                             task_queue=queue)
        await tether.temporal.recall(second, supervisor=boss, grace=2.0, reason="stop run 2")
        await tether.temporal.recall(
            client.get_workflow_handle("wf-twice", run_id=first.result_run_id),
            supervisor=boss, grace=2.0, reason="stop run 1 too")
        with pytest.raises(WorkflowFailureError) as failed:  # cancelled, it steps on anyway
            await second.result()
        assert "recalled or terminated" in str(failed.value.cause.__cause__)
        assert [pay.refund_count(o) for o in ("Y-1", "Y-2")] == [1, 0]


async def test_a_recalled_run_that_continues_as_new_acts_no_more(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The run ignores the cancel and continues as new, whose refund is the step the recall
    was to stop: refused, since a run is refused once any run of its chain (Temporal's first
    run id) was recalled; the refund never happens and the chain ends FAILED."""
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        handle = await client.start_workflow(ContinueAnyway.run, args=["CN-1"], id="wf-can",
                                             task_queue=queue)
        report = await tether.temporal.recall(handle, supervisor=boss, grace=2.0,
                                              reason="stop it")
        assert report.outcome is tether.DelegationState.RECALLED
        latest = client.get_workflow_handle("wf-can")
        assert await closed(latest) is WorkflowExecutionStatus.FAILED
        assert (await latest.describe()).run_id != handle.first_execution_run_id  # run 2
    assert provider.pay.refund_count("CN-1") == 0


async def test_a_recall_of_a_closed_run_reports_what_it_did(
        client: Client, provider: Provider, journal_url: str, temporal_address: str) -> None:
    """The run refunded and completed; a recall of it by its handle, or of its delegation
    from a shell, reports that refund (its last epoch as it stands), not an empty epoch
    opened for it."""
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        handle = await start_refund(client, queue, "wf-closed", order="CL-1")
        await handle.result()
        (call,) = await actions(boss, "wf-closed")
        report = await tether.temporal.recall(handle, supervisor=boss, grace=2.0,
                                              reason="late")
        code, out, err = await asyncio.to_thread(
            cli, "recall", call.delegation_id, "--grace", "2", "--temporal", temporal_address,
            "--journal", journal_url, "--json")
    assert (report.delegation_id, [a.idempotency_key for a in report.completed]) == (
        call.delegation_id, ["temporal:wf-closed:refund:1"])
    assert code == 0, err
    shown = json.loads(out)["report"]
    assert (shown["delegation"], shown["completed"]) == (call.delegation_id, [call.id])
    assert provider.pay.refund_count("CL-1") == 1


async def test_a_recall_of_a_new_start_that_replayed_its_refund_is_not_a_persons_problem(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Run 2 of a workflow id replays run 1's refund (its key's record) and completes: its
    own delegation holds no action, only the replay. Temporal shows the activity completed;
    the recall finds the call by that replay and reports the run as it stands, not as a
    run a worker without tether's plugin may have paid for."""
    workflow_id = f"wf-replayed-{uuid.uuid4().hex[:8]}"
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        await (await start_refund(client, queue, workflow_id, order="RP-1")).result()
        again = await start_refund(client, queue, workflow_id, order="RP-1")
        await again.result()
        report = await tether.temporal.recall(again, supervisor=boss, grace=2.0,
                                              reason="after it replayed")
    assert provider.pay.refund_count("RP-1") == 1
    assert report.outcome is not tether.DelegationState.NEEDS_ATTENTION, report
    assert "may have run" not in (report.reason or ""), report


async def test_each_run_of_a_chain_makes_its_own_call_and_a_new_start_replays_them(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A loop that continues as new makes the same call at the same place in each run: each
    run's refund is a call of its own (its key holds its run's place in the chain), not a
    replay of run 1's. A new start of the same id (a new chain) replays all three by key."""
    async with supervisor(journal_url, provider) as host, \
            worker(client, host, provider) as queue:
        first = await client.start_workflow(Monthly.run, args=["M-1", 3], id="wf-monthly",
                                            task_queue=queue)
        assert await first.result() == 3
        again = await client.start_workflow(Monthly.run, args=["M-1", 3], id="wf-monthly",
                                            task_queue=queue)
        assert await again.result() == 3
        calls = await actions(host, "wf-monthly")
    assert sorted({c.idempotency_key for c in calls}) == [
        "temporal:wf-monthly:refund:1", "temporal:wf-monthly:refund:1@1",
        "temporal:wf-monthly:refund:1@2"]
    assert provider.pay.refund_count("M-1") == 3


async def test_a_handle_of_a_closed_chain_never_recalls_a_later_start_of_its_id(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The handle from the first start of an id: that chain completed, and the id was started
    again. A recall through the old handle refuses, one clear error, and signs nothing: the
    later start is not the work the handle names (Temporal's own cancel through it would not
    reach it either), so it completes."""
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        old = await client.start_workflow(TwoRefunds.run, args=["S-1", "S-2"], id="wf-stale",
                                          task_queue=queue)
        await until(lambda: provider.pay.refund_count("S-1") == 1, "the first refund")
        await old.signal(TwoRefunds.proceed)
        await old.result()
        # The same work again (its calls replay by key), waiting for its signal.
        new = await client.start_workflow(TwoRefunds.run, args=["S-1", "S-2"], id="wf-stale",
                                          task_queue=queue)
        rows: list[Any] = []
        for _ in range(6000):  # until the later start's delegation is open (at most a minute)
            await host.journal.flush()
            rows = [d for d in await host.journal.delegations()
                    if d.task_id == tether.temporal.task_of("wf-stale")]
            if len(rows) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(rows) == 2
        with pytest.raises(tether.errors.UserError, match="a later start of the id runs now"):
            await tether.temporal.recall(old, supervisor=boss, grace=1.0, reason="stale")
        await new.signal(TwoRefunds.proceed)
        assert len(await new.result()) == 2
        rows = [await host.journal.get(d.id) for d in rows]
    assert [d.control_seq for d in rows] == [0, 0]
    assert [provider.pay.refund_count(f"S-{n}") for n in (1, 2)] == [1, 1]


async def test_a_recall_after_the_runs_worker_stopped_reports_the_earlier_epoch(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The run refunded on a worker that then stopped (a rolling deploy): its delegation
    ended without anyone's intent, so the recall opens and fences the run's next epoch.
    The report holds the earlier epoch's refund too, and says it was not free of side
    effects; the run's next step is refused."""
    async with both(journal_url, provider) as (host, boss):
        async with worker(client, host, provider) as queue:
            run = await client.start_workflow(TwoRefunds.run, args=["EE-1", "EE-2"],
                                              id="wf-ended", task_queue=queue)
            await until(lambda: provider.pay.refund_count("EE-1") == 1, "the first refund")
        report = await tether.temporal.recall(run, supervisor=boss, grace=1.0,
                                              reason="customer withdrew")
        async with worker(client, host, provider, queue=queue):
            with contextlib.suppress(RPCError):  # cancelled already, or not
                await run.signal(TwoRefunds.proceed)
            assert await closed(run) in (WorkflowExecutionStatus.CANCELED,
                                         WorkflowExecutionStatus.FAILED)
    assert report.epoch == 1
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-ended:refund:1", tether.ActionState.COMPLETED)]
    assert report.verdict == "RECALLED_CLEAN", report.verdict
    assert [provider.pay.refund_count(o) for o in ("EE-1", "EE-2")] == [1, 0]


async def test_a_continued_runs_keys_never_meet_another_workflow_ids(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Run 2 of workflow ``wf-col`` and run 1 of workflow ``wf-col:1`` make the same call at
    the same place: each is a call of its own (three refunds of three asked), whatever the
    workflow ids hold."""
    async with supervisor(journal_url, provider) as host, \
            worker(client, host, provider) as queue:
        for workflow_id, runs in (("wf-col", 2), ("wf-col:1", 1)):
            handle = await client.start_workflow(Monthly.run, args=["C-1", runs],
                                                 id=workflow_id, task_queue=queue)
            assert await handle.result() == runs
    assert provider.pay.refund_count("C-1") == 3
