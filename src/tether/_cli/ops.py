"""The operator's commands: ``tether resolve`` (a person's signed decision on an action nobody
could settle)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tether._cli.safe import safe
from tether._journal.journal import DEFAULT_URL, Journal

JournalOpt = Annotated[str, typer.Option("--journal", "-j", envvar="TETHER_JOURNAL",
                                         help="Journal URL.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
KeysOpt = Annotated[Path | None, typer.Option("--keys", help="Key directory (default: keys/ "
                                              "beside the journal).")]


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
    from tether._runtime.keys import KeyRing
    from tether._runtime.resolve import resolve

    async def go() -> dict[str, Any]:
        async with Journal(journal, create=False) as j:
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
    app.command("resolve")(errors(resolve_cmd))
