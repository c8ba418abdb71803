"""Child workflows are child delegations: a parent run's recall or terminate reaches the
activities of the child workflows it started, waits for them within its grace and reports
them, whatever Temporal does with the children; a worker that stops hands the whole tree on,
each run at its next epoch. Judged by the provider's ledger."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
)

import tether
import tether.temporal
from tests.conftest import events_of, until
from tests.temporal_flows import (
    Leaver,
    MiddleWaits,
    ParentBusy,
    ParentBusyGrand,
    ParentElsewhere,
    ParentOfRefunds,
    TwoRefunds,
)
from tests.temporal_world import Gate, Provider, both, cli, quiet, supervisor, worker
from tests.test_trust import raw


@contextlib.asynccontextmanager
async def two_workers(client: Client, url: str, provider: Provider, gate: Gate | None = None
                      ) -> AsyncIterator[
        tuple[tether.Supervisor, tether.Supervisor, tether.Supervisor, str, str]]:
    """Workers A and B on queues of their own, each with its supervisor (and B with its own
    client, as another process has), the orchestrator's supervisor, on one journal: yields
    A's, B's and the orchestrator's supervisors, then A's and B's queues. ``gate`` holds B's
    activities until it opens."""
    async with both(url, provider) as (a, boss), supervisor(url, provider) as b:
        other = await Client.connect(client.service_client.config.target_host)
        async with worker(client, a, provider) as first, \
                worker(other, b, provider, interceptors=() if gate is None else (gate,)) \
                as second:
            yield a, b, boss, first, second


async def hosted_apart(boss: tether.Supervisor, a: tether.Supervisor, parent_id: str,
                       gate: Gate) -> Any:
    """Once the parent's own call is in flight on worker A (so A hosts the parent's run), open
    B's ``gate``: the child's first activity on B then finds its parent hosted elsewhere and
    is a delegation apart. Opened first on B, the child's activity would host the parent's
    run itself, and the parent's call on A would be its guest: the tree in one process.
    Returns the parent's delegation."""
    (top,) = await delegation_of(boss, parent_id)
    assert top.owner_id == a.owner_id, "the parent's run is hosted on worker A"
    gate.opened.set()
    return top


async def start_tree(client: Client, queue: str, parent_id: str, child_id: str, order: str,
                     *, abandon: bool = False) -> WorkflowHandle[Any, Any]:
    """A parent whose child refunds ``order``-1, then (signalled) ``order``-2; then the
    parent refunds ``order``-3."""
    return await client.start_workflow(
        ParentOfRefunds.run, args=[child_id, f"{order}-1", f"{order}-2", f"{order}-3", abandon],
        id=parent_id, task_queue=queue)


async def delegation_of(sup: tether.Supervisor, workflow_id: str) -> list[Any]:
    await sup.journal.flush()
    return [d for d in await sup.journal.delegations()
            if d.task_id == tether.temporal.task_of(workflow_id)]


async def recall_once_fenced(parent: WorkflowHandle[Any, Any], boss: tether.Supervisor,
                             fenced: asyncio.Event, hold: asyncio.Event,
                             grace: float) -> tether.Report:
    """Recall ``parent``; once ``fenced`` is set (a drain began, so the call ``hold`` holds is
    in flight under a fence) release it; the report, once the run closed."""
    recall = asyncio.create_task(tether.temporal.recall(
        parent, supervisor=boss, grace=grace, reason="customer withdrew"))
    await asyncio.wait_for(fenced.wait(), 60)
    hold.set()
    report = await recall
    with contextlib.suppress(WorkflowFailureError):
        await parent.result()
    return report


async def recall_in_grace(parent: WorkflowHandle[Any, Any], boss: tether.Supervisor,
                          fenced: asyncio.Event) -> asyncio.Task[tether.Report]:
    """Recall ``parent`` with a long grace: the recall, still waiting, once ``fenced`` is set
    (its drain began: the fence stands and the grace runs)."""
    recall = asyncio.create_task(tether.temporal.recall(
        parent, supervisor=boss, grace=30.0, reason="customer withdrew"))
    await asyncio.wait_for(fenced.wait(), 60)
    return recall


