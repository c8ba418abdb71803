"""Recall and terminate of a Temporal workflow run, from the orchestrator's process.

The run's delegation is found by its task (``temporal:<workflow id>``) and stopped as any
delegation is (``Handle.recall``/``terminate``: signed intent, fence, grace, probes, report),
wherever its worker hosts it; only then is the workflow cancelled (recall) or terminated in
Temporal, so that its in-flight activities got their grace and no new one can start.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import temporalio.client
from temporalio.service import RPCError, RPCStatusCode

from tether._core.errors import Tampered, TetherError, UserError
from tether._core.model import ControlKind, DelegationState
from tether._core.report import Report
from tether._core.verdict import Verdict
from tether._integrations.temporal_history import settled_view
from tether._integrations.temporal_runs import (
    RunRefused,
    open_run,
    run_rows,
    run_stopped,
    stopped,
)
from tether._integrations.temporal_task import (
    CHILD_APART,
    activity_of,
    genuine,
    run_of,
    task_of,
    workflow_of,
)
from tether._journal import queue
from tether._journal.rows import DelegationRow
from tether._runtime.gateway import Context
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent


class ChildUnknown(TetherError):
    """A child workflow noted in the journal that Temporal does not know as such."""


_ATTEMPTS = 5  # a worker opening the run's delegation while this process does
_DEPTH = 32  # generations of children apart a stop goes down through


async def recall(handle: temporalio.client.WorkflowHandle[Any, Any], *, supervisor: Supervisor,
                 grace: float, reason: str = "") -> Report:
    """Stop the run's new work at once; let its in-flight activities finish within ``grace``
    seconds; then cancel the workflow, and account for every activity it started."""
    return await stop(handle, supervisor, ControlKind.RECALL, grace, reason)


async def terminate(handle: temporalio.client.WorkflowHandle[Any, Any], *,
                    supervisor: Supervisor, reason: str = "") -> Report:
    """Cut the run's in-flight activities now (each in doubt, then probed), terminate the
    workflow, and account for every activity it started."""
    return await stop(handle, supervisor, ControlKind.TERMINATE, None, reason)


async def stop(handle: temporalio.client.WorkflowHandle[Any, Any], sup: Supervisor,
               kind: ControlKind, grace: float | None, reason: str, *,
               told: bool = True, depth: int = 0) -> Report:
    """``told``: cancel (recall) or terminate the run in Temporal once its report is in (a
    child workflow stopped with its parent is left to Temporal's own policy for it)."""
    if not isinstance(handle, temporalio.client.WorkflowHandle):
        raise UserError(f"expected a Temporal WorkflowHandle, not {type(handle).__name__}")
    if not isinstance(sup, Supervisor) or not sup.is_open:
        raise UserError("supervisor must be an open tether.Supervisor on the workers' journal")
    if not isinstance(reason, str):
        raise UserError("reason must be a string")
    try:
        row, unknown = await _delegation_of(sup, handle, reopen=told)
        await genuine(sup.journal, sup.keys.trusted, row.id, f"stop workflow {handle.id}")
    except Tampered:  # a person decides on the records; the run is stopped in Temporal still
        if told:
            await tell_temporal(handle, kind, reason)
        raise
    until = asyncio.get_running_loop().time() + (grace or 0.0)
    for _ in range(_ATTEMPTS):
        mine = sup.handle_for(row.id)
        if kind is ControlKind.RECALL:
            assert grace is not None
            report = await mine.recall(grace, reason)
        else:
            report = await mine.terminate(reason)
        # The run may have moved on between the look and the stop: its worker ended this
        # epoch (its delegation then refuses the stop, "already finished") and another may
        # open, or have opened, the next. Then the run is looked for again, as at first (an
        # epoch that ended without anyone's intent has the next opened here, to be fenced),
        # and stopped where it is now; once a stop stands on the run's epoch, a worker's
        # reopen is refused (``temporal_runs.open_run``).
        if await stopped(sup, row.id):
            head = await sup.journal.peek(queue.task_head, task_of(handle.id))
            if head is None or head.id == row.id or run_of(head) != run_of(row) or \
                    head.fenced or head.state.terminal:
                break
            after = head
        elif not told:
            break
        else:
            try:
                after, _ = await _delegation_of(sup, handle, reopen=told)
            except (Tampered, UserError, RunRefused):
                await tell_temporal(handle, kind, reason)  # Temporal stops the run anyway
                raise
            if after.id == row.id:  # the run closed in Temporal: its last epoch says so
                break
        try:
            await genuine(sup.journal, sup.keys.trusted, after.id, f"stop workflow {handle.id}")
        except Tampered:  # as for the first: a person decides; Temporal stops the run
            if told:
                await tell_temporal(handle, kind, reason)
            raise
        row = after
    else:  # the run moved on under every stop: no epoch of it is known to be fenced
        if told:
            await tell_temporal(handle, kind, reason)
        raise UserError(f"workflow {handle.id}: its run kept moving to new epochs while this "
                        "stop was made; try again")
    report = await _with_earlier(sup, row, report)
    try:
        if unknown or not report.all_actions():
            # The journal holds no call of the run (nothing of it at all, or a stop of it
            # opened its delegation, maybe at an earlier try of this one): Temporal says
            # whether it did nothing.
            report = await _unjournaled(sup, handle, row, report, until)
        return await stop_apart(sup, handle, row, report, kind, grace, reason, depth)
    finally:
        if told:
            await tell_temporal(handle, kind, reason)


async def stop_apart(sup: Supervisor, handle: temporalio.client.WorkflowHandle[Any, Any],
                     row: DelegationRow, report: Report, kind: ControlKind,
                     grace: float | None, reason: str, depth: int = 0) -> Report:
    """The run's ``report`` with its child workflows apart (delegations of their own, on
    workers that did not host their parent's tree), at any depth, stopped too: called once
    the run's fence stands, before Temporal is told (its cancel or terminate reaches the
    children too, and a child's calls Temporal cancelled run on, shielded, where tether's
    terminate cuts them)."""
    apart: list[temporalio.client.WorkflowHandle[Any, Any]] = []
    outcomes: list[Report | BaseException] = []
    try:
        if depth < _DEPTH:
            apart = await _children_apart(sup, handle, run_of(row) or "")
        outcomes = list(await asyncio.gather(
            *(stop(h, sup, kind, grace, reason, told=False, depth=depth + 1) for h in apart),
            return_exceptions=True))
    except (TetherError, RPCError) as exc:  # the children could not be listed
        outcomes = [exc]
    return _with_children(report, [h.id for h in apart], outcomes)


# How far a verdict is from "nothing happened": a report with children stopped apart carries
# the worst of theirs and its own.
_RANK = {v: n for n, v in enumerate((
    Verdict.NEVER_STARTED, Verdict.NO_SIDE_EFFECTS, Verdict.RECALLED_CLEAN, Verdict.RECONCILE,
    Verdict.RECOVERED, Verdict.GRACE_EXPIRED, Verdict.ESCALATE_NO_ACK, Verdict.TERMINATE,
    Verdict.REJECTED))}


def _rank(verdict: str) -> int:
    try:
        return _RANK[Verdict(verdict)]
    except (ValueError, KeyError):  # one this process does not know: the worst
        return len(_RANK)


async def _recorded(sup: Supervisor, row: DelegationRow) -> set[str]:
    """The activity ids the journal holds a call of, in the run's delegations: an action, or
    a replay (a new start of the workflow id answered from an earlier run's record, which
    leaves only an event). Read from the key, ``temporal:<id>:<tool>:<activity id>[@hop]``."""
    ids = [r.id for r in await run_rows(sup, row.task_id, run_of(row))]
    keys = [a.idempotency_key for a in await sup.journal.actions(ids)]
    keys += [str(e.detail.get("key", "")) for e in await sup.journal.events(ids)
             if e.kind == "replay"]
    return {activity_of(k) for k in keys if k}


async def _unjournaled(sup: Supervisor, handle: temporalio.client.WorkflowHandle[Any, Any],
                       row: DelegationRow, report: Report, until: float) -> Report:
    """A stop whose run the journal held nothing of: Temporal's word on whether activities of
    it may have run (``temporal_history``). Where every activity passes tether's plugin there
    are none; some mean a worker without the plugin, or records moved by hand: the report
    must not say the run did nothing. One in a worker's hands is waited for until ``until``
    (a recall's grace; the run is fenced, so tether's plugin refuses it): judged in flight,
    one that tether was about to refuse would be a person's problem."""
    run = handle._client.get_workflow_handle(handle.id, run_id=run_of(row))
    try:
        ran = await settled_view(run, until)
    except RPCError as exc:  # Temporal cannot say now: neither can the report
        return dataclasses.replace(
            report, verdict=Verdict.REJECTED.value, outcome=DelegationState.NEEDS_ATTENTION,
            reason=f"{report.reason}; Temporal could not say whether activities of workflow "
                   f"{handle.id} run {run_of(row)} ran, and the journal holds no record of "
                   f"any ({exc}): a person decides, or a recall again asks again")
    # What the journal holds a call of after all (a replay, during the wait as well) is its.
    recorded = await _recorded(sup, row)
    ran = {name: i for name, i in ran.items() if not i or i not in recorded}
    if not ran:
        return report
    return dataclasses.replace(
        report, verdict=Verdict.REJECTED.value, outcome=DelegationState.NEEDS_ATTENTION,
        reason=f"{report.reason}; Temporal shows {len(ran)} activity(ies) of workflow "
               f"{handle.id} run {run_of(row)} that may have run and that the journal holds "
               "no record of (run by a worker without tether's plugin, or records moved by "
               f"hand): a person decides ({', '.join(sorted(ran)[:5])})")


# What a stop's own verdict says when its epoch did nothing: wrong for a run an earlier epoch
# of which did (its worker stopped or died, and the stop opened the next epoch to fence it).
_NOTHING = frozenset({Verdict.NO_SIDE_EFFECTS.value, Verdict.NEVER_STARTED.value})


async def _with_earlier(sup: Supervisor, row: DelegationRow, report: Report) -> Report:
    """The run's report with what its earlier epochs did (each as it stands, a child of the
    report), so that a stop that had to open the run's next epoch does not say it did
    nothing."""
    earlier = [r for r in await run_rows(sup, row.task_id, run_of(row))
               if r.epoch < row.epoch and r.parent_id is None]
    if not earlier:
        return report
    reports = [await sup.report(r.id) for r in earlier]
    acted = [a for r in reports for a in r.all_actions()]
    verdict = report.verdict
    if any(r.needs_attention for r in reports) and (
            verdict is None or _rank(verdict) < _rank(Verdict.RECONCILE.value)):
        verdict = Verdict.RECONCILE.value  # an earlier epoch's call is in doubt
    elif acted and verdict in _NOTHING:
        verdict = Verdict.RECALLED_CLEAN.value
    attention = any(r.needs_attention or r.outcome is DelegationState.NEEDS_ATTENTION
                    for r in reports)
    said = ", ".join(f"epoch {r.epoch} {r.outcome.value}" for r in reports)
    return dataclasses.replace(
        report, children=(*reports, *report.children), verdict=verdict,
        reason=f"{report.reason}; earlier epochs of the run: {said}",
        outcome=DelegationState.NEEDS_ATTENTION if attention else report.outcome)


def _with_children(report: Report, ids: list[str],
                   outcomes: list[Report | BaseException]) -> Report:
    """The run's report with its children stopped apart: their reports added, the verdict
    the worst of all (REJECTED where one could not be stopped), and NEEDS_ATTENTION where one
    needs a person or could not be stopped (the run itself is stopped all the same)."""
    if not outcomes:
        return report
    reports = [o for o in outcomes if isinstance(o, Report)]
    failed = [f"{ids[n] if n < len(ids) else 'its children'}: {type(o).__name__}: {o}"
              for n, o in enumerate(outcomes) if not isinstance(o, Report)]
    verdicts = [v for v in (report.verdict, *(r.verdict for r in reports)) if v is not None]
    # A child that could not be stopped (its records fail verification, say) was refused:
    # nothing about it is clean.
    worst = Verdict.REJECTED.value if failed else max(verdicts, key=_rank,
                                                        default=report.verdict)
    said = [f"workflow {r.task_id.removeprefix('temporal:')} {r.outcome.value} ({r.verdict})"
            for r in reports]
    reason = report.reason + "; child workflows stopped apart: " + ", ".join(said + [
        f"not stopped: {f}" for f in failed])
    attention = bool(failed) or any(r.needs_attention or
                                    r.outcome is DelegationState.NEEDS_ATTENTION
                                    for r in reports)
    return dataclasses.replace(
        report, children=(*report.children, *reports), verdict=worst, reason=reason,
        outcome=DelegationState.NEEDS_ATTENTION if attention else report.outcome)


async def _children_apart(sup: Supervisor, handle: temporalio.client.WorkflowHandle[Any, Any],
                          run_id: str) -> list[temporalio.client.WorkflowHandle[Any, Any]]:
    """The run's descendant workflows whose runs opened a delegation of their own (on a
    worker that did not host their parent's tree): each noted on its parent's delegation,
    in this run's trees, before it opened, so the list holds those that closed since too.
    The nearest under each branch (its own stop walks on from it). Only from records that
    verify (a note deleted by hand would hide a child: Tampered), and each checked with
    Temporal to be the child of the run it was noted under (ChildUnknown otherwise)."""
    roots = [r.id for r in await run_rows(sup, task_of(handle.id), run_id)]
    await sup.journal.untampered(await sup.journal.kin(roots), sup.keys.trusted,
                                 f"list the child workflows of {handle.id} run {run_id}")
    noted = await sup.journal.peek(queue.noted_in_trees, roots, CHILD_APART)
    apart, seen = [], set()
    for under, detail in noted:
        child = (detail.get("workflow_id"), detail.get("run_id"))
        if not (isinstance(child[0], str) and isinstance(child[1], str)):
            raise ChildUnknown(f"a note on {under.id} names no workflow run: {detail}")
        if child in seen:
            continue
        seen.add(child)
        # The SDK's handle keeps its client private (within the pinned range, tested).
        found = handle._client.get_workflow_handle(child[0], run_id=child[1])
        try:
            described = await found.describe()
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise
            described = None  # past Temporal's retention: stopped from the journal alone
        if described is not None and (described.parent_id, described.parent_run_id) != (
                workflow_of(under.task_id), run_of(under)):
            raise ChildUnknown(f"workflow {child[0]} run {child[1]}, noted on {under.id} as "
                               f"a child of workflow {workflow_of(under.task_id)}, is not "
                               "its child in Temporal")
        rows = await run_rows(sup, task_of(child[0]), child[1])
        await sup.journal.untampered(await sup.journal.kin([r.id for r in rows]),
                                     sup.keys.trusted, f"stop the child workflow {child[0]}")
        if rows and rows[-1].parent_id is not None:
            continue  # moved into its parent's tree since (whose stop reached it)
        apart.append(found)
    return apart


async def _delegation_of(sup: Supervisor, handle: temporalio.client.WorkflowHandle[Any, Any],
                         *, reopen: bool = True) -> tuple[DelegationRow, bool]:
    """The run's delegation, and whether the journal held none of the run before. When no
    activity of the run has reached tether yet, or the last epoch's ended without anyone's
    intent, this process opens one for it (its body only waits to be stopped), so that the
    fence stands in the journal before Temporal hears of the recall: an activity that starts
    afterwards is refused as any activity of a recalled run is."""
    described = None
    run_id = handle.run_id
    if run_id is None:  # a handle on the workflow id: its latest run
        described = await handle.describe()
        run_id = described.run_id
        first = described.raw_description.workflow_execution_info.first_run_id
        if handle.first_execution_run_id not in (None, first):
            # The handle's chain has closed, and a later start of the id runs now: not the
            # work this handle names (Temporal's own cancel through it would not reach it).
            raise UserError(f"workflow {handle.id}: the chain this handle started (first run "
                            f"{handle.first_execution_run_id}) has closed, and a later start "
                            f"of the id runs now; stop that one with a handle of its own")
    rows = await run_rows(sup, task_of(handle.id), run_id)
    if rows and not reopen:  # a child stopped with its parent: its last epoch, closed or not
        return rows[-1], False
    for attempt in range(_ATTEMPTS):
        if attempt:  # another process moved the task: let it finish before looking again
            await asyncio.sleep(0.01 * 2 ** attempt)
        head = await sup.journal.peek(queue.task_head, task_of(handle.id))
        if head is not None and run_of(head) == run_id and (
                not reopen or not await _goes_on(sup, head)):
            return head, False  # (a child stopped with its parent: its last epoch as it stands)
        described = described or await handle.describe()
        if rows and described.status is not temporalio.client.WorkflowExecutionStatus.RUNNING:
            return rows[-1], False  # closed: nothing of it goes on, and its last epoch reports it
        agent = Agent(f"temporal:{described.workflow_type}", _held)
        try:
            opened = await open_run(sup, handle.id, run_id, agent)
        except RunRefused as exc:
            if not exc.retry:
                raise
            continue  # a worker opened it (or moved the task) first: look again
        return await sup.journal.get(opened.id), not rows
    raise UserError(f"workflow {handle.id}: its task kept moving while this recall looked "
                    "for the run's delegation; try again")


async def _goes_on(sup: Supervisor, head: DelegationRow) -> bool:
    """A delegation ended or fenced without anyone's intent (its worker stopped, or died and
    was recovered, its calls perhaps still in doubt): the run's next activity would open the
    next epoch, so the recall opens that epoch itself and fences it, as for a run with no
    delegation yet."""
    return (head.fenced or head.state.terminal) and not await run_stopped(sup, head)


async def _held(ctx: Context, workflow_id: str, run_id: str) -> None:
    """The body of a run's delegation opened by its orchestrator: nothing runs in it."""
    await asyncio.Event().wait()


async def tell_temporal(handle: temporalio.client.WorkflowHandle[Any, Any], kind: ControlKind,
                        reason: str) -> None:
    """After the journal's report: cancel (recall) or terminate the run in Temporal."""
    try:
        if kind is ControlKind.RECALL:
            await handle.cancel()
        else:
            await handle.terminate(reason=reason or "terminated by tether")
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:  # NOT_FOUND: the run already closed
            raise


async def run_handle(address: str, namespace: str, workflow_id: str, run_id: str | None
                     ) -> temporalio.client.WorkflowHandle[Any, Any]:
    """For ``tether recall --temporal``: the handle of a workflow run, checked to exist before
    anything is signed, so that a wrong address, namespace or run changes nothing."""
    try:
        client = await temporalio.client.Client.connect(address, namespace=namespace)
    except (RuntimeError, OSError, ValueError) as exc:  # the SDK's connect errors
        raise UserError(f"cannot reach Temporal at {address}: {exc}") from None
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    try:
        await handle.describe()
    except RPCError as exc:
        raise UserError(f"Temporal at {address} (namespace {namespace}) does not know "
                        f"workflow {workflow_id} run {run_id}: {exc.message}") from None
    return handle
