"""Opening a Temporal workflow run's delegation in the journal, for a worker that hosts it or
an orchestrator that fences it before any of its activities ran: the task's first epoch, or
its next after an epoch that ended without anyone's intent; never for a run someone recalled
or terminated; a child workflow's under its parent's. And what a guest's call watches of the
delegation it is made in."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tether._core.documents import ControlIntent
from tether._core.errors import (
    ControlSignal,
    Recalled,
    StaleEpoch,
    StaleSequence,
    Terminated,
    TetherError,
    UserError,
)
from tether._core.model import ControlKind
from tether._integrations.temporal_task import run_of, task_of
from tether._journal import queue
from tether._journal.rows import DelegationRow, NewDelegation
from tether._runtime.arguments import child_payload
from tether._runtime.handle import Handle
from tether._runtime.remote import owner_alive
from tether._runtime.state import ChildRuntime, new_id
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent, check_surface

_LINEAGE = 64  # ancestors a guest's call watches, at most


class RunRefused(TetherError):
    """This process may not open a delegation for the workflow run; ``retry``: it may later
    (another live process hosts the run's task, or moved it on first); ``host``: the run's
    live delegation, hosted by another process (whose calls this one may make as a guest)."""

    def __init__(self, why: str, *, retry: bool = False,
                 host: DelegationRow | None = None) -> None:
        super().__init__(why)
        self.retry = retry
        self.host = host


async def open_run(sup: Supervisor, workflow_id: str, run_id: str, agent: Agent) -> Handle:
    """Start the run's delegation in ``sup``: epoch 0 of a task the journal does not know, else
    the task's next epoch, whose completed calls replay by key (as ``Handle.redelegate``);
    never for a run a control intent was accepted for. Two processes opening one task race
    in the journal (the task's insert, the epoch's compare-and-set): one wins."""
    task = task_of(workflow_id)
    head = await sup.journal.peek(queue.task_head, task)
    if head is not None:
        head = await _next_epoch_of(sup, head, workflow_id, run_id)
    args = (workflow_id, run_id)
    surface = check_surface(agent.tools, agent.name)
    try:
        row = await sup.journal.create_delegation(NewDelegation(
            id=new_id("d"), task_id=task, parent_id=None,
            attempt=1 if head is None else head.attempt, agent=agent.name,
            surface=tuple(surface), args=child_payload(args, {}, agent.name),
            owner_id=sup.owner_id, now=sup.clock.wall(),
            redelegate_from_epoch=None if head is None else head.epoch,
            unstopped=None if head is None else (head.id, head.control_seq)))
    except StaleEpoch:
        # (A retry judges the new epoch, and may make its calls as a guest.)
        raise RunRefused(f"task {task} moved to a new epoch elsewhere", retry=True) from None
    except StaleSequence:
        # An intent was accepted for the epoch this one supersedes after it was judged: a
        # retry judges it (a stop keeps the run out for good).
        raise RunRefused(f"delegation {head.id if head else '?'} of task {task} was stopped "
                         "meanwhile", retry=True) from None
    except UserError as exc:
        if head is not None or await sup.journal.peek(queue.task_head, task) is None:
            raise
        raise RunRefused(str(exc), retry=True) from None  # its first epoch opened elsewhere
    # Other workers of the run's queue make calls of it too (as guests): its drains wait for
    # theirs.
    run = await sup.launch(ChildRuntime(row, agent, surface, guests=True), args, {},
                           sup.redispatch)
    return Handle.for_run(sup, run)


async def open_child(sup: Supervisor, parent_id: str, workflow_id: str, run_id: str,
                     agent: Agent) -> Handle:
    """Start a child workflow run's delegation in ``sup``, as a child of its parent run's
    delegation ``parent_id``, hosted here: the task's first epoch, else its next, whose
    completed calls replay by key (as a re-delegated parent's children do). The journal
    refuses it once the parent is fenced, as any child of a recalled delegation."""
    task = task_of(workflow_id)
    parent = sup.runtime(parent_id)
    if parent is None:
        raise RunRefused(f"the parent's delegation {parent_id} ended here", retry=True)
    head = await sup.journal.peek(queue.task_head, task)
    if head is not None:
        await _next_epoch_of(sup, head, workflow_id, run_id)
    try:
        run = await sup.start_child(parent, agent, (workflow_id, run_id), {}, task_id=task,
                                    guests=True)
    except StaleEpoch:  # the run opened apart meanwhile (``open_run``): judged again
        raise RunRefused(f"task {task} moved to a new epoch elsewhere", retry=True) from None
    except ControlSignal as signal:
        raise RunRefused(f"its parent's delegation {parent_id} is fenced: "
                         f"{type(signal).__name__.lower()}: {signal}") from None
    return Handle.for_run(sup, run)


async def run_rows(sup: Supervisor, task: str, run_id: str | None) -> list[DelegationRow]:
    """Every delegation of ``task`` for the workflow run ``run_id``, oldest epoch first."""
    return [r for r in await sup.journal.peek(queue.task_delegations, task)
            if run_of(r) == run_id]


async def stopped_run(sup: Supervisor, task: str, run_id: str) -> DelegationRow | None:
    """A delegation of ``task`` for the workflow run ``run_id`` that someone recalled or
    terminated, at any epoch (a later epoch of another run of the id never reopens it)."""
    for row in await run_rows(sup, task, run_id):
        if row.control_seq > 0 and await run_stopped(sup, row):
            return row
    return None


async def _next_epoch_of(sup: Supervisor, head: DelegationRow, workflow_id: str,
                         run_id: str) -> DelegationRow:
    """The task's latest delegation, settled, before its next epoch opens here; refused for
    a run a control intent was accepted for, or one another live process hosts (then, for
    the same run and records that verify, ``host`` names it: this process may be its guest)."""
    # An ended delegation is fenced too; one that someone recalled or terminated has a
    # sequence above 0, and only that one keeps its run out for good. A recovery's terminate
    # (tether settling the delegation of a worker that died) stopped nobody's work: the run
    # goes on at a new epoch, as Temporal retries its activity elsewhere.
    stop = await stopped_run(sup, head.task_id, run_id)
    if stop is not None:
        raise RunRefused(f"workflow run {run_id} was recalled or terminated (delegation "
                         f"{stop.id}, control sequence {stop.control_seq})")
    if not head.fenced and not head.state.terminal:
        if head.owner_id == sup.owner_id and sup.runtime(head.id) is not None:
            # This process's own, still live: an earlier run's whose close it has not seen
            # yet (a run continued as new, say). Never recovered from under itself.
            raise RunRefused(f"delegation {head.id} of workflow {workflow_id} is still "
                             "ending here", retry=True)
        if head.owner_id != sup.owner_id and await owner_alive(sup, head.owner_id):
            host = None
            if run_of(head) == run_id:
                # A guest acts in the host's delegation only if its records verify: a row
                # written by hand (an unfenced epoch after a recall) would let a stopped run
                # act.
                await sup.journal.untampered(await sup.journal.kin([head.id]),
                                             sup.keys.trusted, f"act as a guest of {head.id}")
                host = head
            raise RunRefused(f"delegation {head.id} of workflow {workflow_id} is hosted by "
                             "another live process", retry=True, host=host)
        await sup.recover_delegation(head, "owner is gone")
        head = await sup.journal.get(head.id)
        # Someone's recall or terminate may have been accepted since the look above (the
        # recovery then met it): it keeps the run out as well.
        stop = await stopped_run(sup, head.task_id, run_id)
        if stop is not None:
            raise RunRefused(f"workflow run {run_id} was recalled or terminated (delegation "
                             f"{stop.id}, control sequence {stop.control_seq})")
    # The new epoch trusts the old records only if they verify.
    await sup.journal.untampered(await sup.journal.kin([head.id]), sup.keys.trusted,
                                 f"re-delegate {head.id}")
    return head


async def run_stopped(sup: Supervisor, head: DelegationRow) -> bool:
    """Whether any control intent accepted for ``head`` is someone's stop rather than a
    recovery's. Fail closed: an intent whose signature this deployment does not trust, one
    signed for another delegation, epoch or sequence, or a sequence with no intent to show
    for it counts as a stop (it never lets a run go on)."""
    controls = await sup.journal.controls(head.id)
    if len(controls) != head.control_seq:
        return True
    trusted = await sup.current_trust()  # the registry's keys, as every intent is judged
    for control in controls:
        try:
            intent = trusted.verify(control.signed, ControlIntent)
        except TetherError:
            return True
        if not intent.recovery or (intent.delegation_id, intent.epoch, intent.seq) != (
                head.id, head.epoch, control.seq):
            return True
    return False


async def stopped(sup: Supervisor, delegation_id: str) -> bool:
    """Whether someone recalled or terminated the delegation (not merely ended it)."""
    row = await sup.journal.get(delegation_id)
    return row.control_seq > 0 and await run_stopped(sup, row)


async def lineage(sup: Supervisor, row: DelegationRow) -> tuple[tuple[str, int], ...]:
    """``row`` and its ancestors, nearest first, with their control sequences as read: whose
    control intents reach a call made under ``row`` (a recall or terminate of any fences it).
    ``row`` as its caller judged it: an intent accepted since is one the watch acts on."""
    found = [(row.id, row.control_seq)]
    while row.parent_id is not None and len(found) < _LINEAGE:
        row = await sup.journal.get(row.parent_id)
        found.append((row.id, row.control_seq))
    return tuple(found)


async def watch_controls(sup: Supervisor, rt: ChildRuntime,
                         watched: Sequence[tuple[str, int]]) -> None:
    """While a guest's call runs here under a delegation another worker hosts: a control
    intent accepted for one of ``watched`` (that delegation and its ancestors), once its
    signature verifies, reaches the call as it would at the host. A recall stops new calls
    (the journal refuses them anyway); a terminate cuts the call now, which the host's drain
    marks in doubt and probes. A recovery's terminate stopped nobody's work: the call runs on
    and records its receipt. Polled: the host's wake-ups go to the host."""
    seen = dict(watched)
    while True:
        await asyncio.sleep(sup.control_poll)
        for delegation_id, known in seen.items():
            try:
                row = await sup.journal.get(delegation_id)
                if row.control_seq <= known:
                    continue
                trusted = await sup.current_trust()
                controls = await sup.journal.controls(delegation_id)
            except TetherError:  # the journal is away: looked at again at the next poll
                continue
            for control in controls[known:]:
                try:
                    intent = trusted.verify(control.signed, ControlIntent)
                except TetherError:
                    continue  # not acted on here, as the host would not (docs/security.md)
                if (intent.delegation_id, intent.seq) != (delegation_id, control.seq) or \
                        intent.recovery:
                    continue
                for node in rt.walk():
                    if intent.kind is ControlKind.TERMINATE:
                        node.stop = Terminated(node.id, intent.reason)
                        for call in node.inflight.values():
                            call.cancel()
                    else:
                        node.stop = node.stop or Recalled(node.id, intent.reason)
            seen[delegation_id] = row.control_seq
