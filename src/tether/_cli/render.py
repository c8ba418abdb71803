"""Rich rendering of delegations, reports and journal contents for the CLI."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from tether._core.documents import ControlIntent, decode
from tether._core.errors import ControlRefused
from tether._core.model import ControlKind
from tether._core.signing import TrustedKeys
from tether._core.trust import bound
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow

STATE_STYLE = {
    "COMPLETED": "green", "RECALLED": "green", "SUCCEEDED": "green", "RECONCILED": "green",
    "NOT_APPLIED": "cyan", "FAILED": "red", "UNKNOWN": "bold red", "IN_DOUBT": "yellow",
    "NEEDS_ATTENTION": "bold red", "PENDING": "yellow", "RUNNING": "yellow",
}


def styled(state: str) -> str:
    style = STATE_STYLE.get(state, "")
    return f"[{style}]{state}[/{style}]" if style else state


def when(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S.%f")[:-3]


def delegation_table(rows: list[DelegationRow]) -> Table:
    table = Table(title="delegations")
    for col in ("id", "task", "parent", "epoch", "agent", "state", "seq", "updated"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.id, r.task_id, r.parent_id or "", str(r.epoch), r.agent,
                      styled(r.state.value), str(r.control_seq), when(r.updated_at))
    return table


async def collect(journal: Journal, root_id: str, trusted: TrustedKeys | None) -> dict[str, Any]:
    """Everything ``tether show`` prints, as JSON-ready data. Signatures are verified here."""
    rows = await journal.subtree(root_id)
    ids = [r.id for r in rows]
    actions = await journal.actions(ids)
    intents = []
    epochs = {r.id: r.epoch for r in rows}
    for d in ids:
        for c in await journal.controls(d):
            intents.append({"delegation": d, "seq": c.seq, "kind": c.kind.value,
                            "key_id": c.signed.key_id, "issuer": c.issuer,
                            "accepted_at": c.accepted_at,
                            "verified": _verify(trusted, c.signed, (d, c.seq, c.kind, epochs[d])),
                            "body": _body(c.signed.body)})
        for doc in await journal.documents(d):
            intents.append({"delegation": d, "seq": doc.seq, "kind": doc.type.upper(),
                            "key_id": doc.signed.key_id, "issuer": "child",
                            "accepted_at": doc.recorded_at,
                            "verified": _verify(trusted, doc.signed),
                            "body": _body(doc.signed.body)})
    events = await journal.events(ids)
    return {
        "delegations": [r.to_json() for r in rows],
        "actions": [a.to_json() for a in actions],
        "intents": intents,
        "events": [{"at": e.at, "kind": e.kind, "delegation": e.delegation_id,
                    "action": e.action_id, "detail": e.detail} for e in events],
    }


def _body(body: bytes) -> dict[str, Any]:
    """A body that no longer decodes is shown as such; its signature check says REFUSED."""
    try:
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
    tree = Tree(f"[bold]{root['id']}[/bold] {root['agent']} {styled(root['state'])}")
    nodes = {root["id"]: tree}
    for r in rows[1:]:
        parent = nodes.get(r["parent"], tree)
        nodes[r["id"]] = parent.add(f"{r['id']} {r['agent']} {styled(r['state'])}")
    console.print(tree)
    table = Table(title="actions")
    for col in ("id", "delegation", "tool", "effect", "idempotency key", "state", "late",
                "evidence"):
        table.add_column(col, overflow="fold")
    for a in data["actions"]:
        table.add_row(a["id"], a["delegation"], a["tool"], a["effect"], a["idempotency_key"],
                      styled(a["state"]), "late" if a["late"] else "",
                      _brief(a["evidence"]))
    console.print(table)
    table = Table(title="signed intents and acknowledgements")
    for col in ("delegation", "seq", "kind", "key", "signature", "detail"):
        table.add_column(col, overflow="fold")
    for i in data["intents"]:
        ok = i["verified"]
        body = i["body"]
        detail = body.get("reason") or (
            f"in flight: {len(body['in_flight'])}" if "in_flight" in body else "")
        table.add_row(i["delegation"], str(i["seq"]), i["kind"], i["key_id"],
                      "[green]verified[/green]" if ok == "ok" else f"[red]{ok}[/red]", detail)
    console.print(table)


def _brief(evidence: dict[str, Any] | None) -> str:
    if not evidence:
        return ""
    return ", ".join(f"{k}={v}" for k, v in evidence.items() if k != "probed_at")


def render_report(console: Console, report: dict[str, Any], indent: str = "") -> None:
    console.print(f"{indent}[bold]{report['delegation']}[/bold] ({report['agent']}): "
                  f"{styled(report['outcome'])}"
                  + (f" - {report['verdict']}: {report['reason']}" if report["verdict"] else ""))
    for a in report["actions"]:
        console.print(f"{indent}  {a['tool']} {a['idempotency_key']}: {styled(a['state'])}"
                      + (" (late receipt)" if a["late"] else "")
                      + (f" [{_brief(a['evidence'])}]" if a["evidence"] else ""))
    for child in report["children"]:
        render_report(console, child, indent + "  ")


def trials_table(title: str, faults: dict[str, dict[str, Any]]) -> Table:
    """Per fault: trials, violations and classes, as ``tether chaos`` and ``tether sim`` print."""
    table = Table(title=title)
    for col in ("fault", "trials", "violations", "by class"):
        table.add_column(col)
    for name, row in faults.items():
        table.add_row(name, str(row["trials"]), str(row["violations"]),
                      " ".join(f"{k} {n}" for k, n in row["classes"].items()))
    return table
