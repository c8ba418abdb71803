"""``tether verify [ID] [--json]``: check every signed record of the journal.

It checks what is signed today: the key registry (rooted in the pinned root), every control
intent (signer trusted, body naming its row), every acknowledgement and receipt (signer trusted,
body naming its delegation and sequence), every person's decision (signer trusted, body naming
its delegation) and every queued delegation's work order (signer trusted, body matching the
row); and that each fence or accepted sequence has the accepted intent that explains it.
It also reads every delegation's chain (``_core.chain``): an action, a control row, a
document, an event or the delegation's own row altered, inserted or deleted by hand is named,
and so is a chain whose entries or sealed head were edited. Records older than the chain are
listed as unchained. A genuine earlier state restored as a whole (rows, chain and head rolled
back together) is named when this configuration remembers a later head of that delegation
(``heads.jsonl`` in its key directory; docs/security.md, "Rollback"), and the heads that verify
are remembered in turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tether._journal.journal import DEFAULT_URL, Journal
from tether._runtime.audit import verify_journal
from tether._runtime.keys import KeyRing


def register(app: typer.Typer, out: Console,
             cli_errors: Callable[[Callable[..., None]], Callable[..., None]],
             emit_json: Callable[[Any], None]) -> None:
    @app.command("verify")
    @cli_errors
    def verify(delegation_id: Annotated[str | None, typer.Argument()] = None,
               journal: Annotated[str, typer.Option("--journal", "-j", envvar="TETHER_JOURNAL",
                                                    help="Journal URL.")] = DEFAULT_URL,
               keys: Annotated[Path | None, typer.Option("--keys", help="Key directory.")]
               = None,
               as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """Check every signed record (registry, intents, acknowledgements, queued work) and
        every delegation's chain (actions, results, events); exit 1 naming each record that
        fails."""

        async def go() -> dict[str, Any]:
            async with Journal(journal, create=False) as j:
                directory = keys if keys is not None else j.keys_dir
                ring = (await asyncio.to_thread(KeyRing.load, directory)
                        if (directory / "signing.json").exists() else None)
                return await verify_journal(j, ring, delegation_id)

        data = asyncio.run(go())
        if as_json:
            emit_json(data)
        else:
            out.print(f"{data['records_checked']} signed records and {data['chains_checked']} "
                      f"chains in {data['delegations']} delegations checked; "
                      f"{len(data['problems'])} problem(s)")
            for u in data["unchained"]:
                out.print(f"{u['delegation']}: {u['records']} record(s) written before the "
                          "journal was chained (unchained, not checked)", highlight=False)
            for p in data["problems"]:
                where = f"{p['delegation']}: " if p["delegation"] else ""
                out.print(f"[red]{where}{p['record']}[/red]: {p['problem']}", highlight=False)
        raise typer.Exit(0 if data["ok"] else 1)
