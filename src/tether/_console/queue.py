"""The landing view: what needs a person, oldest first. Each call nobody could settle is shown
whole (its arguments, result, key, the probe's evidence and why it is a person's to decide)
with the form to record what happened; below it, delegations held for another reason (a
receipt that contradicts a decision)."""

from __future__ import annotations

from tether._console.forms import resolve_form
from tether._console.html import badge, e, href, ident, link, value, when
from tether._console.lists import pager
from tether._core.report import ActionRecord
from tether._journal import browse
from tether._journal.journal import Journal

PER_PAGE = 20
HELD = 50  # delegations held for another reason, shown below the calls


def why(a: ActionRecord) -> str:
    """Why this call is in front of a person, in the words an operator acts on."""
    ev = a.evidence or {}
    if a.state.value == "IN_DOUBT":
        return ("Its outcome is not known and no probe has answered yet: <code>tether "
                "reconcile</code> asks the tool's probe; if it cannot tell either, decide here.")
    said = ev.get("reason") or ev.get("error") or ""
    base = ("The probe could not tell whether this call applied, so nobody may assume either "
            "way: check with the provider (by its idempotency key) and record what happened.")
    if "no probe" in str(said):
        base = ("Its tool has no probe, so tether cannot ask the provider: check with the "
                "provider (by its idempotency key) and record what happened.")
    return base + (f' <span class="said">The probe said: {e(said)}</span>' if said else "")


def item(a: ActionRecord, agent: str, d_state: str, now: float, tolerance: float) -> str:
    aid = e(a.id)
    result = value(a.result, "no result recorded")
    if a.error:
        result += f'<p class="err">error: {e(a.error)}</p>'
    late = ' <span class="badge s-FAILED">late receipt</span>' if a.late else ""
    return (
        f'<article class="item st-{e(a.state.value)}" data-testid="item-{aid}" id="{aid}">'
        f'<header>{badge(a.state.value)}{late} <b class="tool">{e(a.tool)}</b> '
        f'<span class="muted">{e(a.effect.value)}</span> {ident(a.id)}'
        f'<span class="grow"></span>started {when(a.started_at, now)}</header>'
        f'<p class="where">in {link(a.delegation_id)} · agent <b>{e(agent)}</b> · '
        f'delegation {badge(d_state)}</p>'
        f'<p class="why"><b>Why a person:</b> {why(a)}</p>'
        '<div class="facts">'
        f'<section><h3>Arguments</h3>{value(a.args)}</section>'
        f'<section><h3>Result</h3>{result}</section>'
        f'<section><h3>Evidence</h3>{value(a.evidence, "no probe has answered")}</section>'
        "</div>"
        f'<p class="key">Idempotency key {ident(a.idempotency_key)}</p>'
        f"{resolve_form(a, now, tolerance)}</article>")


async def render(journal: Journal, params: dict[str, str], now: float) -> str:
    q = browse.Browse(states=browse.ATTENTION, oldest_first=True, limit=PER_PAGE,
                      older=params.get("older") or None, newer=params.get("newer") or None)
    page = await journal.peek(browse.actions, q)
    held = await journal.peek(browse.attention_delegations, HELD)
    total = await journal.peek(browse.attention_count)
    counts = " · ".join(f"{badge(s)} {page.counts.get(s, 0)}" for s in browse.ATTENTION)
    head = (f'<h1>Needs attention <span class="count" id="attention-count" '
            f'data-testid="attention-count">{total}</span></h1>'
            f'<p class="summary">{counts} · {total - page.total} delegation(s) held for '
            "another reason · oldest first</p>")
    if not page.rows and not held:
        return head + ('<p class="empty" data-testid="queue-empty">Nothing needs a person: '
                       "every call the journal holds is settled or still running.</p>")
    items = "".join(item(a, agent, st, now, journal.clock_tolerance)
                    for a, agent, st in page.rows)
    out = head + f'<div class="queue" data-testid="queue">{items}</div>'
    out += pager(page, "/", {})
    if held:
        out += "<h2>Delegations held for a person</h2>" + "".join(
            f'<p class="held">{link(d.id)} {badge(d.state.value)} agent <b>{e(d.agent)}</b> '
            f"· {e(reason or 'see its page')} · since {when(d.updated_at, now)}</p>"
            for d, reason in held)
        more = total - page.total - len(held)
        if more > 0:  # never a list that silently stops: the rest are one link away
            out += (f'<p class="held muted" data-testid="held-more">and {more} more, not shown '
                    f'here: <a href="{href("/delegations", state="NEEDS_ATTENTION")}">every '
                    "delegation held NEEDS_ATTENTION</a></p>")
    return out


__all__ = ["render", "why"]