async def test_a_parents_recall_waits_for_its_childs_refund_and_fences_the_child(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The child workflow's refund is in flight when its parent is recalled. The child's run is
    a child delegation of the parent's (opened with it: the parent ran nothing yet), so the
    fence covers it, the grace window waits for its refund and the report has it. The child
    is abandoned by Temporal (the parent's cancel never reaches it): its next refund is
    refused all the same."""
    pay = provider.pay
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        drained = events_of(host)
        provider.hold = asyncio.Event()
        parent = await start_tree(client, queue, "wf-tree", "wf-tree-kid", "K", abandon=True)
        await pay.applied()  # the child's first refund applied; its reply is held
        (top,) = await delegation_of(boss, "wf-tree")
        (kid,) = await delegation_of(boss, "wf-tree-kid")
        assert (top.parent_id, kid.parent_id) == (None, top.id)
        recall = asyncio.create_task(tether.temporal.recall(
            parent, supervisor=boss, grace=10.0, reason="customer withdrew"))
        await drained("drain", top.id).wait()  # fenced; the child's refund is in flight
        provider.hold.set()  # and it finishes within the grace window
        report = await recall
        assert report.outcome is tether.DelegationState.RECALLED
        (child_report,) = report.children
        assert (child_report.delegation_id, child_report.outcome) == (
            kid.id, tether.DelegationState.RECALLED)
        assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
            ("temporal:wf-tree-kid:refund:1", tether.ActionState.COMPLETED)]
        child = client.get_workflow_handle("wf-tree-kid")
        await child.signal(TwoRefunds.proceed)  # Temporal lets the abandoned child go on
        with pytest.raises(WorkflowFailureError) as failed:
            await child.result()
        assert "recall" in str(failed.value.cause.__cause__), failed.value.cause.__cause__
        assert [pay.refund_count(f"K-{n}") for n in (1, 2, 3)] == [1, 0, 0]


async def test_a_parents_terminate_cuts_its_childs_refund_and_probes_it(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Terminating the parent cuts the child's refund, whose reply never came: in doubt, then
    probed, and reported COMPLETED with the provider's evidence, in the parent's report."""
    pay = provider.pay
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        provider.hold = asyncio.Event()
        parent = await start_tree(client, queue, "wf-cut", "wf-cut-kid", "C")
        await pay.applied()
        report = await tether.temporal.terminate(parent, supervisor=boss, reason="cut it")
        (done,) = report.all_actions()
        assert done.state is tether.ActionState.COMPLETED
        assert done.idempotency_key == "temporal:wf-cut-kid:refund:1"
        assert done.evidence is not None
        assert done.evidence["provider_ref"] == pay.entries("C-1")[0].ref
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
        assert [pay.refund_count(f"C-{n}") for n in (1, 2, 3)] == [1, 0, 0]


async def test_a_stopped_workers_tree_goes_on_at_the_next_epoch_on_another_worker(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The worker hosting a parent and its child stops between the child's two refunds; the
    next worker on the queue opens the parent's next epoch and the child's under it, and the
    tree finishes with each refund made once."""
    pay = provider.pay
    async with supervisor(journal_url, provider) as first, \
            worker(client, first, provider) as queue:
        parent = await start_tree(client, queue, "wf-moved", "wf-moved-kid", "M")
        await until(lambda: pay.refund_count("M-1") == 1, "the child's first refund")
        for handle in (parent, client.get_workflow_handle("wf-moved-kid")):
            # Stopped once the refund's completion reached Temporal and between workflow
            # tasks (one a stopping worker held would first time out, in 10 s): the child
            # waits for its signal.
            await quiet(handle)
    async with supervisor(journal_url, provider) as second, \
            worker(client, second, provider, queue):
        await client.get_workflow_handle("wf-moved-kid").signal(TwoRefunds.proceed)
        refs = await parent.result()
        tops = await delegation_of(second, "wf-moved")
        kids = await delegation_of(second, "wf-moved-kid")
    assert [d.epoch for d in tops] == [0, 1] and [d.epoch for d in kids] == [0, 1]
    assert [k.parent_id for k in kids] == [t.id for t in tops]
    assert len(refs) == 3 and [pay.refund_count(f"M-{n}") for n in (1, 2, 3)] == [1, 1, 1]


async def test_a_child_recalled_by_its_own_id_stays_out(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A recall of the child's delegation alone (`tether recall ID` without --temporal): the
    child's next refund is refused, as for any recalled run; its parent goes on."""
    pay = provider.pay
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        parent = await start_tree(client, queue, "wf-own", "wf-own-kid", "Q")
        await until(lambda: pay.refund_count("Q-1") == 1, "the child's first refund")
        (kid,) = await delegation_of(boss, "wf-own-kid")
        report = await boss.handle_for(kid.id).recall(5.0, "stop the child only")
        assert report.outcome is tether.DelegationState.RECALLED
        child = client.get_workflow_handle("wf-own-kid")
        await child.signal(TwoRefunds.proceed)
        with pytest.raises(WorkflowFailureError) as failed:
            await child.result()
        assert "recalled or terminated" in str(failed.value.cause.__cause__)
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
        assert [d.control_seq for d in await delegation_of(boss, "wf-own-kid")] == [1]
        assert pay.refund_count("Q-2") == 0


async def test_a_child_workflow_recalled_by_its_handle_reports_its_refund(
        client: Client, provider: Provider, journal_url: str) -> None:
    """``tether.temporal.recall`` of a child workflow's own handle finds its delegation (a
    child's, not a root's) and recalls it, its refund finishing within the grace."""
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        provider.hold = asyncio.Event()
        parent = await start_tree(client, queue, "wf-by-handle", "wf-by-handle-kid", "H")
        await provider.pay.applied()
        (kid,) = await delegation_of(boss, "wf-by-handle-kid")
        recall = asyncio.create_task(tether.temporal.recall(
            client.get_workflow_handle("wf-by-handle-kid"), supervisor=boss, grace=5.0,
            reason="stop the child"))
        await until(lambda: getattr(host.runtime(kid.id), "stop", True) is not None,
                    "the child's fence reached its host")
        provider.hold.set()
        report = await recall
        assert (report.delegation_id, report.outcome) == (kid.id,
                                                          tether.DelegationState.RECALLED)
        assert [a.idempotency_key for a in report.completed] == [
            "temporal:wf-by-handle-kid:refund:1"]
        with contextlib.suppress(WorkflowFailureError):  # its child was cancelled
            await parent.result()


async def test_a_recall_of_the_parent_stops_a_child_that_runs_on_another_worker(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The parent runs on worker A's queue, its child on a queue only worker B serves: the
    child's run is a delegation of its own on B (a tree is one process's). A recall of the
    parent fences the parent, then stops that child too, within the same grace, and reports
    its refund with the parent's."""
    async with two_workers(client, journal_url, provider) as (_a, b, boss, first, second):
        drained = events_of(b)
        provider.holds["E-2"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentElsewhere.run, args=["E-1", "wf-far-kid", second, "E-2"],
            id="wf-far", task_queue=first)
        await until(lambda: provider.pay.refund_count("E-2") == 1, "the child's refund")
        (kid,) = await delegation_of(boss, "wf-far-kid")
        assert (kid.parent_id, kid.owner_id) == (None, b.owner_id)
        # The child's fence comes after the parent's.
        report = await recall_once_fenced(parent, boss, drained("drain", kid.id),
                                          provider.holds["E-2"], 10.0)
    assert report.outcome is tether.DelegationState.RECALLED
    assert [(r.delegation_id, r.outcome) for r in report.children] == [
        (kid.id, tether.DelegationState.RECALLED)]
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-far:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-far-kid:refund:1", tether.ActionState.COMPLETED)]
    assert [provider.pay.refund_count(o) for o in ("E-1", "E-2")] == [1, 1]


async def test_a_childs_call_that_outlives_the_grace_shows_in_the_parents_verdict(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The parent's own calls are done; its child apart on worker B has a refund that
    outlives the grace. The parent's report carries the worst verdict of the tree
    (GRACE_EXPIRED), not its own RECALLED_CLEAN, and the child's refund, probed."""
    async with two_workers(client, journal_url, provider) as (_a, _b, boss, first, second):
        provider.holds["V-2"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentElsewhere.run, args=["V-1", "wf-verdict-kid", second, "V-2"],
            id="wf-verdict", task_queue=first)
        await until(lambda: provider.pay.refund_count("V-2") == 1, "the child's refund")
        report = await tether.temporal.recall(parent, supervisor=boss, grace=0.5,
                                              reason="customer withdrew")
        provider.holds["V-2"].set()
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
    assert (report.verdict, [r.verdict for r in report.children]) == (
        "GRACE_EXPIRED", ["GRACE_EXPIRED"])
    assert "child workflows stopped apart: workflow wf-verdict-kid" in report.reason
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-verdict:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-verdict-kid:refund:1", tether.ActionState.COMPLETED)]


async def test_a_terminate_of_the_parent_cuts_a_grandchilds_call_on_another_worker(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The parent on worker A; its child (no activity of its own) and grandchild on worker
    B, one tree there. A terminate of the parent reaches the grandchild's refund and cuts
    it at B before Temporal hears of the terminate; the probe reports it COMPLETED."""
    async with two_workers(client, journal_url, provider) as (_a, _b, boss, first, second):
        provider.holds["F-2"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentElsewhere.run, args=["F-1", "wf-deep-kid", second, "F-2", "wf-deep-mid"],
            id="wf-deep", task_queue=first)
        await until(lambda: provider.pay.refund_count("F-2") == 1, "the grandchild's")
        report = await tether.temporal.terminate(parent, supervisor=boss, reason="cut")
        assert provider.cut == 1  # cut at B by the terminate, not left to run on
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-deep:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-deep-kid:refund:1", tether.ActionState.COMPLETED)]
    assert [provider.pay.refund_count(o) for o in ("F-1", "F-2")] == [1, 1]


async def test_a_recall_reaches_a_grandchild_apart_behind_a_child_in_the_tree(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The parent and its child on worker A, one tree; the grandchild on worker B, a
    delegation of its own. A recall of the parent looks through the
    child for children apart, stops the grandchild within the same grace, and its report
    carries the grandchild's refund."""
    async with two_workers(client, journal_url, provider) as (_a, b, boss, first, second):
        drained = events_of(b)
        provider.holds["J-2"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentElsewhere.run,
            args=["J-1", "wf-behind-kid", second, "J-2", "wf-behind-mid", True],
            id="wf-behind", task_queue=first)
        await until(lambda: provider.pay.refund_count("J-2") == 1, "the grandchild's")
        (kid,) = await delegation_of(boss, "wf-behind-kid")
        report = await recall_once_fenced(parent, boss, drained("drain", kid.id),
                                          provider.holds["J-2"], 10.0)
    assert (kid.parent_id, report.outcome) == (None, tether.DelegationState.RECALLED)
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-behind:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-behind-mid:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-behind-kid:refund:1", tether.ActionState.COMPLETED)]


async def test_a_child_apart_starts_nothing_once_its_parent_is_recalled(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The parent's own refund is in flight on worker A (its grace runs) while its child,
    apart on worker B, is asked for its second refund: refused at once, not after the
    parent's grace, though the parent's fence does not reach a delegation of its own."""
    gate = Gate()
    async with two_workers(client, journal_url, provider, gate) as (a, _b, boss, first,
                                                                    second):
        drained = events_of(a)
        provider.holds["W-own"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentBusy.run, args=["wf-busy-kid", second, "W-1", "W-2", "W-own"],
            id="wf-busy", task_queue=first)
        await until(lambda: provider.pay.refund_count("W-own") == 1, "the parent's refund")
        top = await hosted_apart(boss, a, "wf-busy", gate)
        await until(lambda: provider.pay.refund_count("W-1") == 1, "the child's first refund")
        recall = await recall_in_grace(parent, boss, drained("drain", top.id))
        child = client.get_workflow_handle("wf-busy-kid")
        await child.signal(TwoRefunds.proceed)
        with pytest.raises(WorkflowFailureError) as failed:
            await child.result()  # refused while the parent's grace still runs
        assert not recall.done()
        assert "recalled or terminated" in str(failed.value.cause.__cause__)
        provider.holds["W-own"].set()
        report = await recall
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
    assert report.outcome is tether.DelegationState.RECALLED
    assert [provider.pay.refund_count(o) for o in ("W-own", "W-1", "W-2")] == [1, 1, 0]
    # The child closed (refused) during the parent's grace, before the parent's report was
    # in: its refund is in the parent's report all the same.
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-busy:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-busy-kid:refund:1", tether.ActionState.COMPLETED)]


async def test_a_child_apart_that_closed_before_the_recall_is_in_the_report(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The child, apart on worker B, made both its refunds and closed while its parent's
    own refund is still held on A. A recall of the parent reports the child's refunds, as a
    local recall reports a child that ended before it."""
    gate = Gate()
    async with two_workers(client, journal_url, provider, gate) as (a, _b, boss, first,
                                                                    second):
        drained = events_of(a)
        provider.holds["K-own"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentBusy.run, args=["wf-done-kid", second, "K-1", "K-2", "K-own"],
            id="wf-done", task_queue=first)
        await until(lambda: provider.pay.refund_count("K-own") == 1, "the parent's refund")
        top = await hosted_apart(boss, a, "wf-done", gate)
        await until(lambda: provider.pay.refund_count("K-1") == 1, "the child's first refund")
        child = client.get_workflow_handle("wf-done-kid")
        await child.signal(TwoRefunds.proceed)
        assert len(await child.result()) == 2
        (kid,) = await delegation_of(boss, "wf-done-kid")
        report = await recall_once_fenced(parent, boss, drained("drain", top.id),
                                          provider.holds["K-own"], 30.0)
    assert [r.delegation_id for r in report.children] == [kid.id]
    assert [(a.idempotency_key, a.state) for a in report.all_actions()] == [
        ("temporal:wf-done:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-done-kid:refund:1", tether.ActionState.COMPLETED),
        ("temporal:wf-done-kid:refund:2", tether.ActionState.COMPLETED)]
    assert [provider.pay.refund_count(o) for o in ("K-own", "K-1", "K-2")] == [1, 1, 1]


async def test_a_parents_next_run_leaves_its_abandoned_child_alone(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Run 1 closes while its abandoned child runs on; run 2 of the same workflow id opens
    the task's next epoch without touching the child (which is no longer run 1's to keep):
    the child's refunds both go through."""
    pay = provider.pay
    async with supervisor(journal_url, provider) as host, \
            worker(client, host, provider) as queue:
        provider.holds["L-1"] = asyncio.Event()  # the child's first refund, held
        first = await client.start_workflow(Leaver.run, args=["P-1", "wf-left", "L-1", "L-2",
                                                              ""], id="wf-leaver",
                                            task_queue=queue)
        await until(lambda: pay.refund_count("L-1") == 1, "the child's first refund")
        await first.signal(Leaver.proceed)
        assert await first.result() == "done"
        second = await client.start_workflow(Leaver.run, args=["P-1", "", "", "", "P-2"],
                                             id="wf-leaver", task_queue=queue)
        await second.signal(Leaver.proceed)
        assert await second.result() == "done"
        provider.holds["L-1"].set()
        child = client.get_workflow_handle("wf-left")
        await child.signal(TwoRefunds.proceed)
        assert len(await child.result()) == 2
        tops = await delegation_of(host, "wf-leaver")
    assert [d.epoch for d in tops] == [0, 1] and provider.cut == 0
    assert [pay.refund_count(o) for o in ("P-1", "P-2", "L-1", "L-2")] == [1, 1, 1, 1]


async def test_a_child_apart_written_by_hand_never_has_a_recall_stop_another_workflow(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Someone with write access to the journal, and no key, notes an unrelated workflow as a
    child apart of the run about to be recalled. The recall asks Temporal whose child it is,
    and leaves it alone: its second refund goes through."""
    async with supervisor(journal_url, provider) as host, \
            worker(client, host, provider) as queue:
        run = await client.start_workflow(TwoRefunds.run, args=["H-1", "H-2"], id="wf-recalled",
                                          task_queue=queue)
        other = await client.start_workflow(TwoRefunds.run, args=["U-1", "U-2"],
                                            id="wf-unrelated", task_queue=queue)
        await until(lambda: provider.pay.refund_count("H-1") == 1
                    and provider.pay.refund_count("U-1") == 1, "both first refunds")
        (top,) = await delegation_of(host, "wf-recalled")
        described = await other.describe()
        await raw(host.journal, "INSERT INTO events (delegation_id, action_id, at, kind, detail) "
                  "VALUES (?, NULL, 0, ?, ?)", top.id, "temporal_child_apart",
                  json.dumps({"workflow_id": "wf-unrelated", "run_id": described.run_id}))
        report = await tether.temporal.recall(run, supervisor=host, grace=5.0, reason="withdrew")
        await other.signal(TwoRefunds.proceed)
        assert len(await other.result()) == 2
        with contextlib.suppress(WorkflowFailureError):
            await run.result()
    assert report.children == ()
    assert [provider.pay.refund_count(o) for o in ("H-1", "H-2", "U-1", "U-2")] == [1, 0, 1, 1]


async def test_tether_recall_from_a_shell_stops_the_runs_children_apart_too(
        client: Client, provider: Provider, journal_url: str, temporal_address: str) -> None:
    """`tether recall ID --temporal ADDRESS` of a parent run's delegation stops its child
    apart on worker B too, within the same grace and before Temporal is told, as
    ``tether.temporal.recall`` does; the child's refund is in the command's report."""
    async with two_workers(client, journal_url, provider) as (_a, b, boss, first, second):
        drained = events_of(b)
        provider.holds["C-2"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentElsewhere.run, args=["C-1", "wf-cli-kid", second, "C-2"],
            id="wf-cli", task_queue=first)
        await until(lambda: provider.pay.refund_count("C-2") == 1, "the child's refund")
        (top,) = await delegation_of(boss, "wf-cli")
        (kid,) = await delegation_of(boss, "wf-cli-kid")
        recall = asyncio.ensure_future(asyncio.to_thread(
            cli, "recall", top.id, "--grace", "10", "--reason", "customer withdrew",
            "--temporal", temporal_address, "--journal", journal_url, "--json"))
        await asyncio.wait_for(drained("drain", kid.id).wait(), 60)  # the child's fence
        assert (await parent.describe()).status is WorkflowExecutionStatus.RUNNING
        provider.holds["C-2"].set()
        code, out, err = await recall
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
    assert code == 0, err
    answer = json.loads(out)
    (child,) = answer["report"]["children"]
    assert (child["delegation"], child["outcome"]) == (kid.id, "RECALLED")
    assert [a["idempotency_key"] for a in child["actions"]] == ["temporal:wf-cli-kid:refund:1"]
    assert child["completed"] == [child["actions"][0]["id"]]
    assert answer["temporal"].endswith("cancelled.")
    assert [provider.pay.refund_count(o) for o in ("C-1", "C-2")] == [1, 1]


async def test_a_grandchild_in_the_tree_of_a_child_apart_starts_nothing_once_the_top_is_recalled(
        client: Client, provider: Provider, journal_url: str) -> None:
    """P on worker A, its own refund in flight (its grace runs); its child M apart on worker
    B. After P's recall was accepted, M starts its child G on B, in M's tree, which P's fence
    does not reach (M is stopped after P's grace): G's refund is refused at once all the
    same, since each call of a child workflow looks at its ancestors first."""
    gate = Gate()
    async with two_workers(client, journal_url, provider, gate) as (a, _b, boss, first,
                                                                    second):
        drained = events_of(a)
        provider.holds["G-own"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentBusyGrand.run, args=["wf-gm", "wf-gk", second, "G-mid", "G-kid", "G-own"],
            id="wf-gp", task_queue=first)
        await until(lambda: provider.pay.refund_count("G-own") == 1, "P's refund")
        top = await hosted_apart(boss, a, "wf-gp", gate)
        await until(lambda: provider.pay.refund_count("G-mid") == 1, "M's refund")
        recall = await recall_in_grace(parent, boss, drained("drain", top.id))
        middle = client.get_workflow_handle("wf-gm")
        await middle.signal(MiddleWaits.proceed)
        with pytest.raises(WorkflowFailureError) as failed:
            await middle.result()  # its child G failed, while P's grace runs
        assert not recall.done()
        causes: list[BaseException] = []
        cause: BaseException | None = failed.value
        while cause is not None:
            causes.append(cause)
            cause = cause.__cause__
        assert any("recalled or terminated" in str(c) for c in causes), causes
        provider.holds["G-own"].set()
        await recall
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
    assert [provider.pay.refund_count(o) for o in ("G-own", "G-mid", "G-kid")] == [1, 1, 0]
