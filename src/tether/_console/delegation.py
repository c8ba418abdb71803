"""A delegation's own page (``/d/<id>``): what it is, where it sits in its tree, every call of
its subtree with arguments, result, key, state and evidence, its signed intents and the
decisions people recorded, its timeline, and whether its records verify against their signed
chain. Built from what ``tether show`` reads (``collect``), so the two never disagree."""

from __future__ import annotations

from typing import Any

from tether._console.forms import DECIDABLE, resolve_form, stop_form
from tether._console.html import (
    badge,
    brief,
    e,
    ident,
    link,
    table,
    utc,
    value,
    when,
)
from tether._console.queue import why
from tether._core.report import ActionRecord
from tether._journal import browse
from tether._journal.rows import DelegationRow

_SKIP = ("probed_at", "asked_at")  # repeated in the timeline's own time column


def summary(d: dict[str, Any], now: float) -> str:
    rows = [("agent", f"<b>{e(d['agent'])}</b>"), ("task", ident(d["task"])),
            ("epoch / attempt", f"{e(d['epoch'])} / {e(d['attempt'])}"),
            ("owner", ident(d["owner"])),
            ("created", f"{when(d['created_at'], now)} <span class=\"muted\">"
                        f"{e(utc(d['created_at']))}</span>"),
            ("ended", when(d["ended_at"], now) if d["ended_at"] else
             '<span class="muted">not yet</span>'),
            ("fence", "closed (no new calls)" if d["fenced"] else "open"),
            ("control sequence", e(d["control_seq"])),
            ("tools", ", ".join(e(t) for t in d["surface"]) or '<span class="muted">none'
                                                                '</span>')]
    if d.get("model"):
        rows.append(("model", e(d["model"])))
    if d.get("trace_id"):
        rows.append(("trace", ident(d["trace_id"])))
    rows.append(("arguments", value(d.get("args"))))
    rows.append(("result", value(d.get("result"), "none")))
    for k in ("error", "failure"):
        if d.get(k):
            rows.append((k, f'<span class="err">{e(d[k])}</span>'))
    cells = "".join(f"<dt>{e(k)}</dt><dd>{v}</dd>" for k, v in rows)
    return f'<dl class="kv summary-list" data-testid="summary">{cells}</dl>'


def tree(me: str, ancestors: list[DelegationRow], sub: list[dict[str, Any]]) -> str:
    """Its ancestors, root first, then its subtree nested under it."""
    crumbs = "".join(f"<li>{link(a.id)} <b>{e(a.agent)}</b> {badge(a.state.value)}</li>"
                     for a in ancestors)
    kids: dict[str | None, list[dict[str, Any]]] = {}
    for d in sub:
        kids.setdefault(d["parent"], []).append(d)

    def node(d: dict[str, Any], depth: int) -> str:
        label = (f'<b class="here">{e(d["id"])}</b>' if d["id"] == me else link(d["id"]))
        below = "".join(node(c, depth + 1) for c in kids.get(d["id"], [])) if depth < 50 else ""
        return (f'<li data-testid="node-{e(d["id"])}">{label} <b>{e(d["agent"])}</b> '
                f'{badge(d["state"])}' + (f"<ul>{below}</ul>" if below else "") + "</li>")

    root = next((d for d in sub if d["id"] == me), None)
    inner = node(root, 0) if root else ""
    return (f'<ul class="tree" data-testid="tree">{crumbs}' if crumbs else
            '<ul class="tree" data-testid="tree">') + \
        (f"<li><ul>{inner}</ul></li>" if crumbs else inner) + "</ul>"


def action_card(a: dict[str, Any], me: str, now: float, tolerance: float) -> str:
    rec = _record(a)
    aid = e(a["id"])
    result = value(a["result"], "no result recorded")
    if a.get("error"):
        result += f'<p class="err">error: {e(a["error"])}</p>'
    flags = "".join(f' <span class="badge s-FAILED">{e(t)}</span>' for t in (
        ["late receipt"] if a.get("late") else []) + (
        [f"TAMPERED ({a['tampered']})"] if a.get("tampered") else []))
    where = "" if a["delegation"] == me else f" in {link(a['delegation'])}"
    decide = ""
    if a["state"] in DECIDABLE:
        decide = (f'<p class="why"><b>Why a person:</b> {why(rec)}</p>'
                  + resolve_form(rec, now, tolerance))
    return (
        f'<article class="item st-{e(a["state"])}" data-testid="action-{aid}" id="{aid}">'
        f'<header>{badge(a["state"])}{flags} <b class="tool">{e(a["tool"])}</b> '
        f'<span class="muted">{e(a["effect"])}</span> {ident(a["id"])}{where}'
        f'<span class="grow"></span>started {when(a["started_at"], now)}'
        + (f" · ended {when(a['ended_at'], now)}" if a.get("ended_at") else "") + "</header>"
        '<div class="facts">'
        f'<section><h3>Arguments</h3>{value(a["args"])}</section>'
        f'<section><h3>Result</h3>{result}</section>'
        f'<section><h3>Evidence</h3>{value(a["evidence"], "none")}</section></div>'
        f'<p class="key">Idempotency key {ident(a["idempotency_key"])}</p>{decide}</article>')


