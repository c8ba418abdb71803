"""Recall and terminate of a Temporal workflow run, from the orchestrator's process.

The run's delegation is found by its task (``temporal:<workflow id>``) and stopped as any
delegation is (``Handle.recall``/``terminate``: signed intent, fence, grace, probes, report),
wherever its worker hosts it; only then is the workflow cancelled (recall) or terminated in
Temporal, so that its in-flight activities got their grace and no new one can start.
"""

from __future__ import annotations

from typing import Any

import temporalio.client
from temporalio.service import RPCError, RPCStatusCode

from tether._core.errors import NotFound, UserError
from tether._core.model import ControlKind
from tether._core.report import Report
from tether._integrations.temporal_worker import run_of, task_of
from tether._journal import queue
from tether._journal.rows import DelegationRow
from tether._runtime.supervisor import Supervisor


async def recall(handle: temporalio.client.WorkflowHandle[Any, Any], *, supervisor: Supervisor,
                 grace: float, reason: str = "") -> Report:
    """Stop the run's new work at once; let its in-flight activities finish within ``grace``
    seconds; then cancel the workflow, and account for every activity it started."""
    return await _stop(handle, supervisor, ControlKind.RECALL, grace, reason)


async def terminate(handle: temporalio.client.WorkflowHandle[Any, Any], *,
                    supervisor: Supervisor, reason: str = "") -> Report:
    """Cut the run's in-flight activities now (each in doubt, then probed), terminate the
    workflow, and account for every activity it started."""
    return await _stop(handle, supervisor, ControlKind.TERMINATE, None, reason)


async def _stop(handle: temporalio.client.WorkflowHandle[Any, Any], sup: Supervisor,
                kind: ControlKind, grace: float | None, reason: str) -> Report:
    if not isinstance(handle, temporalio.client.WorkflowHandle):
        raise UserError(f"expected a Temporal WorkflowHandle, not {type(handle).__name__}")
    if not isinstance(sup, Supervisor) or not sup.is_open:
        raise UserError("supervisor must be an open tether.Supervisor on the workers' journal")
    if not isinstance(reason, str):
        raise UserError("reason must be a string")
    row = await _delegation_of(sup, handle)
    if row is None:
        # No activity of this run reached tether yet: stop it in Temporal first, then look
        # again, since an activity that started meanwhile journaled its run before it ran.
        await _in_temporal(handle, kind, reason)
        row = await _delegation_of(sup, handle)
        if row is None:
            raise NotFound(f"workflow {handle.id} ran no activity through tether: it was "
                           f"{'cancelled' if kind is ControlKind.RECALL else 'terminated'} "
                           "in Temporal, and the journal holds nothing of it")
    mine = sup.handle_for(row.id)
    if kind is ControlKind.RECALL:
        assert grace is not None
        report = await mine.recall(grace, reason)
    else:
        report = await mine.terminate(reason)
    await _in_temporal(handle, kind, reason)
    return report


async def _delegation_of(sup: Supervisor, handle: temporalio.client.WorkflowHandle[Any, Any]
                         ) -> DelegationRow | None:
    head = await sup.journal.peek(queue.task_head, task_of(handle.id))
    if head is None or (handle.run_id is not None and run_of(head) != handle.run_id):
        return None
    return head


async def _in_temporal(handle: temporalio.client.WorkflowHandle[Any, Any], kind: ControlKind,
                       reason: str) -> None:
    try:
        if kind is ControlKind.RECALL:
            await handle.cancel()
        else:
            await handle.terminate(reason=reason or "terminated by tether")
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:  # NOT_FOUND: the run already closed
            raise
