"""Rich rendering of delegations, reports and journal contents for the CLI."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from tether._cli.safe import age, brief, clip, id_column, print_table, safe, stacked, when
from tether._core.documents import ControlIntent, decode
from tether._core.errors import ControlRefused
from tether._core.model import ControlKind
from tether._core.resolution import decode_resolution
from tether._core.signing import TrustedKeys
from tether._core.trust import bound
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow

STATE_STYLE = {
    "COMPLETED": "green", "RECALLED": "green", "SUCCEEDED": "green", "RECONCILED": "green",
    "NOT_APPLIED": "cyan", "FAILED": "red", "UNKNOWN": "bold red", "IN_DOUBT": "yellow",
    "NEEDS_ATTENTION": "bold red", "PENDING": "yellow", "RUNNING": "yellow",
    "INTERRUPTED": "yellow",
}


def styled(state: str) -> str:
    style = STATE_STYLE.get(state, "")
    return f"[{style}]{safe(state)}[/{style}]" if style else safe(state)


def delegation_table(rows: list[DelegationRow], now: float | None = None) -> Table:
    now = time.time() if now is None else now
    table = Table(title="delegations")
    # A child's parent under its id: both whole, and the table fits 100 columns.
    id_column(table, "id / parent")
    table.add_column("agent", overflow="fold", min_width=8)
    table.add_column("state", no_wrap=True)
    table.add_column("created (UTC)", no_wrap=True)
    table.add_column("age", no_wrap=True, justify="right")
    for r in rows:
        table.add_row(stacked(safe(r.id), safe(r.parent_id or "")), safe(r.agent),
                      styled(r.state.value), when(r.created_at), age(r.created_at, now))
    return table


async def collect(journal: Journal, root_id: str, pins: TrustedKeys | None) -> dict[str, Any]:
    """Everything ``tether show`` (and the console's delegation view) prints, as JSON-ready
    data: every signature verified against the journal's key registry as the configuration's
    ``pins`` root it, every record against its delegation's chain (no pins: neither)."""
    # Several reads while other processes write, in an order that keeps each judgment true:
    # a decision before the documents (its signed document commits with it), the records
    # before their chain (each record shown was committed, and so chained, before the chain
    # was read), the registry after the intents (a key that signed one was trusted when it
    # committed; a revocation read later is the truth now), and the tree last again: pruned
    # meanwhile, it is NotFound, as any delegation not in the journal, not a tree with none
    # of its records.
    rows = await journal.subtree(root_id)
    ids = [r.id for r in rows]
    decisions = await journal.resolutions(ids)
    actions = await journal.actions(ids)
    signed = [(d, await journal.controls(d), await journal.documents(d)) for d in ids]
    events = await journal.events(ids)
    tampered = [] if pins is None else [
        {"delegation": v.delegation_id, "record": p.record, "problem": p.problem}
        for v in await journal.chain_verdicts(ids, pins) for p in v.problems]
    trusted = None if pins is None else (await journal.registry(pins)).keys
    await journal.subtree(root_id)
    marks = {t["record"]: t["problem"].split(":")[0] for t in tampered}
    intents = []
    epochs = {r.id: r.epoch for r in rows}
    for d, controls, documents in signed:
        for c in controls:
            intents.append({"delegation": d, "seq": c.seq, "kind": c.kind.value,
                            "key_id": c.signed.key_id, "issuer": c.issuer,
                            "accepted_at": c.accepted_at,
                            "verified": _verify(trusted, c.signed, (d, c.seq, c.kind, epochs[d])),
                            "body": _body(c.signed.body)})
        for doc in documents:
            body = _body(doc.signed.body)
            verified = _verify(trusted, doc.signed)
            if verified == "ok" and body.get("delegation", d) != d:  # a copy (tether verify)
                verified = (f"REFUSED: signed for delegation {body['delegation']}: a copied "
                            f"or replayed {doc.type}")
            intents.append({"delegation": d, "seq": doc.seq, "kind": doc.type.upper(),
                            "key_id": doc.signed.key_id, "issuer": "child",
                            "accepted_at": doc.recorded_at, "verified": verified,
                            "body": body})
    return {
        "decisions": [_signed_by(d, intents) for d in decisions],
        "delegations": [{**r.to_json(), **_mark(marks, f"delegation {r.id}")} for r in rows],
        "actions": [{**a.to_json(), **_mark(marks, f"action {a.id}")} for a in actions],
        "intents": intents,
        "events": [{"at": e.at, "kind": e.kind, "delegation": e.delegation_id,
                    "action": e.action_id, "detail": e.detail,
                    **_mark(marks, f"event {e.id}")} for e in events],
        "chain": "not checked (no keys)" if pins is None else
                 "ok" if not tampered else "TAMPERED",
        "tampered": tampered,
    }


def _signed_by(decision: dict[str, Any], intents: list[dict[str, Any]]) -> dict[str, Any]:
    """A decision as its event tells it, with ``signed``: "ok" when a verified resolution
    document says the same (action, outcome, person, note), else why not. The event is the
    journal's word, which no signature covers; the document is the person's."""
    if decision["kind"] != "resolved":
        return decision
    said = (decision.get("action"), decision.get("outcome"), decision.get("operator"),
            decision.get("note"))
    for i in intents:
        body = i["body"]
        if i["verified"] == "ok" and body.get("type") == "resolution" and (
                body.get("action"), body.get("outcome"), body.get("operator"),
                body.get("note")) == said:
            return {**decision, "signed": "ok"}
    return {**decision, "signed": "no verified resolution document says this"}


def _mark(marks: dict[str, str], record: str) -> dict[str, str]:
    """A record that fails its chain: ``{"tampered": "altered" | "inserted"}``."""
    return {"tampered": marks[record]} if record in marks else {}


def _flag(r: dict[str, Any]) -> str:
    return f" [bold red]TAMPERED ({safe(r['tampered'])})[/bold red]" if "tampered" in r else ""


def _body(body: bytes) -> dict[str, Any]:
    """A body that no longer decodes is shown as such; its signature check says REFUSED."""
    try:
        if b'"type":"resolution"' in body:
            return decode_resolution(body).to_json()
        return decode(body).to_json()
    except ControlRefused as exc:
        return {"undecodable": str(exc)}


def _verify(trusted: TrustedKeys | None, signed: Any,
            row: tuple[str, int, ControlKind, int] | None = None) -> str:
    """ok, or REFUSED and why: an untrusted or bad signature, or (for an intent) a body that
    names another row than the one it is attached to (a copy or a replay)."""
    if trusted is None:
        return "no trusted keys"
    try:
        trusted.verify_bytes(signed)
        if row is not None:
            intent = trusted.verify(signed, ControlIntent)
            bound(intent, *row)
    except ControlRefused as exc:
        return f"REFUSED: {exc}"
    return "ok"


def render_show(console: Console, data: dict[str, Any]) -> None:
    rows = data["delegations"]
    root = rows[0]
    now = time.time()

    def label(r: dict[str, Any]) -> str:
        return (f"{safe(r['id'])} {safe(r['agent'])} {styled(r['state'])} "
                f"(created {when(r['created_at'])}, {age(r['created_at'], now)} ago)"
                f"{_flag(r)}")

    tree = Tree(f"[bold]{label(root)}[/bold]")
    nodes = {root["id"]: tree}
    for r in rows[1:]:
        parent = nodes.get(r["parent"], tree)
        nodes[r["id"]] = parent.add(label(r))
    console.print(tree)
    render_actions(console, data["actions"])
    intents = data["intents"]
    table = Table(title="signed intents and acknowledgements")
    id_column(table, "delegation / at (UTC)")
    table.add_column("seq", no_wrap=True, justify="right")
    table.add_column("kind", no_wrap=True)
    id_column(table, "signature / key")
    table.add_column("detail", overflow="fold", min_width=16)
    for i in intents:
        ok = i["verified"]
        body = i["body"]
        detail = body.get("reason") or (
            f"in flight: {len(body['in_flight'])}" if "in_flight" in body else "") or (
            f"{body['action']} {body['outcome']} by {body['operator']}: {body['note']}"
            if body.get("type") == "resolution" else "")
        if body.get("type") == "control":  # who asked: the signed name, else the issuer
            who = f"by {body['by']}" if isinstance(body.get("by"), str) else \
                f"issued by {i['issuer']}"
            if ok != "ok" and isinstance(body.get("by"), str):  # a claim nobody signed
                who = f"claimed by {body['by']} (unsigned)"
            detail = f"{who}: {detail}" if detail else who
            if body.get("recovery") is True:  # tether's own settling, no one's stop
                detail = f"recovery ({'signed' if ok == 'ok' else 'unsigned claim'}); {detail}"
        signature = "[green]verified[/green]" if ok == "ok" else "[red]REFUSED[/red]"
        if ok != "ok":  # why, where there is room for it
            detail = f"{ok}; {detail}" if detail else ok
        table.add_row(stacked(safe(i["delegation"]), when(i["accepted_at"])), str(i["seq"]),
                      safe(i["kind"]), stacked(signature, safe(i["key_id"])), safe(detail))
    print_table(console, table)
    render_decisions(console, data.get("decisions", []))
    events = data["events"]
    table = Table(title="events")
    id_column(table, "id, at (UTC)")
    table.add_column("event", no_wrap=True)
    table.add_column("detail", overflow="fold", min_width=16)
    for e in events:
        detail = ", ".join(f"{k}={v}" for k, v in e["detail"].items()
                           if v not in (None, "") and k != "at")
        table.add_row(stacked(safe(e["action"] or e["delegation"] or ""), when(e["at"])),
                      safe(e["kind"]) + _flag(e), safe(detail))
    print_table(console, table)
    for t in data.get("tampered", []):  # deleted records have no row above to mark
        console.print(f"[bold red]TAMPERED[/bold red] {safe(t['delegation'])}: "
                      f"{safe(t['record'])}: {safe(t['problem'])}", highlight=False,
                      soft_wrap=True)


def render_actions(console: Console, acts: list[dict[str, Any]]) -> None:
    """Each action as a short block: its ids whole, its arguments and result on a line each,
    cut to the terminal with a marker (``--json`` has them whole)."""
    console.print(f"[bold]actions ({len(acts)})[/bold]")
    room = max(20, console.width - 16)
    for a in acts:
        state = styled(a["state"]) + (" [yellow]late[/yellow]" if a["late"] else "") + _flag(a)
        console.print(f"  {safe(a['id'])}  {safe(a['tool'])} ({safe(a['effect'])})  {state}",
                      highlight=False, crop=False, overflow="ignore", no_wrap=True)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, style="dim")
        grid.add_column(overflow="fold")
        grid.add_row("  delegation", safe(a["delegation"]))
        grid.add_row("  key", safe(a["idempotency_key"]))
        grid.add_row("  started", when(a["started_at"]))
        grid.add_row("  arguments", safe(clip(a["args"], room)))
        if a["result"] is not None:
            grid.add_row("  result", safe(clip(a["result"], room)))
        if a["error"]:
            grid.add_row("  error", safe(clip(a["error"], room)))
        if a["evidence"]:
            grid.add_row("  evidence", safe(brief(a["evidence"])))
        print_table(console, grid)


