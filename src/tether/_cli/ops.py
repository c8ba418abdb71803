"""The operator's commands: ``tether ls`` (newest first, filtered, paged), ``tether actions``
(the queue of what needs a person) and ``tether resolve`` (a person's signed decision on an
action nobody could settle)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tether._cli.safe import age, brief, id_column, print_table, safe, when
from tether._core.errors import UserError
from tether._core.model import ActionState, DelegationState
from tether._core.outcome import UNSETTLED
from tether._journal.journal import DEFAULT_URL, Journal
from tether._journal.triage import ActionQuery, DelegationQuery

JournalOpt = Annotated[str, typer.Option("--journal", "-j", envvar="TETHER_JOURNAL",
                                         help="Journal URL.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
KeysOpt = Annotated[Path | None, typer.Option("--keys", help="Key directory (default: keys/ "
                                              "beside the journal).")]


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
    from tether._cli.app import emit_json, out
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
    """Journaled actions, oldest first: the operator's queue. Exits 1 when it lists one that
    needs a person (UNKNOWN) or whose outcome is still not known (in flight or in doubt)."""
    from tether._cli.app import emit_json, out

    states = _states(state, ActionState, "--state")
    if in_flight:
        flying = tuple(s.value for s in UNSETTLED)
        states = tuple(s for s in states if s in flying) if states else flying
        if not states:
            raise UserError("--in-flight and --state name no state in common")
    now = time.time()
    query = ActionQuery(states=states, agent=agent, limit=limit or None,
                        started_before=None if older_than is None
                        else now - duration(older_than, "--older-than"))

    async def go() -> list[tuple[Any, str, str]]:
        async with Journal(journal, create=False) as j:
            return await j.find_actions(query)

    found = run(go())
    problem = any(a.state in UNSETTLED or a.state is ActionState.UNKNOWN for a, _, _ in found)
    if as_json:
        emit_json([{**a.to_json(), "agent": ag, "delegation_state": ds} for a, ag, ds in found])
        raise typer.Exit(1 if problem else 0)
    print_table(out, _actions_table(found, now))
    raise typer.Exit(1 if problem else 0)


def _actions_table(found: list[tuple[Any, str, str]], now: float) -> Any:
    from rich.table import Table

    from tether._cli.render import styled

    table = Table(title=f"actions ({len(found)})")
    id_column(table, "id")
    id_column(table, "delegation")
    table.add_column("agent", overflow="fold", min_width=6)
    table.add_column("tool", overflow="fold", min_width=6)
    id_column(table, "idempotency key")
    table.add_column("state", no_wrap=True)
    table.add_column("started (UTC)", no_wrap=True)
    table.add_column("age", no_wrap=True, justify="right")
    table.add_column("evidence", overflow="fold", min_width=16)
    for a, ag, _ in found:
        table.add_row(safe(a.id), safe(a.delegation_id), safe(ag), safe(a.tool),
                      safe(a.idempotency_key), styled(a.state.value), when(a.started_at),
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
    from tether._cli.app import emit_json, out
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


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def register(app: typer.Typer, errors: Any) -> None:
    """Called from ``app``: the operator's commands, each behind the CLI's error handling."""
    app.command("ls")(errors(ls_cmd))
    app.command("actions")(errors(actions_cmd))
    app.command("resolve")(errors(resolve_cmd))
