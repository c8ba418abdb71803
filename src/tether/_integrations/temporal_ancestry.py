"""Whether a Temporal workflow run may still act: what Temporal says of the run (its workflow
type, its parent run, the first run of its chain) and what the journal says of the stops of
its chain and of its ancestors' chains, on records that verify.

A chain is what Temporal's ``first_run_id`` names: the runs one start of a workflow id goes
through (continue-as-new, a workflow retry). A run is refused once anyone recalled or
terminated any run of its chain, so that a recalled run whose code ignores the cancel and
continues as new acts no more; a new start of the same id begins a chain of its own. The
stops are read from records that verify against their signed chain: a control sequence set
back by hand, or a row deleted, is named (``Tampered``), never taken for "nobody stopped it".
"""

from __future__ import annotations

from dataclasses import dataclass

import temporalio.client
from temporalio.api.enums.v1 import ContinueAsNewInitiator
from temporalio.service import RPCError, RPCStatusCode

from tether._integrations.temporal_runs import RunRefused, run_stopped
from tether._integrations.temporal_task import run_of, task_of
from tether._journal import queue
from tether._journal.rows import DelegationRow
from tether._runtime.supervisor import Supervisor

_KEPT = 4096  # runs whose description a worker keeps
_DEPTH = 64  # ancestors a call looks at, at most


@dataclass(frozen=True)
class Run:
    """What Temporal says of a run, which never changes."""

    workflow_type: str
    parent: tuple[str, str] | None  # (workflow id, run id) of a child workflow's parent
    first: str  # the first run of its chain


class Ancestry:
    """One worker's view of the runs whose activities it runs."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self._runs: dict[tuple[str, str], Run] = {}
        self._hops: dict[tuple[str, str], int] = {}

    async def hop(self, client: temporalio.client.Client, workflow_id: str,
                  run_id: str) -> int:
        """The run's place in its chain: how many times the chain continued as new (or fired
        its cron schedule) before it; a workflow retry keeps its run's place, since it does
        that run's work again. What a call's key holds beside its place in its run, so that
        run 2 of a chain does not replay run 1's calls, while a new start of the id (a new
        chain) replays by key what the same places of an earlier chain completed."""
        walked: list[tuple[tuple[str, str], bool]] = []  # each run, and whether it moved on
        key: tuple[str, str] | None = (workflow_id, run_id)
        base = 0
        while key is not None:
            if key in self._hops:
                base = self._hops[key]
                break
            previous, moved = await _started(client, *key)
            walked.append((key, moved))
            key = None if previous is None else (workflow_id, previous)
        for found, moved in reversed(walked):
            base += 1 if moved else 0
            self._hops[found] = base
        while len(self._hops) > _KEPT:
            del self._hops[next(iter(self._hops))]
        return base

    async def describe(self, client: temporalio.client.Client, workflow_id: str,
                       run_id: str) -> Run:
        """Asked of Temporal once per run, and kept for the runs of late."""
        key = (workflow_id, run_id)
        found = self._runs.get(key)
        if found is None:
            described = await client.get_workflow_handle(workflow_id, run_id=run_id).describe()
            parent = ((described.parent_id, described.parent_run_id)
                      if described.parent_id is not None
                      and described.parent_run_id is not None else None)
            first = described.raw_description.workflow_execution_info.first_run_id or run_id
            found = self._runs[key] = Run(described.workflow_type, parent, first)
            while len(self._runs) > _KEPT:
                del self._runs[next(iter(self._runs))]
        return found

    async def stopped(self, client: temporalio.client.Client, workflow_id: str,
                      run_id: str) -> DelegationRow | None:
        """A delegation of the run's chain that someone recalled or terminated, at any epoch;
        Tampered if the task's records fail verification."""
        sup = self.sup
        rows = await sup.journal.peek(queue.task_delegations, task_of(workflow_id))
        await sup.journal.untampered([r.id for r in rows], sup.keys.trusted,
                                     f"judge workflow {workflow_id} run {run_id}")
        first = None
        for row in rows:
            other = run_of(row)
            if row.control_seq == 0 or other is None:
                continue
            if other != run_id:
                first = first or (await self.describe(client, workflow_id, run_id)).first
                if other != first and await self._first_of(client, workflow_id, other) != first:
                    continue
            if await run_stopped(sup, row):
                return row
        return None

    async def _first_of(self, client: temporalio.client.Client, workflow_id: str,
                        run_id: str) -> str | None:
        try:
            return (await self.describe(client, workflow_id, run_id)).first
        except RPCError as exc:  # past Temporal's retention: no later run continues it
            if exc.status is RPCStatusCode.NOT_FOUND:
                return None
            raise

    async def still_wanted(self, client: temporalio.client.Client,
                           parent: tuple[str, str]) -> None:
        """Before each call of a child workflow's run: its ancestors' chains, looked at
        again, up to the root. A fence reaches a child in its parent's tree, but not one
        whose tree's root is a delegation of its own (apart), nor a guest's call of one. A
        stop lists the run's children apart after its intent is accepted; this looks after
        the child's row is written: whichever comes second sees the other, so no new call
        starts once an ancestor was stopped (calls already on their way finish, as within
        any grace)."""
        key: tuple[str, str] | None = parent
        for _ in range(_DEPTH):
            if key is None:
                return
            stop = await self.stopped(client, *key)
            if stop is not None:
                raise RunRefused(f"an ancestor's run, of workflow {key[0]}, was recalled or "
                                 f"terminated (delegation {stop.id})")
            key = (await self.describe(client, *key)).parent


_MOVED_ON = (ContinueAsNewInitiator.CONTINUE_AS_NEW_INITIATOR_WORKFLOW,
             ContinueAsNewInitiator.CONTINUE_AS_NEW_INITIATOR_CRON_SCHEDULE)


async def _started(client: temporalio.client.Client, workflow_id: str,
                   run_id: str) -> tuple[str | None, bool]:
    """The run this one continues (None for a chain's first), and whether it moved on from
    it (continued as new, a cron firing) rather than retried it."""
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    async for event in handle.fetch_history_events(page_size=1):
        started = event.workflow_execution_started_event_attributes
        previous = started.continued_execution_run_id or None
        return previous, previous is not None and started.initiator in _MOVED_ON
    return None, False