def render_decisions(console: Console, decisions: list[dict[str, Any]]) -> None:
    """Who decided what and why, and every later fact that said otherwise."""
    if not decisions:
        return
    table = Table(title="decisions by people (signed), and facts that contradict them")
    table.add_column("at (UTC)", no_wrap=True)
    id_column(table, "action", [d["action"] for d in decisions])
    table.add_column("decision", no_wrap=True)
    table.add_column("by", overflow="fold", min_width=8)
    id_column(table, "key", [d.get("key_id", "") for d in decisions])
    table.add_column("note", overflow="fold", min_width=16)
    for d in decisions:
        if d["kind"] == "resolved":
            unsigned = d.get("signed", "ok") != "ok"
            table.add_row(when(d["at"]), safe(d["action"]),
                          f"{styled(d['old'])} -> {styled(d['outcome'])}"
                          + (" [bold red]UNSIGNED[/bold red]" if unsigned else ""),
                          safe(d["operator"]), safe(d["key_id"]),
                          safe(f"{d['signed']}; {d['note']}" if unsigned else d["note"]))
        else:
            table.add_row(when(d["at"]), safe(d["action"]),
                          f"[bold red]CONTRADICTED[/bold red] by {styled(d['new'])}", "", "",
                          safe(f"decided {d['resolved']}; a later receipt says {d['new']}"
                               + (f" (error: {d['error']})" if d.get("error") else "")))
    print_table(console, table)


