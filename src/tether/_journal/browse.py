"""The console's reads: delegations and actions filtered by state, agent, tool and time,
searched by id or idempotency key, and paged through everything by keyset (a page's first or
last row is the cursor), so a page costs the same at any depth. Each list is read through the
indexes of schema v5 (state, agent or creation time, then id); a search by an exact id or key
through the primary keys and ``actions_key``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tether._core.model import AWAITING, AWAITING_PROBE, DelegationState
from tether._core.report import ActionRecord
from tether._journal.rows import DelegationRow, EventRow, loads
from tether._journal.tables import (
    _ACTION_COLS_A,
    _ACTION_READ,
    _DELEGATION_COLS,
    _DELEGATION_COLS_D,
    Db,
    _action,
    _delegation,
    marks,
    values,
)

_S = DelegationState

ATTENTION = tuple(s.value for s in AWAITING)  # actions nobody settled: a probe or a person must


@dataclass(frozen=True)
class Browse:
    states: tuple[str, ...] = ()
    agent: str | None = None
    tool: str | None = None
    since: float | None = None  # created (actions: started) at or after
    until: float | None = None  # ... and before
    search: str | None = None  # a delegation id or its prefix, an action id, or a key
    older: str | None = None  # the row id a page follows (the previous page's last)
    newer: str | None = None  # the row id a page precedes (the next page's first)
    limit: int = 50
    oldest_first: bool = False


@dataclass(frozen=True)
class Page:
    rows: list[Any]
    total: int  # every row that matches, on any page
    more_older: bool
    more_newer: bool
    counts: dict[str, int] = field(default_factory=dict)  # matching rows by state


def _like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _filters(q: Browse, table: str) -> tuple[list[str], list[Any]]:
    """The WHERE terms every page, count and cursor test of one list shares."""
    d = "d" if table == "delegations" else "a"
    when = "created_at" if table == "delegations" else "started_at"
    where: list[str] = []
    params: list[Any] = []
    if q.states:
        where.append(f"{d}.state IN ({marks(q.states)})")
        params.extend(q.states)
    if q.agent:
        where.append("d.agent = ?")
        params.append(q.agent)
    if q.tool:
        if table == "delegations":
            where.append("EXISTS (SELECT 1 FROM actions t WHERE t.delegation_id = d.id "
                         "AND t.tool = ?)")
        else:
            where.append("a.tool = ?")
        params.append(q.tool)
    if q.since is not None:
        where.append(f"{d}.{when} >= ?")
        params.append(q.since)
    if q.until is not None:
        where.append(f"{d}.{when} < ?")
        params.append(q.until)
    if q.search:
        text = q.search.strip()
        if table == "delegations":
            # An exact action id or key names its delegation (by index); a delegation id may
            # be given in part (a prefix, which scans).
            where.append("(d.id = ? OR d.id LIKE ? ESCAPE '\\' OR d.id IN (SELECT "
                         "delegation_id FROM actions WHERE id = ? OR idem_key = ?))")
            params.extend((text, _like(text), text, text))
        else:
            where.append("(a.id = ? OR a.idem_key = ? OR a.delegation_id = ? "
                         "OR a.id LIKE ? ESCAPE '\\')")
            params.extend((text, text, text, _like(text)))
    return where, params


def _sql(table: str) -> tuple[str, str, str]:
    if table == "delegations":
        return (f"SELECT {_DELEGATION_COLS_D} "
                "FROM delegations d", "d", "created_at")
    cols = _ACTION_COLS_A
    return (f"SELECT {cols}, d.agent, d.state FROM actions a "
            "JOIN delegations d ON d.id = a.delegation_id", "a", "started_at")


def _cursor(alias: str, when: str, table: str, op: str) -> str:
    """Rows on one side of the cursor row in (time, id) order."""
    sub = f"(SELECT {when} FROM {table} WHERE id = ?)"
    return (f"({alias}.{when} {op} {sub} OR ({alias}.{when} = {sub} "
            f"AND {alias}.id {op} ?))")


def _page(db: Db, q: Browse, table: str) -> Page:
    select, alias, when = _sql(table)
    where, params = _filters(q, table)
    # "Forward" is the list's reading order: newest first, or oldest first (the queue).
    fwd, back = ("DESC", "ASC") if not q.oldest_first else ("ASC", "DESC")
    after_op, before_op = ("<", ">") if not q.oldest_first else (">", "<")
    cursor_id = q.older or q.newer
    going_back = q.newer is not None and q.older is None
    page_where = list(where)
    page_params = list(params)
    if cursor_id is not None:
        page_where.append(_cursor(alias, when, table, before_op if going_back else after_op))
        page_params.extend((cursor_id, cursor_id, cursor_id))
    order = back if going_back else fwd
    sql = (select + (f" WHERE {' AND '.join(page_where)}" if page_where else "")
           + f" ORDER BY {alias}.{when} {order}, {alias}.id {order} LIMIT ?")
    raw = db.execute(sql, [*page_params, q.limit + 1]).fetchall()
    beyond = len(raw) > q.limit
    raw = raw[:q.limit]
    if going_back:
        raw.reverse()
    rows: list[Any] = [_delegation(r) for r in raw] if table == "delegations" \
        else _actions(raw)
    count_from = "delegations d" if table == "delegations" else \
        "actions a JOIN delegations d ON d.id = a.delegation_id"
    cond = f" WHERE {' AND '.join(where)}" if where else ""
    counts = {str(s): int(n) for s, n in db.execute(
        f"SELECT {alias}.state, COUNT(*) FROM {count_from}{cond} GROUP BY {alias}.state",
        params).fetchall()}
    if going_back:
        more_newer, more_older = beyond, cursor_id is not None
    else:
        more_older, more_newer = beyond, cursor_id is not None
    if rows and cursor_id is not None:
        # Whether anything lies beyond the page's other edge (a cursor row may have gone).
        edge = row_id(rows[-1] if going_back else rows[0])
        op = after_op if going_back else before_op
        probe = db.execute(
            f"SELECT 1 FROM {count_from} WHERE "
            + " AND ".join([*where, _cursor(alias, when, table, op)]) + " LIMIT 1",
            [*params, edge, edge, edge]).fetchone()
        if going_back:
            more_older = probe is not None
        else:
            more_newer = probe is not None
    return Page(rows, sum(counts.values()), more_older, more_newer, counts)


def row_id(row: DelegationRow | tuple[ActionRecord, str, str]) -> str:
    """A page row's id: its cursor."""
    return row[0].id if isinstance(row, tuple) else row.id


