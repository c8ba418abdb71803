"""Someone with write access to the journal and no trusted key, against tether on Temporal:
they may deny service (a run whose records fail verification is refused, a stop that cannot
verify says so), never have a recall stop another workflow, hide a child's call from a report
that then says all is clean, or have a recalled tree's child act again. Judged by the
provider's ledger and by Temporal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError

import tether
import tether.temporal
from tests.conftest import until
from tests.temporal_flows import ParentBusy, ParentElsewhere, ParentOfWaiter, TwoRefunds
from tests.temporal_world import Provider, both, cli, supervisor, worker
from tests.test_temporal_children import delegation_of, two_workers
from tests.test_trust import raw

# A delegation row's columns a forger copies from a genuine one.
_COLS = ("task_id, epoch, attempt, agent, surface, args, owner_id, state, fenced, "
         "control_seq, created_at, updated_at")


def fresh(name: str) -> str:
    """A workflow id of this test's own (the dev server outlives each test)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def delete_the_note(boss: tether.Supervisor, kid: Any) -> None:
    await raw(boss.journal, "DELETE FROM events WHERE kind = 'temporal_child_apart'")


async def forge_a_next_epoch(boss: tether.Supervisor, kid: Any) -> None:
    await raw(boss.journal,
              f"INSERT INTO delegations (id, parent_id, {_COLS}) SELECT ?, ?, task_id, "
              "epoch + 1, attempt, agent, surface, args, owner_id, state, fenced, "
              "control_seq, created_at + 1, updated_at FROM delegations WHERE id = ?",
              "d_forged1111111111111111111", kid.id, kid.id)


@pytest.mark.parametrize("edit", [delete_the_note, forge_a_next_epoch])
async def test_a_child_apart_hidden_by_hand_makes_the_report_say_so(
        client: Client, provider: Provider, journal_url: str,
        edit: Callable[[tether.Supervisor, Any], Awaitable[None]]) -> None:
    """While the child apart's refund is in flight, its note is deleted by hand, or a next
    epoch of its run is written under its own row (so that it would look like a child in a
    tree, which the stop skips). The parent's recall does not take the records' word: they
    fail verification, so the report is REJECTED and needs a person, naming them, never
    RECALLED_CLEAN with no child while the child's refund applied."""
    parent_id, kid_id = fresh("wf-hide"), fresh("wf-hide-kid")
    async with two_workers(client, journal_url, provider) as (_a, _b, boss, first, second):
        provider.holds["Z-2"] = asyncio.Event()
        parent = await client.start_workflow(
            ParentElsewhere.run, args=["Z-1", kid_id, second, "Z-2"], id=parent_id,
            task_queue=first)
        await until(lambda: provider.pay.refund_count("Z-2") == 1, "the child's refund")
        (kid,) = await delegation_of(boss, kid_id)
        await edit(boss, kid)
        try:
            report = await tether.temporal.recall(parent, supervisor=boss, grace=0.5,
                                                  reason="customer withdrew")
        finally:
            provider.holds["Z-2"].set()
        with contextlib.suppress(WorkflowFailureError):
            await parent.result()
    assert (report.verdict, report.outcome) == ("REJECTED",
                                                tether.DelegationState.NEEDS_ATTENTION)
    assert "fail verification" in report.reason, report.reason


