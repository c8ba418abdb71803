"""Temporal runs opened, reopened and stopped while other processes move the same task: a
stop accepted while a worker reopens the run, a worker handing the run over while a stop
looks for it, a child run opened under its parent and apart at once. Each test puts the
rival's commit between two steps of the other (see tests/test_read_races.py) and fails on
the code before its fix; nothing here needs a Temporal server."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import tether
from tests.conftest import ONE_CLOCK
from tether._core.model import ControlKind
from tether._integrations import temporal_runs
from tether._integrations.temporal_runs import RunRefused, open_run
from tether._integrations.temporal_task import task_of
from tether._journal.rows import NewDelegation
from tether._runtime.arguments import child_payload
from tether._runtime.state import new_id


async def held(ctx: tether.Context, workflow_id: str, run_id: str) -> None:
    await asyncio.Event().wait()


AGENT = tether.Agent("temporal:Refund", held)


async def _dead_hosts_run(sup: tether.Supervisor, wf: str, run: str) -> str:
    """Epoch 0 of the run, live, hosted by a worker that has died (no owner row)."""
    row = await sup.journal.create_delegation(NewDelegation(
        id=new_id("d"), task_id=task_of(wf), parent_id=None, attempt=1, agent=AGENT.name,
        surface=(), args=child_payload((wf, run), {}, AGENT.name), owner_id="o-dead-worker",
        now=sup.clock.wall()))
    await sup.journal.flush()
    return row.id


async def test_a_recall_accepted_while_a_worker_reopens_the_run_keeps_it_stopped(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker (W2) picks up a run whose host died: ``_next_epoch_of`` reads that nobody
    stopped the run (``stopped_run``), judges the host gone, recovers its delegation and
    opens the next epoch. An operator's recall of the run accepted after the stop check but
    before the new epoch commits must keep the run stopped: W2 must not open an unfenced
    epoch 1 (its activities - payments - would run after the recall)."""
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as w2, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as op:
        head = await _dead_hosts_run(w2, "wf-1", "run-1")
        real = temporal_runs.owner_alive  # type: ignore[attr-defined]
        recall: list[asyncio.Task[Any]] = []

        async def alive(sup: Any, owner_id: str) -> bool:
            answer = await real(sup, owner_id)
            if not recall:  # the operator's recall commits right after W2's stop check
                recall.append(asyncio.create_task(
                    op.handle_for(head).recall(grace=0.2, reason="operator: stop it")))
                for _ in range(500):
                    if (await op.journal.get(head)).control_seq >= 1:
                        break
                    await asyncio.sleep(0.01)
                assert (await op.journal.get(head)).control_seq >= 1
            return answer

        monkeypatch.setattr(temporal_runs, "owner_alive", alive)
        opened = None
        with contextlib.suppress(RunRefused):
            opened = await open_run(w2, "wf-1", "run-1", AGENT)
        if recall:
            await asyncio.gather(*recall, return_exceptions=True)
        rows = [r for r in await w2.journal.delegations() if r.task_id == task_of("wf-1")]
        summary = [(r.epoch, r.state.value, r.fenced, r.control_seq) for r in rows]
        assert opened is None, f"a recalled run reopened unfenced at a new epoch: {summary}"


