"""The operator's commands: ``tether ls`` (newest first, filtered, paged), ``tether actions``
(the queue of what needs a person) and ``tether resolve`` (a person's signed decision on an
action nobody could settle)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Annotated, Any

import typer

from tether._cli.common import JournalOpt, JsonOpt, KeysOpt, emit_json, out, run
from tether._cli.safe import age, brief, id_column, print_table, safe, stacked
from tether._core.errors import UserError
from tether._core.model import ActionState, DelegationState
from tether._core.outcome import UNSETTLED
from tether._journal.journal import DEFAULT_URL, Journal
from tether._journal.triage import ActionQuery, DelegationQuery


def _bounded(value: int) -> int:
    # A database's LIMIT is a 64-bit integer (a larger one was a traceback). Checked here, not
    # with max=, which printed the bound in the help as the option's range.
    if value > 2 ** 62:
        raise typer.BadParameter("too large (0 lists all)")
    return value


LimitOpt = Annotated[int, typer.Option("--limit", min=0, callback=_bounded,
                                       help="At most this many rows (0: all).")]
AgentOpt = Annotated[str | None, typer.Option("--agent", help="Only this agent's.")]
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str, option: str) -> float:
    """``90``, ``30s``, ``5m``, ``2h``, ``1d``: seconds."""
    raw = text.strip().lower()
    unit = _UNITS.get(raw[-1:])
    number = raw[:-1] if unit is not None else raw
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise UserError(f"{option} {text!r}: expected a duration such as 30s, 5m, 2h or 1d") \
            from None
    if not value >= 0 or value == float("inf"):
        raise UserError(f"{option} {text!r}: expected a finite, non-negative duration")
    return value


def moment(text: str, option: str, now: float) -> float:
    """A time: a duration ago (``2h``) or a date and time (``2026-12-01``, ``...T13:00Z``,
    UTC unless it says otherwise)."""
    from datetime import UTC, datetime

    try:
        return now - duration(text, option)
    except UserError:
        pass
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UserError(f"{option} {text!r}: expected a duration ago (30m, 2h) or a date "
                        "and time (2026-12-01T13:00Z)") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def _states(values: list[str] | None, kind: type[DelegationState] | type[ActionState],
            option: str) -> tuple[str, ...]:
    known = [s.value for s in kind]
    found = tuple(v.strip().upper() for raw in values or [] for v in raw.split(","))
    wrong = [v for v in found if v not in known]
    if wrong:
        raise UserError(f"{option}: unknown state(s) {', '.join(wrong)}; known: "
                        f"{', '.join(known)}")
    return found


def ls_cmd(
    journal: JournalOpt = DEFAULT_URL, as_json: JsonOpt = False,
    live: Annotated[bool, typer.Option("--live", help="Only live ones (not settled).")] = False,
    state: Annotated[list[str] | None, typer.Option(
        "--state", help="Only in this state (repeatable, or comma-separated).")] = None,
    agent: AgentOpt = None,
    since: Annotated[str | None, typer.Option(
        "--since", help="Created since: a duration ago (30m, 2h) or a date and time.")] = None,
    before: Annotated[str | None, typer.Option(
        "--before", help="Only those created before this delegation id (the next page).")]
    = None,
    limit: LimitOpt = 50,
) -> None:
    """List delegations, newest first, a page at a time."""
    from tether._cli.render import delegation_table

    states = _states(state, DelegationState, "--state")
    if live:
        live_states = tuple(s.value for s in DelegationState if not s.terminal)
        states = tuple(s for s in states if s in live_states) if states else live_states
        if not states:
            raise UserError("--live and --state name no state in common")
    now = time.time()
    query = DelegationQuery(states=states, agent=agent,
                            since=None if since is None else moment(since, "--since", now),
                            before=before, limit=limit or None)

    async def go() -> list[Any]:
        async with Journal(journal, create=False) as j:
            if before is not None:
                await j.get(before)  # an unknown cursor is a mistake, not an empty page
            return await j.page(query)

    rows = run(go())
    if as_json:
        emit_json([r.to_json() for r in rows])
        return
    print_table(out, delegation_table(rows, now))
    if limit and len(rows) == limit:
        out.print(f"next page: --before {safe(rows[-1].id)}", highlight=False)


# What a person must look at: an outcome not known yet, or one nobody could settle.
NEEDS_PERSON = tuple(sorted({s.value for s in UNSETTLED} | {ActionState.UNKNOWN.value}))


def actions_cmd(
    journal: JournalOpt = DEFAULT_URL, as_json: JsonOpt = False,
    state: Annotated[list[str] | None, typer.Option(
        "--state", help="Only in this state (repeatable, or comma-separated), e.g. UNKNOWN.")]
    = None,
    in_flight: Annotated[bool, typer.Option(
        "--in-flight", help="Only calls whose outcome is not known yet (PENDING or "
        "IN_DOUBT).")] = False,
    older_than: Annotated[str | None, typer.Option(
        "--older-than", help="Only calls started this long ago or more (30s, 5m, 2h).")]
    = None,
    agent: AgentOpt = None,
    limit: LimitOpt = 50,
) -> None:
    """The operator's queue of journaled actions: those that need a person first (UNKNOWN,
    or still in flight or in doubt), then the rest, each group oldest first; a page that
    leaves some out says how many.

    Exit status: 1 when any selected action needs a person, listed on this page or not;
    0 when none does; 2 for a mistake in the command."""

    states = _states(state, ActionState, "--state") or tuple(s.value for s in ActionState)
    if in_flight:
        flying = tuple(s.value for s in UNSETTLED)
        states = tuple(s for s in states if s in flying) if state else flying
        if not states:
            raise UserError("--in-flight and --state name no state in common")
    now = time.time()
    started_before = None if older_than is None else now - duration(older_than,
                                                                    "--older-than")
    first = tuple(s for s in states if s in NEEDS_PERSON)
    groups = [g for g in (first, tuple(s for s in states if s not in NEEDS_PERSON)) if g]

    async def go() -> tuple[list[tuple[Any, str, str]], list[int]]:
        found: list[tuple[Any, str, str]] = []
        counts = []
        async with Journal(journal, create=False) as j:
            for group in groups:
                query = ActionQuery(states=group, agent=agent, started_before=started_before,
                                    limit=None)
                counts.append(await j.count_actions(query))
                room = None if not limit else limit - len(found)
                if room != 0:
                    found += await j.find_actions(replace(query, limit=room))
        return found, counts

    found, counts = run(go())
    needing = counts[0] if first else 0
    more = sum(counts) - len(found)
    left = more - (needing - sum(1 for a, _, _ in found if a.state.value in NEEDS_PERSON))
    note = ""
    if more:
        waiting = more - left
        note = (f"… {more} more" + (f" ({waiting} need{'s' if waiting == 1 else ''} a person)"
                                    if waiting else "") + "; --limit / --state to see them")
    code = 1 if needing else 0
    if as_json:
        emit_json([{**a.to_json(), "agent": ag, "delegation_state": ds} for a, ag, ds in found])
        if note:
            err_line(note)
        raise typer.Exit(code)
    who = ("none needs a person" if not needing else
           f"{needing} need{'s' if needing == 1 else ''} a person")
    print_table(out, _actions_table(found, now, f"actions: {sum(counts)}, {who}"))
    if note:
        out.print(safe(note), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def err_line(text: str) -> None:
    """A note beside JSON on stdout: stderr, so the JSON stays whole."""
    import sys

    sys.stderr.write(text + "\n")


def _actions_table(found: list[tuple[Any, str, str]], now: float, title: str) -> Any:
    from rich.table import Table

    from tether._cli.render import styled

    table = Table(title=title, show_lines=True)
    # Stacked cells keep every id and key whole within 100 columns; the start time is in
    # 'tether show' and --json.
    id_column(table, "action / delegation / key")
    table.add_column("agent / tool", overflow="fold", min_width=8)
    table.add_column("state", no_wrap=True)
    table.add_column("age", no_wrap=True, justify="right")
    table.add_column("evidence", overflow="fold", min_width=16)
    for a, ag, _ in found:
        table.add_row(stacked(safe(a.id), safe(a.delegation_id), safe(a.idempotency_key)),
                      stacked(safe(ag), safe(a.tool)), styled(a.state.value),
                      age(a.started_at, now), safe(brief(a.evidence)))
    return table


def resolve_cmd(
    action_id: Annotated[str, typer.Argument(help="The action's id (tether actions --state "
                                                   "UNKNOWN lists them).")],
    outcome: Annotated[str, typer.Option(
        "--as", help="What happened: COMPLETED (it applied) or NOT_APPLIED (it did not, and "
        "can no longer).")],
    note: Annotated[str, typer.Option("--note", help="Why: what you checked, and where.")],
    by: Annotated[str | None, typer.Option(
        "--by", help="Who decides (default: $TETHER_OPERATOR, else the login name).")] = None,
    journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None, as_json: JsonOpt = False,
) -> None:
    """Record a person's decision on an action in doubt or UNKNOWN, signed with your key; its
    delegation is settled again. A later receipt that says otherwise is kept and flagged."""
    from tether._runtime.clockcheck import check_host_clock
    from tether._runtime.keys import KeyRing
    from tether._runtime.resolve import resolve

    async def go() -> dict[str, Any]:
        async with Journal(journal, create=False) as j:
            # "Not applied" is judged against the call's deadline on this host's clock.
            await check_host_clock(j, "tether resolve cannot judge dispatch deadlines")
            ring = await asyncio.to_thread(KeyRing.load, keys or j.keys_dir)
            action = await resolve(j, ring, action_id, outcome.upper(), note, by, time.time())
            row = await j.get(action.delegation_id)
            return {"action": action.to_json(), "delegation": row.id,
                    "delegation_state": row.state.value}

    data = run(go())
    if as_json:
        emit_json(data)
        return
    decision = data["action"]["evidence"]["resolution"]
    out.print(safe(f"resolved {action_id} as {decision['outcome']} by {decision['operator']} "
                   f"(key {decision['key_id']}); delegation {data['delegation']} is now "
                   f"{data['delegation_state']}"), soft_wrap=True, highlight=False)


def register(app: typer.Typer, errors: Any) -> None:
    """Called from ``app``: the operator's commands, each behind the CLI's error handling."""
    app.command("ls")(errors(ls_cmd))
    app.command("actions")(errors(actions_cmd))
    app.command("resolve")(errors(resolve_cmd))
