"""The operator's reads: delegations newest first, filtered and paged, and actions by state
and age. Each is one indexed statement (schema v4), whatever the journal's size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether._core.report import ActionRecord
from tether._journal.rows import DelegationRow
from tether._journal.tables import (
    _ACTION_COLS_A,
    _ACTION_READ,
    _DELEGATION_COLS,
    Db,
    _action,
    _delegation,
)


@dataclass(frozen=True)
class DelegationQuery:
    states: tuple[str, ...] = ()  # any of these (empty: any state)
    agent: str | None = None
    since: float | None = None  # created at or after
    before: str | None = None  # a delegation id: only those created before it (the next page)
    limit: int | None = 100  # None: all


@dataclass(frozen=True)
class ActionQuery:
    states: tuple[str, ...] = ()
    started_before: float | None = None  # started at or before (in flight for at least ...)
    agent: str | None = None
    limit: int | None = 100


def page_delegations(db: Db, q: DelegationQuery) -> list[DelegationRow]:
    where: list[str] = []
    params: list[Any] = []
    if q.states:
        where.append(f"state IN ({', '.join('?' * len(q.states))})")
        params.extend(q.states)
    if q.agent is not None:
        where.append("agent = ?")
        params.append(q.agent)
    if q.since is not None:
        where.append("created_at >= ?")
        params.append(q.since)
    if q.before is not None:
        # Keyset paging: strictly older than the given row, in (created_at, id) order.
        where.append("(created_at < (SELECT created_at FROM delegations WHERE id = ?) OR "
                     "(created_at = (SELECT created_at FROM delegations WHERE id = ?) "
                     "AND id < ?))")
        params.extend((q.before, q.before, q.before))
    sql = (f"SELECT {_DELEGATION_COLS} FROM delegations"
           + (f" WHERE {' AND '.join(where)}" if where else "")
           + " ORDER BY created_at DESC, id DESC")
    if q.limit is not None:
        sql += " LIMIT ?"
        params.append(q.limit)
    return [_delegation(r) for r in db.execute(sql, params).fetchall()]


def _action_filter(q: ActionQuery) -> tuple[str, list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    if q.states:
        where.append(f"a.state IN ({', '.join('?' * len(q.states))})")
        params.extend(q.states)
    if q.started_before is not None:
        where.append("a.started_at <= ?")
        params.append(q.started_before)
    if q.agent is not None:
        where.append("d.agent = ?")
        params.append(q.agent)
    return (f" WHERE {' AND '.join(where)}" if where else ""), params


def find_actions(db: Db, q: ActionQuery) -> list[tuple[ActionRecord, str, str]]:
    """Actions oldest first (the longest stuck at the top), each with its delegation's agent
    and state."""
    cols = _ACTION_COLS_A
    where, params = _action_filter(q)
    sql = (f"SELECT {cols}, d.agent, d.state FROM actions a "
           "JOIN delegations d ON d.id = a.delegation_id" + where
           + " ORDER BY a.started_at, a.id")
    if q.limit is not None:
        sql += " LIMIT ?"
        params.append(q.limit)
    rows = db.execute(sql, params).fetchall()
    width = len(_ACTION_READ)
    return [(_action(r[:width]), r[width], r[width + 1]) for r in rows]


def count_actions(db: Db, q: ActionQuery) -> int:
    """How many actions ``q`` selects, its limit aside (what a page leaves out)."""
    where, params = _action_filter(q)
    row = db.execute("SELECT COUNT(*) FROM actions a JOIN delegations d ON "
                     "d.id = a.delegation_id" + where, params).fetchone()
    return int(row[0])


def last_event_id(db: Db) -> int:
    """The journal's newest event: it moves whenever anything is recorded (the console's
    cue to push a fresh snapshot)."""
    row = db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()
    return int(row[0])
