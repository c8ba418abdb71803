"""Several workers on one task queue: a run's delegation is hosted by one of them, and an
activity of the run that another worker picks up runs there as a guest in that delegation
(journaled, keyed and fenced as any), instead of being turned away. The host's recall waits
for a guest's call within its grace, and a terminate cuts it where it runs. Judged by the
provider's ledger."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

import tether
import tether.temporal
from tests.conftest import until
from tests.temporal_flows import Leaver, RefundAnyway, TwoRefunds
from tests.temporal_world import Provider, actions, both, start_refund, supervisor, worker
from tether._core import drain
from tether._core.documents import Acknowledgement, decode


@contextlib.asynccontextmanager
async def guest_call(client: Client, provider: Provider, url: str, workflow_id: str,
                     order: str) -> AsyncIterator[tuple[tether.Supervisor, tether.Supervisor,
                                                        WorkflowHandle[Any, Any]]]:
    """Worker A (one activity at a time) hosts a run: its first refund ran there. A's one slot
    is then taken by another workflow's held refund, so the run's second refund, held, is
    picked up by worker B on the same queue, while A is live. Yields A's supervisor, the
    orchestrator's, and the run."""
    first = asyncio.Event()
    provider.holds[f"{order}-busy"] = first
    async with supervisor(url, provider) as a, supervisor(url, provider) as b, \
            supervisor(url, provider) as boss, \
            worker(client, a, provider, activities=1) as queue:
        handle = await client.start_workflow(TwoRefunds.run, args=[f"{order}-1", f"{order}-2"],
                                             id=workflow_id, task_queue=queue)
        await until(lambda: provider.pay.refund_count(f"{order}-1") == 1, "the first refund")
        (hosting,) = {c.delegation_id for c in await actions(boss, workflow_id)}
        assert (await boss.journal.get(hosting)).owner_id == a.owner_id
        busy = await start_refund(client, queue, f"{workflow_id}-busy", order=f"{order}-busy")
        await until(lambda: provider.pay.refund_count(f"{order}-busy") == 1, "A's slot taken")
        provider.holds[f"{order}-2"] = asyncio.Event()
        # Its own client, as another process has (the SDK allows one worker per queue and
        # client).
        other = await Client.connect(client.service_client.config.target_host)
        async with worker(other, b, provider, queue):
            await handle.signal(TwoRefunds.proceed)
            await until(lambda: provider.pay.refund_count(f"{order}-2") == 1,
                        "the second refund, on B")
            calls = await actions(boss, workflow_id)
            assert {c.delegation_id for c in calls} == {hosting}  # a guest: A's delegation
            try:
                yield a, boss, handle
            finally:
                for held in provider.holds.values():
                    held.set()
                with contextlib.suppress(WorkflowFailureError):
                    await busy.result()


async def test_an_activity_another_worker_picks_up_runs_there_as_a_guest_of_the_host(
        client: Client, provider: Provider, journal_url: str) -> None:
    """B runs the host's run's refund in the host's delegation, and the run finishes."""
    async with guest_call(client, provider, journal_url, "wf-guest", "G") as (_a, boss, run):
        provider.holds["G-2"].set()
        assert len(await run.result()) == 2
        assert [(c.idempotency_key, c.state) for c in await actions(boss, "wf-guest")] == [
            ("temporal:wf-guest:refund:1", tether.ActionState.COMPLETED),
            ("temporal:wf-guest:refund:2", tether.ActionState.COMPLETED)]
    assert [provider.pay.refund_count(f"G-{n}") for n in (1, 2)] == [1, 1]


