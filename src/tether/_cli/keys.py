"""``tether keys trust / revoke / pin / registry``: the deployment's key registry."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tether._cli.safe import safe
from tether._core.errors import UserError
from tether._core.signing import key_id_of, public_key
from tether._core.trust import Registry
from tether._journal.journal import DEFAULT_URL, Journal
from tether._runtime.keys import KeyRing

KeysOpt = Annotated[Path | None, typer.Option("--keys", help="Key directory (default: keys/ "
                                              "beside the journal).")]
JournalOpt = Annotated[str, typer.Option("--journal", "-j", envvar="TETHER_JOURNAL",
                                         help="Journal URL.")]


def parse_public(text: str) -> tuple[str, str]:
    """(key id, base64) of a base64 raw Ed25519 public key, as ``tether keys show`` prints."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
        key = public_key(raw)
    except ValueError as exc:
        raise UserError(f"{text!r} is not a base64 Ed25519 public key (as 'tether keys show' "
                        f"prints it): {exc}") from None
    return key_id_of(key), base64.b64encode(raw).decode("ascii")


def _ring(journal: Journal, keys: Path | None) -> KeyRing:
    return KeyRing.load(keys if keys is not None else journal.keys_dir)


def registry_json(reg: Registry) -> dict[str, Any]:
    return {"root": reg.root, "pinned": list(reg.pinned), "trusted": reg.keys.ids(),
            "labels": reg.labels, "revoked": sorted(reg.revoked),
            "problems": list(reg.problems)}


async def _change(journal_url: str, keys: Path | None, op: str, key_id: str, public: str,
                  label: str) -> dict[str, Any]:
    async with Journal(journal_url, create=False) as j:
        ring = await asyncio.to_thread(_ring, j, keys)
        reg = await j.change_trust(ring.signer, ring.trusted, op, key_id, public, label,
                                   time.time())
        return registry_json(reg)


def register(keys_app: typer.Typer, out: Console,
             cli_errors: Callable[[Callable[..., None]], Callable[..., None]],
             emit_json: Callable[[Any], None]) -> None:
    """Add the registry commands to ``tether keys``."""

    @keys_app.command("trust")
    @cli_errors
    def keys_trust(public: Annotated[str, typer.Argument(help="Base64 public key.")],
                   label: Annotated[str, typer.Option("--label")] = "",
                   journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
                   as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """Trust a key in this journal: an entry signed by your (trusted) key."""
        key_id, b64 = parse_public(public)
        data = asyncio.run(_change(journal, keys, "trust", key_id, b64, label))
        if as_json:
            emit_json(data)
        else:
            out.print(f"key {key_id} is trusted by this journal")

    @keys_app.command("revoke")
    @cli_errors
    def keys_revoke(key_id: str, journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
                    as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """Revoke a key in this journal: an entry signed by your (trusted) key."""
        data = asyncio.run(_change(journal, keys, "revoke", key_id, "", ""))
        if as_json:
            emit_json(data)
        else:
            out.print(f"key {key_id} is revoked in this journal")

    @keys_app.command("pin")
    @cli_errors
    def keys_pin(public: Annotated[str, typer.Argument(help="Base64 public key of the "
                                                       "deployment's root key.")],
                 journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None) -> None:
        """Pin a root key in this configuration (a local file; the journal is not touched)."""
        key_id, b64 = parse_public(public)
        ring = _ring(Journal(journal), keys)
        ring.pin(key_id, b64)
        out.print(f"root key {key_id} pinned in {ring.directory}")

    @keys_app.command("registry")
    @cli_errors
    def keys_registry(journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
                      as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """The keys this journal trusts, as your configuration's pinned root reads it."""

        async def go() -> dict[str, Any]:
            async with Journal(journal, create=False) as j:
                ring = await asyncio.to_thread(_ring, j, keys)
                return registry_json(await j.registry(ring.trusted))

        data = asyncio.run(go())
        if as_json:
            emit_json(data)
            return
        out.print(f"root: {safe(data['root'] or 'none')} (pinned here: "
                  f"{'yes' if data['root'] in data['pinned'] else 'NO'})")
        # Labels and ignored entries are journal text (a garbage row is anyone's to write):
        # printed literally, never as markup or escape sequences.
        for kid in data["trusted"]:
            out.print(safe(f"trusted: {kid} {data['labels'].get(kid, '')}".rstrip()),
                      highlight=False)
        for kid in data["revoked"]:
            out.print(safe(f"revoked: {kid}"), highlight=False)
        for problem in data["problems"]:
            out.print(f"[yellow]ignored: {safe(problem)}[/yellow]", highlight=False)