def _actions(raw: list[Any]) -> list[tuple[ActionRecord, str, str]]:
    width = len(_ACTION_READ)
    return [(_action(r[:width]), r[width], r[width + 1]) for r in raw]


def delegations(db: Db, q: Browse) -> Page:
    """Delegations newest first; rows are ``DelegationRow``."""
    return _page(db, q, "delegations")


def actions(db: Db, q: Browse) -> Page:
    """Actions (newest first, or oldest first for the queue); rows are (action, its
    delegation's agent, its delegation's state)."""
    return _page(db, q, "actions")


# Held for a person for another reason than a call of its own a probe may still settle.
_NONE_AWAITING = ("NOT EXISTS (SELECT 1 FROM actions a WHERE a.delegation_id = d.id AND "
                  f"a.state IN ({marks(AWAITING_PROBE)}))")


def attention_delegations(db: Db, limit: int) -> list[tuple[DelegationRow, str | None]]:
    """NEEDS_ATTENTION delegations none of whose own actions is in doubt or unknown (a
    receipt that contradicts a decision or a final outcome put them there), oldest first,
    each with the newest reason the journal gave."""
    cols = _DELEGATION_COLS_D
    rows = db.execute(
        f"SELECT {cols} FROM delegations d WHERE d.state = ? AND {_NONE_AWAITING} "
        "ORDER BY d.created_at, d.id LIMIT ?",
        (_S.NEEDS_ATTENTION.value, *values(AWAITING_PROBE), limit)).fetchall()
    found = []
    for r in rows:
        row = _delegation(r)
        why = db.execute("SELECT detail FROM events WHERE delegation_id = ? AND kind = "
                         "'resettled' ORDER BY id DESC LIMIT 1", (row.id,)).fetchone()
        found.append((row, None if why is None else str(loads(why[0]).get("why", ""))))
    return found


def lineage(db: Db, delegation_id: str) -> list[DelegationRow]:
    """The delegation's ancestors, its root first (bounded, as ``SUBTREE`` is)."""
    chain: list[DelegationRow] = []
    seen = {delegation_id}
    row = db.execute("SELECT parent_id FROM delegations WHERE id = ?",
                     (delegation_id,)).fetchone()
    parent = None if row is None else row[0]
    while parent is not None and parent not in seen and len(chain) < 1000:
        seen.add(parent)
        found = db.execute(f"SELECT {_DELEGATION_COLS} FROM delegations WHERE id = ?",
                           (parent,)).fetchone()
        if found is None:
            break
        chain.append(_delegation(found))
        parent = chain[-1].parent_id
    chain.reverse()
    return chain


def action_events(db: Db, action_ids: list[str]) -> list[EventRow]:
    """The events of these actions (a probe's answer, a person's decision), oldest first."""
    if not action_ids:
        return []
    rows = db.execute(
        "SELECT id, delegation_id, action_id, at, kind, detail FROM events WHERE action_id IN "
        f"({marks(action_ids)}) ORDER BY id", action_ids).fetchall()
    return [EventRow(r[0], r[1], r[2], r[3], r[4], loads(r[5])) for r in rows]


def action_counts(db: Db, delegation_ids: list[str]) -> dict[str, dict[str, int]]:
    """Each delegation's calls by state (one page's worth of delegations at a time)."""
    if not delegation_ids:
        return {}
    found: dict[str, dict[str, int]] = {}
    for d, state, n in db.execute(
            "SELECT delegation_id, state, COUNT(*) FROM actions WHERE delegation_id IN "
            f"({marks(delegation_ids)}) GROUP BY delegation_id, state",
            delegation_ids).fetchall():
        found.setdefault(str(d), {})[str(state)] = int(n)
    return found


def locate(db: Db, text: str) -> str | None:
    """The delegation an exact delegation id, action id or idempotency key names."""
    text = text.strip()
    if db.execute("SELECT 1 FROM delegations WHERE id = ?", (text,)).fetchone():
        return text
    row = db.execute("SELECT delegation_id FROM actions WHERE id = ? OR idem_key = ? "
                     "ORDER BY started_at DESC LIMIT 1", (text, text)).fetchone()
    return None if row is None else str(row[0])


def attention_count(db: Db) -> int:
    """What the queue holds: calls nobody settled, and delegations held for a person for
    another reason (read through ``actions_state_started`` and ``delegations_state``)."""
    calls = db.execute(f"SELECT COUNT(*) FROM actions WHERE state IN ({marks(AWAITING_PROBE)})",
                       values(AWAITING_PROBE)).fetchone()[0]
    held = db.execute(
        f"SELECT COUNT(*) FROM delegations d WHERE d.state = ? AND {_NONE_AWAITING}",
        (_S.NEEDS_ATTENTION.value, *values(AWAITING_PROBE))).fetchone()[0]
    return int(calls) + int(held)