async def test_the_hosts_recall_waits_within_its_grace_for_a_guests_call(
        client: Client, provider: Provider, journal_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host has nothing in flight of the run, B has its refund: the recall's grace waits
    for B's receipt (it does not end at its first look for want of a call of its own), and
    reports it COMPLETED, the run RECALLED."""
    looked = asyncio.Event()  # the drain judged its grace window once, B's call in flight
    judge = drain.grace_step

    def observed(*args: Any, **kwargs: Any) -> drain.GraceStep:
        step = judge(*args, **kwargs)
        looked.set()
        return step

    monkeypatch.setattr(drain, "grace_step", observed)
    async with guest_call(client, provider, journal_url, "wf-guest-recall", "R") as (
            _a, boss, run):
        recall = asyncio.create_task(tether.temporal.recall(
            run, supervisor=boss, grace=10.0, reason="customer withdrew"))
        await looked.wait()
        provider.holds["R-2"].set()  # B's call finishes within the grace window
        report = await recall
        assert (report.outcome, report.verdict) == (
            tether.DelegationState.RECALLED, "RECALLED_CLEAN"), report
        assert [(a.idempotency_key, a.late) for a in report.completed] == [
            ("temporal:wf-guest-recall:refund:1", False),
            ("temporal:wf-guest-recall:refund:2", False)]
        # The host's signed acknowledgement lists B's call, in flight when it was signed.
        (ack,) = [decode(d.signed.body) for d in await boss.journal.documents(
            report.delegation_id) if d.type == "ack"]
        assert isinstance(ack, Acknowledgement)
        assert ack.in_flight == (report.completed[1].id,)
    assert [provider.pay.refund_count(f"R-{n}") for n in (1, 2)] == [1, 1]


async def test_the_hosts_terminate_cuts_a_guests_call_where_it_runs(
        client: Client, provider: Provider, journal_url: str) -> None:
    """A terminate cuts B's call at B (its reply never comes), and the host's probe reports it
    COMPLETED with the provider's evidence: the money moved."""
    async with guest_call(client, provider, journal_url, "wf-guest-cut", "T") as (
            _a, boss, run):
        report = await tether.temporal.terminate(run, supervisor=boss, reason="cut it")
        await until(lambda: provider.cut == 1, "B's call cut")
        (_, done) = report.completed
        assert done.idempotency_key == "temporal:wf-guest-cut:refund:2"
        assert done.evidence is not None
        assert done.evidence["provider_ref"] == provider.pay.entries("T-2")[0].ref
    assert [provider.pay.refund_count(f"T-{n}") for n in (1, 2)] == [1, 1]


async def test_a_guests_call_outlives_its_hosts_death_and_the_run_goes_on(
        client: Client, provider: Provider, journal_url: str) -> None:
    """The host dies while B's call runs as its guest; the next process on the journal
    settles the host's delegation (a recovery's terminate, which stopped nobody's work): B's
    call is not cut, its receipt is kept, and the run finishes at its next epoch."""
    async with guest_call(client, provider, journal_url, "wf-guest-dies", "D") as (
            a, boss, run):
        (_, second) = await actions(boss, "wf-guest-dies")
        a.abandon()  # the host is presumed dead, and writes nothing more
        await boss.recover_delegation(await boss.journal.get(second.delegation_id),
                                      "owner is gone")
        provider.holds["D-2"].set()
        assert len(await run.result()) == 2
        assert provider.cut == 0
        (_, kept) = await actions(boss, "wf-guest-dies")
        assert (kept.id, kept.state) == (second.id, tether.ActionState.COMPLETED)
    assert [provider.pay.refund_count(f"D-{n}") for n in (1, 2)] == [1, 1]


async def test_a_row_written_by_hand_never_makes_a_recalled_run_act_as_a_guest(
        client: Client, provider: Provider, sqlite_url: str) -> None:
    """Someone with write access to the journal but no key inserts an unfenced next epoch
    of a recalled run, owned by a live process, for a worker to act in as its guest: the
    worker refuses."""
    queue = f"q-{uuid.uuid4().hex[:12]}"
    async with supervisor(sqlite_url, provider) as a, supervisor(sqlite_url, provider) as b, \
            supervisor(sqlite_url, provider) as boss:
        run = await client.start_workflow(RefundAnyway.run, args=["X-1"], id="wf-forged",
                                          task_queue=queue)
        report = await tether.temporal.recall(run, supervisor=boss, grace=5.0,
                                              reason="stop it")
        assert report.outcome is tether.DelegationState.RECALLED
        await boss.journal.flush()
        db = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
        columns = [r[1] for r in db.execute("PRAGMA table_info(delegations)")]
        row = dict(zip(columns, db.execute(
            "SELECT * FROM delegations WHERE task_id = 'temporal:wf-forged'").fetchone(),
            strict=True))
        row.update(id="d_forged", epoch=1, owner_id=a.owner_id, state="RUNNING", fenced=0,
                   control_seq=0, ended_at=None, result=None, error=None, failure=None)
        db.execute(f"INSERT INTO delegations ({', '.join(row)}) VALUES "
                   f"({', '.join('?' * len(row))})", tuple(row.values()))
        db.execute("UPDATE tasks SET epoch = 1 WHERE id = 'temporal:wf-forged'")
        db.commit()
        db.close()
        async with worker(client, b, provider, queue):
            with pytest.raises(WorkflowFailureError) as failed:
                await run.result()
        why = str(failed.value.cause.__cause__)
        # Refused: the run's records are read only once they verify, and the forged row
        # does not (were it sealed, the recall of the run's first epoch would refuse it).
        assert "d_forged: chain" in why and "fail verification" in why, why
        assert provider.keys == [] and provider.pay.refund_count("X-1") == 0


async def test_a_new_run_of_the_workflow_id_gets_a_delegation_of_its_own(
        client: Client, provider: Provider, journal_url: str) -> None:
    """Run 1 closed (its abandoned child runs on); run 2 of the id, on another worker, opens
    the task's next epoch rather than acting in run 1's delegation, and is recalled there."""
    pay = provider.pay
    ids = uuid.uuid4().hex[:8]
    parent_id, kid_id = f"wf-again-{ids}", f"wf-again-kid-{ids}"
    async with both(journal_url, provider) as (a, boss), \
            supervisor(journal_url, provider) as b, worker(client, a, provider) as first:
        run1 = await client.start_workflow(
            Leaver.run, args=["N-1", kid_id, "N-k1", "N-k2", ""], id=parent_id,
            task_queue=first)
        await until(lambda: pay.refund_count("N-k1") == 1, "the child's first refund")
        await run1.signal(Leaver.proceed)
        assert await run1.result() == "done"
        other = await Client.connect(client.service_client.config.target_host)
        async with worker(other, b, provider) as second:
            run2 = await client.start_workflow(
                Leaver.run, args=["N-1", "", "", "", "N-2"], id=parent_id, task_queue=second)
            report = await tether.temporal.recall(run2, supervisor=boss, grace=5.0,
                                                  reason="stop run 2")
            with contextlib.suppress(WorkflowFailureError):  # cancelled, or refused
                await run2.result()
            tops = await both_epochs(boss, parent_id)
        assert report.outcome is tether.DelegationState.RECALLED
        assert report.delegation_id == tops[-1].id and tops[-1].epoch >= 1
        assert tops[-1].args["args"][1] == run2.result_run_id
        assert tops[0].args["args"][1] == run1.result_run_id
        assert pay.refund_count("N-2") == 0
        kid = client.get_workflow_handle(kid_id)
        await kid.signal(TwoRefunds.proceed)
        assert len(await kid.result()) == 2


async def both_epochs(sup: tether.Supervisor, workflow_id: str) -> list[Any]:
    await sup.journal.flush()
    return sorted((d for d in await sup.journal.delegations()
                   if d.task_id == tether.temporal.task_of(workflow_id)), key=lambda d: d.epoch)
