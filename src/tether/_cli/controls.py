"""A recall or terminate of every live delegation a selection names (``tether recall --agent
X``, ``--state``, ``--since``): one signed intent each, all accepted at once, then the
owners' reports; and what makes such a command's exit code."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from tether._cli.common import emit_json, out, run
from tether._cli.ops import moment
from tether._cli.safe import id_column, print_table, safe
from tether._core.errors import UserError
from tether._core.model import ControlKind, DelegationState
from tether._journal.triage import DelegationQuery

# Outcomes a person must look at: a command that ends with one exits 1 (not settled yet, or
# held for a person).
ATTENTION = frozenset(s.value for s in DelegationState
                      if not s.terminal or s is DelegationState.NEEDS_ATTENTION)
LIVE = tuple(s.value for s in DelegationState if not s.terminal)

StateOpt = Annotated[list[str] | None, typer.Option(
    "--state", help="Every live delegation in this state (repeatable, or comma-separated), "
    "instead of one id.")]
AgentSelectOpt = Annotated[str | None, typer.Option(
    "--agent", help="Every live delegation of this agent, instead of one id.")]
SinceOpt = Annotated[str | None, typer.Option(
    "--since", help="Every live delegation created since: a duration ago (30m, 2h) or a "
    "date and time, instead of one id.")]


def needs_person(report: dict[str, Any]) -> bool:
    """A report (as JSON) not settled, or held for a person, anywhere in its tree: a root
    TERMINATED whose child's call is UNKNOWN still needs one."""
    return report["outcome"] in ATTENTION or any(needs_person(c) for c in report["children"])


def selection(delegation_id: str | None, agent: str | None, state: list[str] | None,
              since: str | None) -> DelegationQuery | None:
    """None for one delegation by id; else the live delegations the options select. Exactly
    one of the two, checked before anything is signed."""
    chosen = agent is not None or state is not None or since is not None
    if delegation_id is not None and chosen:
        raise UserError("name one delegation id, or select with --agent, --state or "
                        "--since, not both")
    if delegation_id is None and not chosen:
        raise UserError("name a delegation id, or select live delegations with --agent, "
                        "--state or --since")
    if not chosen:
        return None
    states = tuple(v.strip().upper() for raw in state or [] for v in raw.split(",")
                   if v.strip())
    if state is not None and not states:
        raise UserError("--state takes a live state: " + ", ".join(LIVE))
    wrong = [v for v in states if v not in LIVE]
    if wrong:
        raise UserError(f"--state: {', '.join(wrong)} is not a live state; live: "
                        f"{', '.join(LIVE)}")
    if agent is not None and not agent.strip():
        raise UserError("--agent: an empty name")
    return DelegationQuery(states=states or LIVE, agent=agent,
                           since=None if since is None else moment(since, "--since",
                                                                     time.time()),
                           limit=None)


def control_many(kind: ControlKind, query: DelegationQuery, journal: str,
                 grace: float | None, reason: str, by: str | None, wait: bool,
                 keys: Path | None, as_json: bool) -> None:
    """Exit 0 when every selected delegation settled with nothing left for a person (or,
    with --no-wait, every intent was accepted or found its delegation ended); else 1."""
    from tether._cli.render import render_report
    from tether._runtime.control import ControlRequest, send_controls

    request = ControlRequest(journal, keys, "", kind, grace, reason, by, via="cli", wait=wait)
    answers, covered = run(send_controls(request, query))

    def fine(answer: dict[str, Any]) -> bool:
        if "error" in answer:
            return False
        if "ended" in answer or not wait:
            return True  # ended before its intent, or stopped (by this intent or another)
        return "report" in answer and not needs_person(answer["report"])

    code = 0 if all(fine(a) for a in answers) else 1
    if as_json:
        emit_json({"kind": kind.value, "answers": answers, "covered": covered})
        raise typer.Exit(code)
    if not answers:
        out.print(f"no live delegation matches: nothing to {kind.value.lower()}.")
        raise typer.Exit(0)
    done = sum(1 for a in answers if a["accepted"])
    out.print(f"{kind.value} accepted for {done} of {len(answers)} selected delegations "
              f"(each with its own signed intent); their fences are closed."
              + (f" {len(covered)} more are under one of them, stopped with it."
                 if covered else ""), soft_wrap=True)
    rows = []
    for a in answers:
        if "ended" in a:
            rows.append((a["delegation"], "ended before its intent"))
        elif "error" in a:
            rows.append((a["delegation"], f"error: {a['error']}"))
        elif "report" in a:
            rows.append((a["delegation"], a["report"]["outcome"]))
        elif "waiting" in a:
            rows.append((a["delegation"], f"waiting: {a['waiting']}"))
        elif "refused" in a:
            rows.append((a["delegation"], f"stopped by an earlier intent: {a['refused']}"))
        else:
            rows.append((a["delegation"], f"accepted (sequence {a['seq']})"))
    table = Table()
    id_column(table, "delegation")
    table.add_column("outcome")
    for d, outcome in rows:
        table.add_row(safe(d), safe(outcome))
    print_table(out, table)
    for a in answers:
        if "report" in a and needs_person(a["report"]):
            render_report(out, a["report"])
    raise typer.Exit(code)
