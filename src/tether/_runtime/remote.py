"""The orchestrator's side of work that runs elsewhere: in a worker process that claimed it
from the queue, or in another supervisor. Waiting on another process is real time (its
progress is not on our clock); deciding that the other process is gone uses its lease or
heartbeat, and then this process reconciles the work itself.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING, Any

from tether._core import drain, outcome
from tether._core.documents import ControlIntent
from tether._core.errors import DelegationError
from tether._core.model import ControlKind, DelegationState
from tether._core.report import Report
from tether._core.signing import Signed
from tether._core.verdict import Verdict
from tether._core.waiting import Interrupted
from tether._journal import ops
from tether._journal.rows import DelegationRow, OwnerRow
from tether._runtime.reconcile import build_report, settle_subtree

if TYPE_CHECKING:
    from tether._runtime import ports


async def owner_alive(sup: ports.Liveness, owner_id: str) -> bool:
    """A worker is alive while its lease holds; another owner while its heartbeat is recent
    (and, on this host, while its process exists)."""
    if owner_id == sup.owner_id:
        return True
    now = sup.clock.wall()  # before the read: a renewal committed meanwhile is then seen
    owner, server_now = await sup.journal.liveness(owner_id)
    return judge_alive(sup, owner, server_now, now)


def judge_alive(sup: ports.Liveness, owner: OwnerRow | None, server_now: float | None,
                now: float) -> bool:
    """The facts (and, for an owner on this host, whether its process exists); the decision
    is ``_core.outcome.owner_alive``. A lease is judged on the database server's clock where
    there is one (workers keep their clocks near it: Worker checks), else on ``now``, this
    host's clock read before the owner's row was (a renewal that committed after the clock
    was read is then in the row, never judged against a later time)."""
    if owner is None:
        return False
    if owner.id == sup.owner_id:
        return True
    same_host = owner.host == socket.gethostname() and owner.pid != os.getpid()
    facts = outcome.OwnerFacts(owner.heartbeat_at, owner.lease_until, same_host,
                       _pid_alive(owner.pid) if same_host and owner.lease_until is None
                       else None)
    return outcome.owner_alive(facts, now=now, server_now=server_now,
                               heartbeat_lease=sup.policy.lease)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def settle_unclaimed(sup: ports.Liveness, delegation_id: str,
                           kind: ControlKind) -> Report | None:
    """A fenced delegation no worker claimed: take it off the queue and settle it here
    (nothing ran). Whoever finds it does, so that an issuer that crashed right after its
    intent committed leaves nothing stuck. None if a worker holds it or it is not queued."""
    if not await sup.journal.unclaim(delegation_id, sup.owner_id, sup.clock.wall()):
        return None
    await settle_subtree(sup.journal, delegation_id, sup.clock, kind.settled,
                         Verdict.NEVER_STARTED, "no worker had claimed it")
    # Done, as a worker marks a task it ran: whoever awaits its result is woken (its entry
    # was marked done when it left the queue; this commit is the one that ends it).
    await sup.journal.queue_done(delegation_id, sup.clock.wall())
    await sup.journal.flush()
    return await build_report(sup.journal, delegation_id)


def _kind_of(row: DelegationRow) -> ControlKind:
    return ControlKind.RECALL if row.state is DelegationState.RECALLING \
        else ControlKind.TERMINATE


async def settle_elsewhere(sup: ports.Remote, delegation_id: str, signed: Signed) -> Report:
    """The delegation is not run by this process. Still queued: take it off the queue and
    settle it here (nothing ran). Claimed: wait for its owner to settle it, and reconcile it
    ourselves if the owner is gone or does not settle it in time."""
    intent = (await sup.current_trust()).verify(signed, ControlIntent)
    never = await settle_unclaimed(sup, delegation_id, intent.kind)
    if never is not None:
        return never
    row = await sup.journal.get(delegation_id)
    if not await owner_alive(sup, row.owner_id):
        return await sup.recover_delegation(row, "owner is gone")
    budget = drain.report_budget(intent.kind, intent.grace, sup.policy)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    settled_at: float | None = None
    while loop.time() < deadline:
        row = await sup.journal.peek(ops.get_delegation, delegation_id)
        # Drained by its owner: settled, or with calls left in doubt (the owner probes them
        # again at their deadlines); the report says which.
        drained = await sup.journal.drained(delegation_id)
        if row.state.terminal and settled_at is None:
            settled_at = loop.time()
        if drained or (settled_at is not None and drain.verdict_overdue(settled_at, loop.time(),
                                                                  sup.policy)):
            await sup.journal.flush()
            return await build_report(sup.journal, delegation_id)
        if settled_at is None and not await owner_alive(sup, row.owner_id):
            return await sup.recover_delegation(row, "owner is gone")
        await sup.wake(sup.control_poll)
    row = await sup.journal.peek(ops.get_delegation, delegation_id)
    if row.state.terminal:  # settled by its live owner: never recovered from here
        await sup.journal.flush()
        return await build_report(sup.journal, delegation_id)
    return await sup.recover_delegation(row, "owner did not settle the delegation in time")


async def wait_queued(sup: ports.Remote, queued_id: str) -> DelegationRow:
    """Wait until the task queued as ``queued_id`` has ended (in whichever worker claimed it,
    across its re-dispatched attempts) and return its last attempt. A worker that dies first
    is presumed dead when its lease runs out, and its work is reconciled here."""
    recovered: set[str] = set()  # once each: calls left in doubt are re-probed at their deadline
    # "done" once its worker marked it so: heard during a read too (the read may miss it).
    with sup.bells.listening("done") as bell:
        while True:
            now = sup.clock.wall()
            progress = await sup.journal.queue_progress(queued_id)
            entry, latest = progress.entry, progress.latest
            claimant = entry.claimed_by if entry is not None else None
            dead = claimant is not None and not judge_alive(sup, progress.claimant,
                                                            progress.server_now, now)
            if (entry is not None and entry.claimed_by is None and latest.fenced
                    and not latest.state.terminal):
                await settle_unclaimed(sup, latest.id, _kind_of(latest))
                continue
            if dead and not latest.state.terminal and latest.id not in recovered:
                recovered.add(latest.id)
                await sup.recover_delegation(latest, f"worker {claimant} lost its lease")
                latest = await sup.journal.get(latest.id)
            # Done: its worker (or the issuer of an early recall) marked it so, or nobody is left
            # to re-dispatch it.
            if latest.state.terminal and (entry is None or entry.done_at is not None or dead):
                if dead:
                    await sup.journal.queue_done(queued_id, sup.clock.wall())
                return latest
            await bell.wait(sup.control_poll)


def queued_result(row: DelegationRow) -> Any:
    """A finished queued task's result, as stored (JSON), or the questions it waits on;
    DelegationError if it did not succeed."""
    if row.state in (DelegationState.SUCCEEDED, DelegationState.SUCCEEDED_PARTIAL):
        return row.result
    if row.state is DelegationState.INTERRUPTED:
        return Interrupted.from_json(row.result)
    reason = f"{row.state.value}: {row.error or row.failure or 'stopped'}"
    raise DelegationError(row.id, row.task_id, row.attempt, reason)
