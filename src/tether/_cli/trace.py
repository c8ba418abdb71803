"""``tether trace show`` and ``tether trace analyze``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from tether._cli.safe import id_column, print_table, safe
from tether._core.errors import NotFound
from tether._core.forensics import ChildFacts, analyze
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow


async def timeline(journal: Journal, ident: str) -> dict[str, Any]:
    """Every attempt of a task (by task id, or by the id of any of its delegations), with
    every journaled event and decision in order."""
    rows = await journal.delegations()
    task = next((r.task_id for r in rows if r.id == ident), ident)
    attempts = sorted((r for r in rows if r.task_id == task), key=lambda r: (r.epoch, r.attempt))
    if not attempts:
        raise NotFound(f"no task or delegation {ident!r} in this journal")
    ids = [r.id for r in attempts]
    for r in attempts:
        ids += [d.id for d in await journal.subtree(r.id) if d.id != r.id]
    start = attempts[0].created_at
    by_id = {r.id: r for r in rows}
    events = []
    for e in await journal.events(ids):
        owner = by_id.get(e.delegation_id or "")
        events.append({"t": round(e.at - start, 6), "delegation": e.delegation_id,
                       "attempt": owner.attempt if owner else None, "kind": e.kind,
                       "action": e.action_id, "detail": e.detail})
    return {"task": task,
            "attempts": [{"delegation": r.id, "attempt": r.attempt, "epoch": r.epoch,
                          "state": r.state.value, "failure": r.failure, "model": r.model,
                          "lifetime": None if r.ended_at is None else r.ended_at - r.created_at}
                         for r in attempts],
            "events": events}


def render_timeline(console: Console, data: dict[str, Any]) -> None:
    console.print(f"[bold]task {safe(data['task'])}[/bold]", soft_wrap=True)
    for a in data["attempts"]:
        life = "" if a["lifetime"] is None else f", {a['lifetime']:.3f}s"
        failure = f" - {a['failure']}" if a["failure"] else ""
        console.print(safe(f"  attempt {a['attempt']} (epoch {a['epoch']}): {a['delegation']} "
                           f"{a['state']}{failure}{life}"), soft_wrap=True)
    table = Table(title="timeline")
    table.add_column("t (s)", no_wrap=True, justify="right")
    table.add_column("attempt", no_wrap=True)
    id_column(table, "delegation", [e["delegation"] or "" for e in data["events"]])
    table.add_column("event", no_wrap=True)
    table.add_column("detail", overflow="fold", min_width=16)
    for e in data["events"]:
        detail = ", ".join(f"{k}={v}" for k, v in e["detail"].items() if v not in (None, ""))
        table.add_row(f"{e['t']:.3f}", str(e["attempt"] or ""), safe(e["delegation"] or ""),
                      safe(e["kind"]), safe(detail))
    print_table(console, table)


def facts_of(rows: list[DelegationRow]) -> list[ChildFacts]:
    by_id = {r.id: r for r in rows}

    def depth(r: DelegationRow) -> int:
        n, seen = 0, set()
        while r.parent_id is not None and r.parent_id in by_id and r.id not in seen:
            seen.add(r.id)
            r, n = by_id[r.parent_id], n + 1
        return n

    return [ChildFacts(lifetime=r.ended_at - r.created_at, depth=depth(r),
                       model=r.model or "unknown", surface=",".join(sorted(r.surface)) or "-",
                       failure=r.failure)
            for r in rows if r.ended_at is not None]


async def forensics(journal: Journal, failure: str) -> dict[str, Any]:
    return analyze(facts_of(await journal.delegations()), failure)


def render_forensics(console: Console, data: dict[str, Any]) -> None:
    n = data["children"]
    if not n:
        console.print("no delegation has ended in this journal yet: nothing to analyze",
                      soft_wrap=True)
        return
    median = data["median_lifetime"]
    lifetimes = (f"median lifetime {median['failed']}s failed vs {median['all']}s all"
                 if data["failures"] else f"median lifetime {median['all']}s (none failed)")
    console.print(f"{data['failures']} {safe(data['failure'])} failures among {n} ended "
                  f"delegation{'' if n == 1 else 's'} (rate {data['failure_rate']:.2%}); "
                  f"{lifetimes}", soft_wrap=True, highlight=False)
    for name, rows in data["dimensions"].items():
        table = Table(title=f"by {safe(name)}")
        for col in ("value", "failed", "all", "failed share", "base share", "enrichment"):
            table.add_column(col)
        for r in rows:
            table.add_row(safe(r["value"]), str(r["failed"]), str(r["all"]),
                          f"{r['failed_share']:.1%}", f"{r['base_share']:.1%}",
                          "-" if r["enrichment"] is None else f"{r['enrichment']:.2f}x")
        console.print(table)