async def test_a_recalled_trees_abandoned_child_apart_stays_out_after_two_hand_edits(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The parent's abandoned child runs apart on worker B. Its note is deleted before the
    parent's recall (so the recall cannot list it), and the parent's control sequence is set
    back to 0 afterwards (so that no stop shows). The child's next refund is refused all the
    same: its look at its ancestors reads only records that verify."""
    parent_id, kid_id = fresh("wf-ab"), fresh("wf-ab-kid")
    async with two_workers(client, journal_url, provider) as (_a, _b, boss, first, second):
        parent = await client.start_workflow(
            ParentBusy.run, args=[kid_id, second, "AB-1", "AB-2", "AB-own", True, True],
            id=parent_id, task_queue=first)
        await until(lambda: provider.pay.refund_count("AB-1") == 1
                    and provider.pay.refund_count("AB-own") == 1, "both first refunds")
        (top,) = await delegation_of(boss, parent_id)
        await raw(boss.journal, "DELETE FROM events WHERE kind = 'temporal_child_apart'")
        report = await tether.temporal.recall(parent, supervisor=boss, grace=2.0,
                                              reason="customer withdrew")
        await raw(boss.journal, "UPDATE delegations SET control_seq = 0 WHERE id = ?", top.id)
        child = client.get_workflow_handle(kid_id)
        await child.signal(TwoRefunds.proceed)
        with pytest.raises(WorkflowFailureError):
            await child.result()
    assert report.outcome is tether.DelegationState.NEEDS_ATTENTION
    assert [provider.pay.refund_count(o) for o in ("AB-own", "AB-1", "AB-2")] == [1, 1, 0]


async def test_a_hand_written_row_and_note_never_have_a_recall_stop_another_workflow(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A row for unrelated workflow W's run is written by hand under the recalled run's
    delegation, and W's real child V noted as a child apart on it (so Temporal's answer on
    V's parent matches the forged row). The recall signs nothing for V: the records it would
    act on fail verification, and its report says so."""
    run_id, w_id, v_id = fresh("wf-victim"), fresh("wf-w"), fresh("wf-v")
    async with both(journal_url, provider) as (host, _boss), \
            worker(client, host, provider) as queue:
        run = await client.start_workflow(TwoRefunds.run, args=["X-1", "X-2"], id=run_id,
                                          task_queue=queue)
        w = await client.start_workflow(ParentOfWaiter.run, args=[v_id, "V-1"], id=w_id,
                                        task_queue=queue)
        await until(lambda: provider.pay.refund_count("X-1") == 1, "the first refund")
        v = client.get_workflow_handle(v_id)
        for _ in range(600):  # V started (its parent's first step)
            with contextlib.suppress(Exception):
                if (await v.describe()).status is WorkflowExecutionStatus.RUNNING:
                    break
            await asyncio.sleep(0.01)
        (top,) = await delegation_of(host, run_id)
        forged = "d_forged0000000000000000000"
        await raw(host.journal, "INSERT INTO tasks (id, epoch) VALUES (?, 0)",
                  tether.temporal.task_of(w_id))
        await raw(host.journal,
                  f"INSERT INTO delegations (id, parent_id, {_COLS}) SELECT ?, ?, ?, epoch, "
                  "attempt, agent, surface, ?, owner_id, state, fenced, control_seq, "
                  "created_at, updated_at FROM delegations WHERE id = ?",
                  forged, top.id, tether.temporal.task_of(w_id),
                  json.dumps({"args": [w_id, (await w.describe()).run_id], "kwargs": {}}),
                  top.id)
        await raw(host.journal, "INSERT INTO events (delegation_id, action_id, at, kind, detail) "
                  "VALUES (?, NULL, 0, ?, ?)", forged, "temporal_child_apart",
                  json.dumps({"workflow_id": v_id, "run_id": (await v.describe()).run_id}))
        report = await tether.temporal.recall(run, supervisor=host, grace=2.0, reason="stop")
        stops = [d.control_seq for d in await delegation_of(host, v_id)]
        with contextlib.suppress(WorkflowFailureError):
            await run.result()
        await w.terminate()
    assert (report.verdict, report.outcome) == ("REJECTED",
                                                tether.DelegationState.NEEDS_ATTENTION)
    assert stops in ([], [0])  # nothing signed for V
    assert provider.pay.refund_count("X-2") == 0


async def test_a_row_edited_to_name_another_workflow_is_refused_by_tether_terminate(
        client: Client, provider: Provider, journal_url: str, temporal_address: str) -> None:
    """The rogue run's delegation row is edited by hand to name workflow U (task and run).
    `tether terminate ID --temporal` refuses, one error line, before anything is signed or
    any workflow is terminated: it would have terminated U."""
    rogue_id, u_id = fresh("wf-rogue"), fresh("wf-u")
    async with supervisor(journal_url, provider) as host, \
            worker(client, host, provider) as queue:
        rogue = await client.start_workflow(TwoRefunds.run, args=["R-1", "R-2"], id=rogue_id,
                                            task_queue=queue)
        other = await client.start_workflow(TwoRefunds.run, args=["U-1", "U-2"], id=u_id,
                                            task_queue=queue)
        await until(lambda: provider.pay.refund_count("R-1") == 1
                    and provider.pay.refund_count("U-1") == 1, "both first refunds")
        (top,) = await delegation_of(host, rogue_id)
        u_run = (await other.describe()).run_id
        await raw(host.journal, "UPDATE delegations SET args = ?, task_id = ? WHERE id = ?",
                  json.dumps({"args": [u_id, u_run], "kwargs": {}}),
                  tether.temporal.task_of(u_id), top.id)
        code, out, err = await asyncio.to_thread(
            cli, "terminate", top.id, "--reason", "rogue", "--temporal", temporal_address,
            "--journal", journal_url)
        statuses = [(await h.describe()).status for h in (rogue, other)]
        controls = await host.journal.controls(top.id)
        for handle in (rogue, other):
            await handle.terminate()
    assert (code, out) == (2, "") and "verification against its signed chain" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert statuses == [WorkflowExecutionStatus.RUNNING] * 2
    assert controls == []


async def test_a_row_edited_to_name_another_run_never_has_a_recall_sign_for_it(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Run Y's delegation row is edited by hand to name run X (task and run). A recall of X
    finds that row as X's newest: it refuses (Tampered) before signing anything, instead of
    landing its stop on Y; Y goes on."""
    x_id, y_id = fresh("wf-x"), fresh("wf-y")
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        x = await client.start_workflow(TwoRefunds.run, args=["X-1", "X-2"], id=x_id,
                                        task_queue=queue)
        await until(lambda: provider.pay.refund_count("X-1") == 1, "X's first refund")
        y = await client.start_workflow(TwoRefunds.run, args=["Y-1", "Y-2"], id=y_id,
                                        task_queue=queue)
        await until(lambda: provider.pay.refund_count("Y-1") == 1, "Y's first refund")
        (mine,) = await delegation_of(host, y_id)
        await raw(host.journal, "UPDATE delegations SET args = ?, task_id = ? WHERE id = ?",
                  json.dumps({"args": [x_id, (await x.describe()).run_id], "kwargs": {}}),
                  tether.temporal.task_of(x_id), mine.id)
        with pytest.raises(tether.errors.Tampered):
            await tether.temporal.recall(x, supervisor=boss, grace=1.0, reason="stop X")
        signed = await host.journal.controls(mine.id)
        await y.signal(TwoRefunds.proceed)
        assert len(await y.result()) == 2
        with contextlib.suppress(WorkflowFailureError):
            await x.result()  # cancelled in Temporal all the same
    assert signed == []
    assert [provider.pay.refund_count(o) for o in ("Y-1", "Y-2", "X-2")] == [1, 1, 0]


async def move_away(host: tether.Supervisor, workflow_id: str) -> None:
    """The run's delegation moved by hand to another task: the journal holds nothing of the
    run under its own."""
    (top,) = await delegation_of(host, workflow_id)
    task = tether.temporal.task_of(workflow_id)
    await raw(host.journal, "INSERT INTO tasks (id, epoch) VALUES (?, 0)", task + "-x")
    await raw(host.journal, "UPDATE delegations SET task_id = ? WHERE id = ?",
              task + "-x", top.id)
    await raw(host.journal, "DELETE FROM tasks WHERE id = ?", task)


async def test_a_run_whose_delegation_was_moved_to_another_task_is_not_reported_idle(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The run refunded; its delegation is then moved by hand to another task, so that the
    journal holds nothing of the run. The recall fences the run all the same (it opens the
    run's first epoch itself), and its report does not say the run did nothing: Temporal
    shows an activity of it the journal has no record of, so a person decides."""
    run_id = fresh("wf-hidden")
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        run = await client.start_workflow(TwoRefunds.run, args=["H-1", "H-2"], id=run_id,
                                          task_queue=queue)
        await until(lambda: provider.pay.refund_count("H-1") == 1, "the first refund")
        await move_away(host, run_id)
        report = await tether.temporal.recall(run, supervisor=boss, grace=1.0,
                                              reason="customer withdrew")
        with contextlib.suppress(WorkflowFailureError):
            await run.result()
    assert (report.verdict, report.outcome) == ("REJECTED",
                                                tether.DelegationState.NEEDS_ATTENTION)
    assert "1 activity(ies)" in report.reason and "no record of" in report.reason
    assert [provider.pay.refund_count(o) for o in ("H-1", "H-2")] == [1, 0]


async def test_a_moved_run_whose_refund_is_still_in_flight_is_not_reported_idle(
        client: Client, provider: Provider, journal_url: str) -> None:
    """As above, but the refund has applied and its reply is still on its way when the row
    is moved: Temporal's history holds no end of that activity yet (it writes one only when
    the activity closes), and the report still does not say the run did nothing."""
    run_id = fresh("wf-hidden")
    async with both(journal_url, provider) as (host, boss), \
            worker(client, host, provider) as queue:
        provider.hold = asyncio.Event()
        run = await client.start_workflow(TwoRefunds.run, args=["HF-1", "HF-2"], id=run_id,
                                          task_queue=queue)
        await provider.pay.applied()
        await move_away(host, run_id)
        try:
            report = await tether.temporal.recall(run, supervisor=boss, grace=1.0,
                                                  reason="customer withdrew")
        finally:
            provider.hold.set()
        with contextlib.suppress(WorkflowFailureError):
            await run.result()
    assert (report.verdict, report.outcome) == ("REJECTED",
                                                tether.DelegationState.NEEDS_ATTENTION)
    assert provider.pay.refund_count("HF-1") == 1