async def test_a_temporal_recall_fences_the_epoch_a_worker_handover_opened_meanwhile(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``temporal_control.stop`` reads the run's head (epoch 0, live on worker W1) and then
    recalls it. If W1 stops (its delegation ends without a fence, as ``Host.close`` does)
    and worker W2 opens epoch 1 for the same run in between, the recall lands on an ended
    epoch ("already finished": its report unchanged) and epoch 1 is never fenced: the run's
    next activities (payments) pass tether's gate after the stop said it was done."""
    import temporalio.client

    from tether._integrations import temporal_control

    go = asyncio.Event()

    async def until_told(ctx: tether.Context, workflow_id: str, run_id: str) -> str:
        await go.wait()
        return "worker stopped"

    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as w1, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as w2, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as op:
        first = await open_run(w1, "wf-2", "run-1", tether.Agent("temporal:Refund",
                                                                 until_told))
        handover: list[Any] = []
        real = temporal_control.genuine  # type: ignore[attr-defined]

        async def genuine(journal: Any, pins: Any, delegation_id: str, doing: str) -> None:
            await real(journal, pins, delegation_id, doing)
            if not handover:  # W1 stops and W2 picks the run up, after the stop's read
                go.set()
                await first.wait()
                await w1.journal.flush()
                handover.append(await open_run(w2, "wf-2", "run-1", AGENT))
                await w2.journal.flush()

        async def same(sup: Any, handle: Any, row: Any, report: Any, until: float) -> Any:
            return report  # (Temporal's view of the run: no server in this test)

        async def nothing(*a: Any, **k: Any) -> None:
            return None

        async def no_children(sup: Any, handle: Any, row: Any, report: Any, *a: Any) -> Any:
            return report

        monkeypatch.setattr(temporal_control, "genuine", genuine)
        monkeypatch.setattr(temporal_control, "_unjournaled", same)
        monkeypatch.setattr(temporal_control, "tell_temporal", nothing)
        monkeypatch.setattr(temporal_control, "stop_apart", no_children)
        handle = temporalio.client.WorkflowHandle(None, "wf-2", run_id="run-1")  # type: ignore
        report = await temporal_control.stop(handle, op, ControlKind.RECALL, 0.2,
                                             "operator: stop it")
        rows = [r for r in await op.journal.delegations() if r.task_id == task_of("wf-2")]
        summary = [(r.epoch, r.state.value, r.fenced, r.control_seq) for r in rows]
        assert handover, "the rival never ran"
        live = [r for r in rows if not r.fenced and not r.state.terminal]
        assert not live, (f"the stop reported {report.outcome.value}/{report.verdict} for "
                          f"epoch {report.epoch} while the run goes on unfenced: {summary}")


async def test_a_child_run_and_a_run_apart_never_share_an_epoch(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child workflow's run opened under its parent here (``open_child``: the task's epoch
    set to the one read + 1, no compare-and-set) and the same run opened apart by another
    worker (``open_run``: a compare-and-set from epoch 0). The second committing between the
    first's read of the task's epoch and its write leaves two live delegations at epoch 1."""
    from tests.test_read_races import after_statement
    from tether._integrations.temporal_runs import open_child
    from tether._journal import ops

    loop = asyncio.get_running_loop()
    async with tether.Supervisor(pg_url, policy=ONE_CLOCK, recover=False) as b, \
            tether.Supervisor(pg_url, policy=ONE_CLOCK, recover=False) as c:
        parent = await open_run(b, "parent", "rp", AGENT)
        await _dead_hosts_run(b, "child", "rc")  # its epoch 0, its worker dead
        rival: list[Any] = []
        real = ops.create_delegation

        def create(db: Any, new: NewDelegation) -> Any:
            if new.parent_id is None or new.task_id != task_of("child") or rival:
                return real(db, new)

            def apart(_: Any) -> None:
                rival.append(asyncio.run_coroutine_threadsafe(
                    open_run(c, "child", "rc", AGENT), loop).result(timeout=30))

            return real(after_statement(db, "SELECT epoch FROM tasks WHERE id = ?", apart),
                        new)

        monkeypatch.setattr(ops, "create_delegation", create)
        refusal: RunRefused | None = None
        try:
            await open_child(b, parent.id, "child", "rc", AGENT)
        except RunRefused as refused:  # the run opened apart first
            refusal = refused
        # Temporal tries a refused one again, and the retry judges epoch 1.
        assert refusal is None or refusal.retry
        # Or it opened the next epoch: when the write shared its batch with another (a
        # heartbeat, an event), the failed batch ran again, each operation alone
        # (``runner.Careful``), and the creation then read epoch 1, as if it had come after
        # the run apart. Either way, never a second live delegation at epoch 1.
        rows = [r for r in await b.journal.delegations() if r.task_id == task_of("child")]
        summary = [(r.epoch, r.state.value, r.fenced, r.parent_id is not None) for r in rows]
        assert rival
        live = [r.epoch for r in rows if not r.state.terminal]
        assert len(live) == len(set(live)), f"two live delegations at one epoch: {summary}"


async def test_a_temporal_stop_whose_epoch_ended_under_it_fences_the_runs_next_epoch(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the test above, but W2 opens epoch 1 just after the stop reads the run's head again:
    the recall of the ended epoch 0 was refused (already finished, no intent), so the stop
    must look for the run again and fence the epoch it finds (or opens), or nothing keeps W2
    out and the run goes on unfenced."""
    import temporalio.client

    from tether._core.model import ControlKind
    from tether._integrations import temporal_control
    from tether._integrations.temporal_runs import open_run
    from tether._integrations.temporal_task import task_of
    from tether._journal import queue

    go = asyncio.Event()

    async def until_told(ctx: tether.Context, workflow_id: str, run_id: str) -> str:
        await go.wait()
        return "worker stopped"

    async def held(ctx: tether.Context, workflow_id: str, run_id: str) -> None:
        await asyncio.Event().wait()

    async with tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as w1, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as w2, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK, recover=False) as op:
        first = await open_run(w1, "wf-2", "run-1", tether.Agent("temporal:Refund", until_told))
        armed: list[bool] = []
        handover: list[Any] = []
        real_genuine = temporal_control.genuine  # type: ignore[attr-defined]
        real_peek = op.journal.peek

        async def genuine(journal: Any, pins: Any, delegation_id: str, doing: str) -> None:
            await real_genuine(journal, pins, delegation_id, doing)
            if not armed:  # W1 stops after the stop's look
                armed.append(True)
                go.set()
                await first.wait()
                await w1.journal.flush()

        async def peek(fn: Any, *args: Any) -> Any:
            out = await real_peek(fn, *args)
            if armed and fn is queue.task_head and not handover:  # the chase's read
                handover.append(await open_run(w2, "wf-2", "run-1",
                                               tether.Agent("temporal:Refund", held)))
                await w2.journal.flush()
            return out

        async def same(sup: Any, handle: Any, row: Any, report: Any, until: float) -> Any:
            return report

        async def nothing(*a: Any, **k: Any) -> None:
            return None

        async def no_children(sup: Any, handle: Any, row: Any, report: Any, *a: Any) -> Any:
            return report

        monkeypatch.setattr(temporal_control, "genuine", genuine)
        monkeypatch.setattr(op.journal, "peek", peek)
        monkeypatch.setattr(temporal_control, "_unjournaled", same)
        monkeypatch.setattr(temporal_control, "tell_temporal", nothing)
        monkeypatch.setattr(temporal_control, "stop_apart", no_children)
        handle = temporalio.client.WorkflowHandle(None, "wf-2", run_id="run-1")  # type: ignore

        class Described:  # Temporal's view of the run (no server in this test): it runs
            status = temporalio.client.WorkflowExecutionStatus.RUNNING
            workflow_type = "Refund"

        async def describe() -> Any:
            return Described()

        monkeypatch.setattr(handle, "describe", describe)
        report = await temporal_control.stop(handle, op, ControlKind.RECALL, 0.2, "stop it")
        rows = [r for r in await op.journal.delegations() if r.task_id == task_of("wf-2")]
        summary = [(r.epoch, r.state.value, r.fenced, r.control_seq) for r in rows]
        assert handover
        live = [r for r in rows if not r.fenced and not r.state.terminal]
        assert not live, (f"stop reported {report.outcome.value} for epoch {report.epoch}; "
                          f"run goes on unfenced: {summary}")