def render_report(console: Console, report: dict[str, Any], indent: str = "") -> None:
    console.print(f"{indent}[bold]{safe(report['delegation'])}[/bold] "
                  f"({safe(report['agent'])}): {styled(report['outcome'])}"
                  + (f" - {safe(report['verdict'])}: {safe(report['reason'])}"
                     if report["verdict"] else ""), soft_wrap=True)
    for a in report["actions"]:
        console.print(f"{indent}  {safe(a['tool'])} {safe(a['idempotency_key'])}: "
                      f"{styled(a['state'])}"
                      + (" (late receipt)" if a["late"] else "")
                      + (f" \\[{safe(brief(a['evidence']))}]" if a["evidence"] else ""),
                      soft_wrap=True)
    for child in report["children"]:
        render_report(console, child, indent + "  ")


def trials_table(title: str, faults: dict[str, dict[str, Any]]) -> Table:
    """Per fault: trials, violations and classes, as ``tether chaos`` and ``tether sim`` print."""
    table = Table(title=title)
    for col in ("fault", "trials", "violations", "by class"):
        table.add_column(col)
    for name, row in faults.items():
        table.add_row(safe(name), str(row["trials"]), str(row["violations"]),
                      safe(" ".join(f"{k} {n}" for k, n in row["classes"].items())))
    return table