def _record(a: dict[str, Any]) -> ActionRecord:
    from tether._core.model import ActionState, Effect

    return ActionRecord(
        id=a["id"], delegation_id=a["delegation"], ordinal=a["ordinal"], tool=a["tool"],
        effect=Effect(a["effect"]), args=a["args"], idempotency_key=a["idempotency_key"],
        state=ActionState(a["state"]), result=a["result"], error=a["error"],
        evidence=a["evidence"], late=a["late"], started_at=a["started_at"],
        ended_at=a["ended_at"], deadline_at=a["deadline_at"])


def _who(intent: dict[str, Any]) -> str:
    """Who asked: the name signed into the document; the journal's issuer column (which no
    signature covers) only where none is, and said to be so."""
    body = intent["body"]
    signed = body.get("by") if body.get("type") == "control" else body.get("operator")
    if isinstance(signed, str) and signed:
        if intent["verified"] != "ok":  # the document says so, but no trusted key signed it
            return f'<span class="muted">claims {e(signed)} (signature refused)</span>'
        return e(signed)
    if body.get("type") != "control":  # an acknowledgement or receipt: the child's own
        return '<span class="muted">the child</span>'
    if body.get("recovery") is True and intent["verified"] == "ok":
        return '<span class="muted">tether (a recovery: its owner was gone)</span>'
    return f'<span class="muted">issued by {e(intent["issuer"])} (not signed)</span>'


def _decided(x: dict[str, Any]) -> str:
    """A decision's move, flagged where no verified resolution document says the same."""
    if x["kind"] != "resolved":
        return f"CONTRADICTED by {badge(x['new'])}"
    moved = f"{badge(x['old'])} &rarr; {badge(x['outcome'])}"
    if x.get("signed", "ok") != "ok":
        moved += f' <span class="badge s-FAILED" title="{e(x["signed"])}">UNSIGNED</span>'
    return moved


def _verified(v: str) -> str:
    if v == "ok":
        return '<span class="badge s-COMPLETED">verified</span>'
    return f'<span class="badge s-FAILED">{e(v)}</span>'


def chain_status(data: dict[str, Any]) -> str:
    chain = str(data.get("chain", ""))
    if chain == "ok":
        text = ('<span class="badge s-COMPLETED">chain verified</span> every record of this '
                "subtree matches its signed chain")
    elif chain == "TAMPERED":
        problems = "".join(f"<li>{ident(t['delegation'])} {e(t['record'])}: {e(t['problem'])}"
                           "</li>" for t in data.get("tampered", []))
        text = (f'<span class="badge s-FAILED">chain TAMPERED</span> records that fail their '
                f"signed chain (run <code>tether verify</code>):<ul>{problems}</ul>")
    else:
        text = f'<span class="badge s-PENDING">{e(chain)}</span>'
    return f'<div class="chain" data-testid="chain">{text}</div>'


def render(data: dict[str, Any], me: str, ancestors: list[DelegationRow], now: float,
           tolerance: float, live: DelegationRow) -> str:
    d = next(x for x in data["delegations"] if x["id"] == me)
    acts = data["actions"]
    open_ = [a for a in acts if a["state"] in DECIDABLE]
    head = (f'<h1>Delegation {ident(me)} {badge(d["state"])}</h1>'
            f'<p class="summary">{len(data["delegations"])} delegation(s) in its subtree · '
            f'{len(acts)} call(s), {len(open_)} for a person</p>')
    stop = "" if live.state.terminal else stop_form(live)
    intents = table(
        ["delegation", "seq", "kind", "signature", "key", "by", "at", "reason or note"],
        [[ident(i["delegation"]), e(i["seq"]), f"<b>{e(i['kind'])}</b>",
          _verified(i["verified"]), ident(i["key_id"]), _who(i),
          when(i["accepted_at"], now),
          e(i["body"].get("reason") or i["body"].get("note") or "")]
         for i in data["intents"]], "list", "intents")
    decisions = table(
        ["at", "action", "decision", "by", "key", "note"],
        [[when(x["at"], now), ident(x["action"]),
          _decided(x), e(x.get("operator") or ""),
          ident(x.get("key_id") or ""), e(x.get("note") or "")]
         for x in data["decisions"]], "list", "decisions")
    events = table(
        ["at", "delegation or action", "event", "detail"],
        [[f'<span class="stamp">{e(utc(x["at"], ms=True))}</span>',
          ident(x["action"] or x["delegation"] or ""), f"<b>{e(x['kind'])}</b>"
          + (' <span class="badge s-FAILED">TAMPERED</span>' if x.get("tampered") else ""),
          brief({k: v for k, v in x["detail"].items() if k not in _SKIP}, 240)]
         for x in data["events"]], "list timeline", "timeline")
    cards = "".join(action_card(a, me, now, tolerance) for a in
                    sorted(acts, key=lambda a: (a["state"] not in DECIDABLE, a["started_at"])))
    return (
        f'<div data-testid="delegation" data-id="{e(me)}">{head}'
        f'<div class="cols"><section class="main-col">{summary(d, now)}</section>'
        f'<section class="side-col"><h2>Tree</h2>{tree(me, ancestors, data["delegations"])}'
        f"<h2>Verification</h2>{chain_status(data)}</section></div>"
        f"{stop}<h2>Calls ({len(acts)})</h2>"
        + (cards or '<p class="muted">no calls journaled</p>')
        + f"<h2>Signed intents and documents</h2>{intents}"
        f"<h2>Decisions</h2>{decisions}<h2>Timeline</h2>{events}</div>")


async def lineage(journal: Any, me: str) -> list[DelegationRow]:
    rows: list[DelegationRow] = await journal.peek(browse.lineage, me)
    return rows
