"""Temporal's word on a run the journal holds nothing of: which of its activities may have
run (a worker without tether's plugin, or records moved by hand), read from the run's history
and its description. Every judgement here errs towards "may have run": the report that uses
it must never say a run did nothing when something of it may have applied."""

from __future__ import annotations

import asyncio
from typing import Any

import temporalio.client
from temporalio.api.enums.v1 import EventType, PendingActivityState, PendingWorkflowTaskState
from temporalio.api.failure.v1 import Failure

from tether._integrations.temporal_activities import BUSY, REFUSED

_REFUSALS = frozenset({REFUSED, BUSY})
# In a worker's hands: the answer may change once it closes (past the fence, tether's
# plugin refuses it).
_HELD = frozenset({PendingActivityState.PENDING_ACTIVITY_STATE_STARTED,
                   PendingActivityState.PENDING_ACTIVITY_STATE_CANCEL_REQUESTED})
_SCHEDULED = PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
_CLOSED = frozenset({EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
                     EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
                     EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
                     EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED})
# The marker Temporal's SDKs (their shared core) record when a local activity ends: a local
# activity is never scheduled on a task queue, so it shows nowhere else.
_LOCAL = "core_local_activity"
# The run's workflow task, in a worker's hands: local activities run inside it.
_TASK = "its workflow task (local activities run there)"
_TASK_ENDED = frozenset({EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
                         EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
                         EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT})


def _refused(failure: Failure) -> bool:
    return failure.application_failure_info.type in _REFUSALS


def _refused_throughout(attempt: int, last_failure: Failure) -> bool:
    """Whether every attempt up to ``attempt`` was refused by tether, as far as Temporal can
    tell: it keeps only the failure before the last attempt, so from the third on an earlier
    attempt may have run (on a worker without the plugin) unseen."""
    return attempt <= 1 or (attempt == 2 and _refused(last_failure))


async def may_have_run(run: temporalio.client.WorkflowHandle[Any, Any]
                       ) -> tuple[dict[str, str], set[str]]:
    """What of the run may have run, and what may change the answer if looked at again (in a
    worker's hands, or moved between the two reads). Activities are told apart by their
    scheduled event, not their id, which a workflow may give twice. The history is read
    first: what closes or is scheduled before the description is read is counted, and
    looked at again, never taken for something still waiting."""
    scheduled: dict[int, str] = {}  # scheduled event id -> activity id
    started: dict[int, tuple[int, Failure]] = {}  # scheduled event id -> attempt, failure
    opened: dict[str, int] = {}  # activity id -> its latest scheduled event still open
    ran: dict[str, str] = {}  # what may have run -> its activity id ("" for a local one)
    task_started = 0  # the workflow task in a worker's hands as the history ends, if any
    async for event in run.fetch_history_events():
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled[event.event_id] = \
                event.activity_task_scheduled_event_attributes.activity_id
            opened[scheduled[event.event_id]] = event.event_id
            ran[_activity(event.event_id, scheduled[event.event_id])] = \
                scheduled[event.event_id]
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            began = event.activity_task_started_event_attributes
            started[began.scheduled_event_id] = (began.attempt, began.last_failure)
        elif kind in _CLOSED:
            which = _closed_of(event)
            activity_id = scheduled.get(which, "")
            if opened.get(activity_id) == which:
                del opened[activity_id]
            name = _activity(which, activity_id)
            ran.pop(name, None)
            failed = event.activity_task_failed_event_attributes
            attempt, last = started.get(which, (2, Failure()))  # no start seen: not trusted
            if kind != EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED or not _refused(failed.failure):
                ran[f"{name}, {_ending(kind)} at attempt {attempt}"] = activity_id
            elif not _refused_throughout(attempt, last):
                ran[f"{name}, refused at attempt {attempt}, earlier ones unseen"] = activity_id
        elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
            marker = event.marker_recorded_event_attributes
            # A local activity's retries run on its workflow's worker: refused there, refused
            # throughout (a limit: one retried past a timer may move to another worker).
            if marker.marker_name == _LOCAL and not _refused(marker.failure):
                ran[f"local activity (event {event.event_id})"] = ""
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            task_started = event.event_id
        elif kind in _TASK_ENDED:
            task_started = 0
            if kind != EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and _had_started(event):
                # A task that started and did not complete drops the markers of the local
                # activities it ran: they may have run all the same.
                ran[f"workflow task that did not complete (event {event.event_id})"] = ""
    described = (await run.describe()).raw_description
    held: set[str] = set()
    if task_started:  # in a worker's hands as read: its local activities may be running
        ran[_TASK] = ""
        held.add(_TASK)
    pending = {p.activity_id: p for p in described.pending_activities}
    for activity_id, p in pending.items():
        open_at = opened.get(activity_id)
        name = (_activity(open_at, activity_id) if open_at
                else f"activity {activity_id} (new)")
        if p.state == _SCHEDULED and _refused_throughout(p.attempt, p.last_failure):
            ran.pop(name, None)  # waiting for a first attempt, or after refusals only
            if not open_at:
                held.add(name)  # scheduled since the history was read: read it again
        else:
            ran.pop(name, None)
            name = f"{name}, pending at attempt {p.attempt}"
            ran[name] = activity_id
            if p.state in _HELD or not open_at:
                held.add(name)
    for activity_id, which in opened.items():
        if activity_id not in pending:  # closed since the history was read
            held.add(_activity(which, activity_id))
    if described.pending_workflow_task.state == \
            PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_STARTED:
        ran[_TASK] = ""
        held.add(_TASK)
    return ran, held


def _ending(kind: Any) -> str:
    return EventType.Name(kind).removeprefix("EVENT_TYPE_ACTIVITY_TASK_").lower()


def _activity(scheduled_event: int, activity_id: str) -> str:
    return f"activity {activity_id} (event {scheduled_event})"


def _closed_of(event: Any) -> int:
    """The scheduled event id an activity's closing event names."""
    for attributes in (event.activity_task_completed_event_attributes,
                       event.activity_task_failed_event_attributes,
                       event.activity_task_timed_out_event_attributes,
                       event.activity_task_canceled_event_attributes):
        if attributes.scheduled_event_id:
            return int(attributes.scheduled_event_id)
    return 0


def _had_started(event: Any) -> bool:
    """A failed or timed-out workflow task that a worker had taken (not one that timed out
    waiting on a sticky queue)."""
    return bool(event.workflow_task_failed_event_attributes.started_event_id
                or event.workflow_task_timed_out_event_attributes.started_event_id)


async def settled_view(run: temporalio.client.WorkflowHandle[Any, Any], until: float
                       ) -> dict[str, str]:
    """What may have run, once nothing in a worker's hands can change it, or at ``until``
    (a recall's grace; a terminate looks once)."""
    loop = asyncio.get_running_loop()
    pause = 0.02
    while True:
        ran, held = await may_have_run(run)
        if not ran.keys() & held or loop.time() >= until:
            return ran
        await asyncio.sleep(min(pause, max(0.0, until - loop.time())))
        pause = min(pause * 2, 0.5)
