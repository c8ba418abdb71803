"""Journal operations for work that runs in worker processes: the queue, leases and claims.

A delegation made with ``remote=True`` is inserted with a queue row in the same transaction.
A worker claims it (``SKIP LOCKED`` on PostgreSQL, so workers never wait on each other's
claims) only while its own lease holds and the delegation is not fenced; a recall that lands
first leaves the row unclaimed, and its issuer takes it off the queue and settles it.
"""

from __future__ import annotations

from typing import Any

from tether._core.columns import CONTROLS, OWNERS
from tether._core.model import DelegationState
from tether._journal.rows import (
    ControlRow,
    DelegationRow,
    OwnerRow,
    QueueEntry,
    QueueProgress,
    loads,
)
from tether._journal.tables import (
    _DELEGATION_COLS,
    _DELEGATION_COLS_D,
    SUBTREE,
    Conn,
    Db,
    _control,
    _delegation,
    before,
    event,
    get_delegation,
    touch,
)


def renew_lease(db: Db, owner_id: str, now: float, lease: float) -> bool:
    """Extend a worker's lease, only if it has not run out: a lease that expired stays
    expired, since others may already have presumed the worker dead and reconciled its work."""
    cur = db.execute(
        "UPDATE owners SET lease_until = ?, heartbeat_at = ? "
        "WHERE id = ? AND (lease_until IS NULL OR lease_until > ?)",
        (now + lease, now, owner_id, now),
    )
    if cur.rowcount != 1:
        event(db, now, "lease_lost", None, None, owner=owner_id)
    return cur.rowcount == 1


_OWNER = f"SELECT {OWNERS.select()} FROM owners WHERE id = ?"


def owner(db: Db, owner_id: str) -> OwnerRow | None:
    """One owner, for the liveness check made on every poll (the table only grows)."""
    row = db.execute(_OWNER, (owner_id,)).fetchone()
    return None if row is None else OwnerRow(*row)


def server_time(db: Conn) -> float | None:
    """The database server's clock on PostgreSQL, shared by every host; None on SQLite, whose
    processes share the host's clock."""
    return db.server_time()


def liveness(db: Conn, owner_id: str) -> tuple[OwnerRow | None, float | None]:
    """An owner's row and the server's clock, read together to judge whether it is alive.
    The clock first: at READ COMMITTED (PostgreSQL) the row is then at least as new as the
    clock's reading, so a renewal that committed between the two is seen (read the other way
    round, a lease renewed just before it expired reads as expired)."""
    now = server_time(db)
    return owner(db, owner_id), now


# The queue row is not chained: an intruder can clear its ``claimed_by``. The claim's event is
# (a deleted one fails the delegation's chain, and workers refuse to run it), so a delegation
# once claimed is never claimed again, nor taken off the queue as never started.
def _never_claimed(queue: str) -> str:
    return (f"NOT EXISTS (SELECT 1 FROM events e WHERE e.delegation_id = {queue}.delegation_id "
            "AND e.kind = 'claimed')")


def claim(db: Db, owner_id: str, agents: tuple[str, ...], now: float,
          limit: int) -> list[DelegationRow]:
    """Take up to ``limit`` queued delegations of these agents, oldest first."""
    if not agents or limit <= 0:
        return []
    marks = ", ".join("?" * len(agents))
    rows = db.execute(
        "SELECT q.delegation_id FROM queue q JOIN delegations d ON d.id = q.delegation_id "
        f"WHERE q.claimed_by IS NULL AND d.fenced = 0 AND q.agent IN ({marks}) "
        f"AND {_never_claimed('q')} "
        "AND EXISTS (SELECT 1 FROM owners o WHERE o.id = ? AND o.lease_until > ?) "
        "ORDER BY q.enqueued_at, q.delegation_id LIMIT ? /*SKIP q*/",
        (*agents, owner_id, now, limit),
    ).fetchall()
    claimed = []
    for (delegation_id,) in rows:
        # Re-checked by the update itself: a recall that committed meanwhile wins.
        before(db, "delegations", delegation_id)
        cur = db.execute(
            "UPDATE delegations SET owner_id = ?, updated_at = ? WHERE id = ? AND fenced = 0",
            (owner_id, now, delegation_id),
        )
        if cur.rowcount != 1:
            continue
        touch(db, "delegations", delegation_id)
        db.execute("UPDATE queue SET claimed_by = ?, claimed_at = ? WHERE delegation_id = ?",
                   (owner_id, now, delegation_id))
        event(db, now, "claimed", delegation_id, None, worker=owner_id)
        claimed.append(get_delegation(db, delegation_id))
    return claimed


