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

from tether._core.documents import ControlIntent
from tether._core.errors import DelegationError
from tether._core.model import ControlKind, DelegationState
from tether._core.report import Report
from tether._core.signing import Signed
from tether._journal import ops
from tether._journal.rows import DelegationRow, OwnerRow
from tether._runtime.reconcile import build_report, settle_subtree

if TYPE_CHECKING:
    from tether._runtime.supervisor import Supervisor


async def owner_alive(sup: Supervisor, owner_id: str) -> bool:
    """A worker is alive while its lease holds; another owner while its heartbeat is recent
    (and, on this host, while its process exists)."""
    if owner_id == sup.owner_id:
        return True
    return judge_alive(sup, *await sup.journal.liveness(owner_id))


def judge_alive(sup: Supervisor, owner: OwnerRow | None, server_now: float | None) -> bool:
    if owner is None:
        return False
    if owner.id == sup.owner_id:
        return True
    now = sup.clock.wall()
    if owner.lease_until is not None:
        # A lease is judged on the database server's clock where there is one, so that an
        # orchestrator whose clock runs ahead does not reconcile a worker still at work
        # (workers keep their clocks near the server's: Worker checks).
        return owner.lease_until > (now if server_now is None else server_now)
    if now - owner.heartbeat_at > sup.policy.lease:
        return False
    if owner.host == socket.gethostname() and owner.pid != os.getpid():
        try:
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


async def settle_elsewhere(sup: Supervisor, delegation_id: str, signed: Signed) -> Report:
    """The delegation is not run by this process. Still queued: take it off the queue and
    settle it here (nothing ran). Claimed: wait for its owner to settle it, and reconcile it
    ourselves if the owner is gone or does not settle it in time."""
    intent = sup.keys.trusted.verify(signed, ControlIntent)
    if await sup.journal.unclaim(delegation_id, sup.owner_id, sup.clock.wall()):
        final = DelegationState.RECALLED if intent.kind is ControlKind.RECALL \
            else DelegationState.TERMINATED
        await settle_subtree(sup.journal, delegation_id, sup.clock, final)
        sup.journal.event(sup.clock.wall(), "verdict", delegation_id,
                          verdict="NEVER_STARTED", reason="no worker had claimed it")
        await sup.journal.flush()
        return await build_report(sup.journal, delegation_id)
    row = await sup.journal.get(delegation_id)
    if not await owner_alive(sup, row.owner_id):
        return await sup._recover_one(row, "owner is gone")
    budget = (intent.grace or 0.0) + sup.policy.ack_timeout + sup.policy.probe_timeout
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget
    while loop.time() < deadline:
        row = await sup.journal.peek(ops.get_delegation, delegation_id)
        if row.state.terminal:
            await sup.journal.flush()
            return await build_report(sup.journal, delegation_id)
        if not await owner_alive(sup, row.owner_id):
            return await sup._recover_one(row, "owner is gone")
        await sup.wake(sup.control_poll)
    return await sup._recover_one(row, "owner did not settle the delegation in time")


async def wait_queued(sup: Supervisor, queued_id: str) -> DelegationRow:
    """Wait until the task queued as ``queued_id`` has ended (in whichever worker claimed it,
    across its re-dispatched attempts) and return its last attempt. A worker that dies first
    is presumed dead when its lease runs out, and its work is reconciled here."""
    recovered: set[str] = set()  # once each: calls left in doubt are re-probed at their deadline
    while True:
        progress = await sup.journal.queue_progress(queued_id)
        entry, latest = progress.entry, progress.latest
        claimant = entry.claimed_by if entry is not None else None
        dead = claimant is not None and not judge_alive(sup, progress.claimant, progress.server_now)
        if dead and not latest.state.terminal and latest.id not in recovered:
            recovered.add(latest.id)
            await sup._recover_one(latest, f"worker {claimant} lost its lease")
            latest = await sup.journal.get(latest.id)
        # Done: its worker (or the issuer of an early recall) marked it so, or nobody is left
        # to re-dispatch it.
        if latest.state.terminal and (entry is None or entry.done_at is not None or dead):
            if dead:
                await sup.journal.queue_done(queued_id, sup.clock.wall())
            return latest
        await sup.wake(sup.control_poll)


def queued_result(row: DelegationRow) -> Any:
    """A finished queued task's result, as stored (JSON); DelegationError if it did not
    succeed."""
    if row.state in (DelegationState.SUCCEEDED, DelegationState.SUCCEEDED_PARTIAL):
        return row.result
    reason = f"{row.state.value}: {row.error or row.failure or 'stopped'}"
    raise DelegationError(row.id, row.task_id, row.attempt, reason)
