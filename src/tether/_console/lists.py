"""The lists: delegations and actions, filtered by state, agent, tool and time, searched by id
or idempotency key, paged through everything (``_journal.browse``). The filters live in the
address (a list can be bookmarked, and the back button walks the pages)."""

from __future__ import annotations

import calendar
import re
import time
from urllib.parse import quote

from tether._console.html import (
    badge,
    brief,
    d_href,
    e,
    href,
    ident,
    link,
    problem,
    table,
    when,
)
from tether._core.model import ActionState, DelegationState
from tether._journal import browse
from tether._journal.journal import Journal

PER_PAGE = 50
FILTERS = ("state", "agent", "tool", "since", "until", "q")
_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def moment(text: str, now: float, what: str) -> float | None:
    """A time filter: an age ("15m", "2h", "7d": that long ago) or a UTC date and time
    ("2025-01-31", "2025-01-31 14:00")."""
    text = text.strip()
    if not text:
        return None
    span = _SPAN.match(text)
    if span:
        return now - float(span[1]) * _UNIT[span[2]]
    for fmt in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(text.replace("T", " ").rstrip("Z"),
                                                       fmt)))
        except ValueError:
            continue
    raise ValueError(f"{what} {text!r} is neither an age (15m, 2h, 7d) nor a UTC time "
                     "(2025-01-31 14:00)")


def query(params: dict[str, str], now: float, states: tuple[str, ...]) -> browse.Browse:
    state = params.get("state", "").strip().upper()
    if state and state not in states:
        raise ValueError(f"state {state!r} is none of {', '.join(states)}")
    return browse.Browse(
        states=(state,) if state else (), agent=params.get("agent", "").strip() or None,
        tool=params.get("tool", "").strip() or None,
        since=moment(params.get("since", ""), now, "since"),
        until=moment(params.get("until", ""), now, "until"),
        search=params.get("q", "").strip() or None,
        older=params.get("older") or None, newer=params.get("newer") or None,
        limit=PER_PAGE)


def filters(path: str, params: dict[str, str], states: tuple[str, ...], tools: bool) -> str:
    """The filter bar: a plain GET form, which the page's script turns into an address."""
    chosen = params.get("state", "").upper()
    options = '<option value="">any state</option>' + "".join(
        f'<option value="{s}"{" selected" if s == chosen else ""}>{s}</option>'
        for s in states)

    def field(name: str, label: str, hint: str, cls: str = "") -> str:
        return (f'<label class="{cls}">{label} <input type="text" name="{name}" '
                f'value="{e(params.get(name, ""))}" placeholder="{e(hint)}" '
                f'autocomplete="off" data-testid="filter-{name}"></label>')

    clear = f' <a href="{e(path)}" class="clear">clear</a>' if any(
        params.get(k) for k in FILTERS) else ""
    return (
        f'<form class="filters" data-nav="{e(path)}" data-testid="filters">'
        f'<label>State <select name="state" data-testid="filter-state">{options}</select>'
        "</label>"
        + field("agent", "Agent", "exact name")
        + (field("tool", "Tool", "exact name") if tools else "")
        + field("since", "From", "15m, 7d, 2025-01-31 14:00", "time")
        + field("until", "Until", "an age, or a UTC time", "time")
        + field("q", "Id or key", "delegation or action id, or key", "search")
        + f'<button type="submit" data-testid="filter-apply">Filter</button>{clear}</form>')


def pager(page: browse.Page, path: str, params: dict[str, str]) -> str:
    kept = {k: params.get(k) for k in FILTERS}
    links = []
    if page.more_newer and page.rows:
        first = browse.row_id(page.rows[0])
        links.append(f'<a href="{href(path, **kept)}" data-testid="page-first">first</a>')
        links.append(f'<a href="{href(path, **kept, newer=first)}" rel="prev" '
                     f'data-testid="page-prev">previous</a>')
    if page.more_older and page.rows:
        last = browse.row_id(page.rows[-1])
        links.append(f'<a href="{href(path, **kept, older=last)}" rel="next" '
                     f'data-testid="page-next">next</a>')
    shown = f"{len(page.rows)} shown of {page.total}"
    return f'<nav class="pager" data-testid="pager"><span>{shown}</span>{"".join(links)}</nav>'


def _counts(page: browse.Page) -> str:
    if not page.counts:
        return ""
    return '<p class="summary">' + " · ".join(
        f"{badge(s)} {n}" for s, n in sorted(page.counts.items())) + "</p>"


D_STATES = tuple(s.value for s in DelegationState)
A_STATES = tuple(s.value for s in ActionState)


async def delegations(journal: Journal, params: dict[str, str], now: float) -> str:
    head = '<h1>Delegations</h1>'
    try:
        q = query(params, now, D_STATES)
    except ValueError as exc:
        return head + filters("/delegations", params, D_STATES, True) + problem(str(exc))
    if q.search and not any(params.get(k) for k in ("state", "agent", "tool", "since",
                                                    "until", "older", "newer")):
        found = await journal.peek(browse.locate, q.search)
        if found is not None:  # an exact id or key: straight to its delegation
            return f'<div data-redirect="{d_href(found)}"></div>'
    page = await journal.peek(browse.delegations, q)
    ids = [d.id for d in page.rows]
    calls = await journal.peek(browse.action_counts, ids)
    rows = [[link(d.id), e(d.agent), badge(d.state.value),
             link(d.parent_id) if d.parent_id else '<span class="muted">root</span>',
             _calls(calls.get(d.id, {})), when(d.created_at, now),
             when(d.ended_at, now) if d.ended_at else '<span class="muted">running</span>'
             if not d.state.terminal else ""]
            for d in page.rows]
    body = table(["delegation", "agent", "state", "parent", "calls", "created", "ended"], rows,
                 "list", "delegations")
    return (head + filters("/delegations", params, D_STATES, True) + _counts(page) + body
            + pager(page, "/delegations", params))


def _calls(by_state: dict[str, int]) -> str:
    if not by_state:
        return '<span class="muted">0</span>'
    total = sum(by_state.values())
    loud = [f"{badge(s)} {n}" for s, n in by_state.items() if s in ("UNKNOWN", "IN_DOUBT",
                                                                     "PENDING", "FAILED")]
    return f"{total}" + (" (" + ", ".join(loud) + ")" if loud else "")


async def actions(journal: Journal, params: dict[str, str], now: float) -> str:
    head = '<h1>Actions</h1>'
    try:
        q = query(params, now, A_STATES)
    except ValueError as exc:
        return head + filters("/actions", params, A_STATES, True) + problem(str(exc))
    page = await journal.peek(browse.actions, q)
    rows = [[f'<a class="id" href="{d_href(a.delegation_id)}#{e(quote(a.id, safe=""))}">'
             f'{e(a.id)}</a><br>'
             f'<span class="muted">in</span> {link(a.delegation_id)}',
             f"<b>{e(a.tool)}</b>", badge(a.state.value), brief(a.args),
             f'<span class="err">{e(a.error)}</span>' if a.error and a.result is None
             else brief(a.result), ident(a.idempotency_key, "key"), e(agent),
             when(a.started_at, now)]
            for a, agent, _ in page.rows]
    body = table(["action / delegation", "tool", "state", "arguments", "result",
                  "idempotency key", "agent", "started"], rows, "list", "actions")
    return (head + filters("/actions", params, A_STATES, True) + _counts(page) + body
            + pager(page, "/actions", params))