def unclaim(db: Db, delegation_id: str, owner_id: str, now: float) -> bool:
    """Take a fenced delegation off the queue if no worker claimed it: the caller (``owner_id``)
    settles it, and the row stays as the record that it was queued. False when a worker holds
    it (that worker drains it) or it was never queued."""
    cur = db.execute(
        "UPDATE queue SET claimed_by = ?, claimed_at = ?, done_at = ? "
        f"WHERE delegation_id = ? AND claimed_by IS NULL AND {_never_claimed('queue')} AND EXISTS "
        "(SELECT 1 FROM delegations d WHERE d.id = queue.delegation_id AND d.fenced = 1)",
        (owner_id, now, now, delegation_id),
    )
    if cur.rowcount == 1:
        event(db, now, "dequeued", delegation_id, None, by=owner_id)
    return cur.rowcount == 1


def queue_entry(db: Db, delegation_id: str) -> QueueEntry | None:
    row = db.execute(
        "SELECT delegation_id, task_id, agent, enqueued_at, claimed_by, claimed_at, done_at "
        "FROM queue WHERE delegation_id = ?",
        (delegation_id,),
    ).fetchone()
    return None if row is None else QueueEntry(*row)


def queue_done(db: Conn, delegation_id: str, now: float) -> None:
    """The task behind this queue row has ended and been accounted for."""
    db.execute("UPDATE queue SET done_at = COALESCE(done_at, ?) WHERE delegation_id = ?",
               (now, delegation_id))
    db.notify("done")  # wakes an orchestrator waiting on the task


def latest_attempt(db: Db, delegation_id: str) -> DelegationRow:
    """The newest attempt of the task at this delegation's epoch (a re-dispatch forks one)."""
    first = get_delegation(db, delegation_id)
    parent = "parent_id IS NULL" if first.parent_id is None else "parent_id = ?"
    row = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations WHERE task_id = ? AND epoch = ? "
        f"AND {parent} ORDER BY attempt DESC, created_at DESC LIMIT 1",
        (first.task_id, first.epoch, *([first.parent_id] if first.parent_id else [])),
    ).fetchone()
    return first if row is None else _delegation(row)


def task_head(db: Db, task_id: str) -> DelegationRow | None:
    """The task's delegation at its newest epoch, newest attempt first (a root's, or a
    child's: a Temporal child workflow's task); None for a task the journal does not know (an
    engine that names its own work, Temporal's workflow ids, finds the delegation it runs
    under by task)."""
    row = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations WHERE task_id = ? "
        "ORDER BY epoch DESC, attempt DESC, created_at DESC LIMIT 1", (task_id,),
    ).fetchone()
    return None if row is None else _delegation(row)


def task_delegations(db: Db, task_id: str) -> list[DelegationRow]:
    """Every delegation of a task, oldest epoch first (a Temporal run's task: whether any
    epoch of one run was stopped)."""
    rows = db.execute(
        f"SELECT {_DELEGATION_COLS} FROM delegations WHERE task_id = ? "
        "ORDER BY epoch, attempt, created_at", (task_id,),
    ).fetchall()
    return [_delegation(r) for r in rows]


def noted_in_trees(db: Db, root_ids: list[str], kind: str
                   ) -> list[tuple[DelegationRow, dict[str, Any]]]:
    """The events of ``kind`` on the delegations of these subtrees, oldest first, each with
    the delegation it is on (a Temporal run's children apart, noted on the nearest ancestor's
    delegation before each opened)."""
    found: list[tuple[DelegationRow, dict[str, Any]]] = []
    for root in root_ids:
        rows = db.execute(
            f"{SUBTREE} SELECT {_DELEGATION_COLS_D}, e.detail FROM events e "
            "JOIN sub ON e.delegation_id = sub.id JOIN delegations d ON d.id = sub.id "
            "WHERE e.kind = ? ORDER BY e.id", (root, kind)).fetchall()
        for r in rows:
            detail = loads(r[-1])
            found.append((_delegation(r[:-1]), detail if isinstance(detail, dict) else {}))
    return found


def progress(db: Conn, delegation_id: str) -> QueueProgress:
    """The queue row, the task's newest attempt and the claimant's lease: one read per poll
    (the server's clock first, as for ``liveness``)."""
    now = server_time(db)
    entry = queue_entry(db, delegation_id)
    claimant = None if entry is None or entry.claimed_by is None else owner(db, entry.claimed_by)
    return QueueProgress(entry, latest_attempt(db, delegation_id), claimant, now)


def controls_for_owner(db: Db, owner_id: str) -> list[ControlRow]:
    """The latest intent of each of this owner's delegations that is being recalled or
    terminated. Unlike "every intent after id N", this cannot miss an intent whose id was
    assigned before, but committed after, one already seen (PostgreSQL assigns ids at insert)."""
    cols = CONTROLS.select(alias="c")
    rows = db.execute(
        f"SELECT {cols} FROM delegations d JOIN controls c ON c.delegation_id = d.id "
        "AND c.seq = d.control_seq WHERE d.owner_id = ? AND d.state IN (?, ?) ORDER BY c.id",
        (owner_id, DelegationState.RECALLING.value, DelegationState.TERMINATING.value),
    ).fetchall()
    return [_control(r) for r in rows]
