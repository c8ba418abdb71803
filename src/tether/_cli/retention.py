"""``tether export`` (JSON Lines, every record with its verification status) and ``tether
prune`` (whole settled trees only, archived first, the prune itself recorded)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from tether._cli.common import JournalOpt, JsonOpt, KeysOpt, emit_json, out
from tether._cli.ops import moment
from tether._cli.safe import safe
from tether._core.errors import ControlRefused, UserError
from tether._core.signing import Signed, TrustedKeys
from tether._journal.journal import DEFAULT_URL, Journal

PAGE = 500  # trees read per round trip


def verifier(trusted: TrustedKeys | None) -> Callable[[dict[str, Any]], str]:
    """A record's verification status: signed ones are checked against the trusted keys."""

    def status(record: dict[str, Any]) -> str:
        if "signature" not in record:
            return "unsigned"
        if trusted is None:
            return "no trusted keys"
        try:
            trusted.verify_bytes(Signed(record["body"].encode("utf-8"), record["key_id"],
                                        base64.b64decode(record["signature"])))
        except (ControlRefused, ValueError) as exc:
            return f"REFUSED: {exc}"
        return "ok"

    return status


@dataclass(frozen=True)
class Checks:
    """What a record is checked against: the keys its signature must verify with, and the
    pins its delegation's chain is verified against (None: no keys here)."""

    trusted: TrustedKeys | None = None
    pins: TrustedKeys | None = None


async def _trusted(j: Journal, keys: Path | None) -> Checks:
    from tether._runtime.keys import KeyRing

    directory = keys or j.keys_dir
    if not (directory / "signing.json").exists():
        return Checks()
    # The journal's key registry as this configuration roots it, as ``tether show`` reads it
    # (a granted operator's key is not one of the pins).
    ring = await asyncio.to_thread(KeyRing.load, directory)
    return Checks((await j.registry(ring.trusted)).keys, ring.trusted)


def _named(record: dict[str, Any], owners: dict[str, str]) -> tuple[str | None, str]:
    """A record's delegation and its name in that delegation's chain (``_core.chain``): an
    event that names only its action is chained with the action's delegation."""
    kind = record["record"]
    if kind == "delegation":
        return record["id"], f"delegation {record['id']}"
    owner = record.get("delegation") or owners.get(str(record.get("action")))
    return owner, f"{kind} {record.get('id')}"


async def _chain_marks(j: Journal, records: list[dict[str, Any]], pins: TrustedKeys | None
                       ) -> dict[str, dict[str, str]]:
    """Per delegation of these records whose chain fails: each record it names, and why."""
    if pins is None:
        return {}
    ids = [r["id"] for r in records if r["record"] == "delegation"]
    return {v.delegation_id: {p.record: p.problem for p in v.problems}
            for v in await j.chain_verdicts(ids, pins) if not v.ok}


def _chain_status(record: dict[str, Any], marks: dict[str, dict[str, str]],
                  pins: TrustedKeys | None, owners: dict[str, str]) -> str:
    """``ok``, or what is wrong with the record or with its delegation's chain: a column no
    signature covers (a control's issuer, a state) is believed only where the chain is."""
    if pins is None:
        return "not checked (no keys)"
    delegation, name = _named(record, owners)
    problems = marks.get(delegation or "")
    if problems is None:
        return "ok"
    if name in problems:
        return f"TAMPERED: {problems[name]}"
    return "its delegation's chain fails verification (tether verify names each record)"


async def _write(j: Journal, root_ids: list[str], sink: IO[bytes],
                 checks: Checks) -> tuple[int, str]:
    """JSON Lines to ``sink``; the number of records and the SHA-256 of the bytes written.
    Each record says whether its signature verifies and whether its chain does."""
    status = verifier(checks.trusted)
    digest, n = hashlib.sha256(), 0
    for root in root_ids:
        records = await j.tree_records(root)
        marks = await _chain_marks(j, records, checks.pins)
        owners = {r["id"]: r["delegation"] for r in records if r["record"] == "action"}
        for record in records:
            record["verified"] = status(record)
            record["chain"] = _chain_status(record, marks, checks.pins, owners)
            line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode("utf-8")
            sink.write(line)
            digest.update(line)
            n += 1
    return n, digest.hexdigest()


def export_cmd(
    journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
    since: Annotated[str | None, typer.Option(
        "--since", help="Trees created since: a duration ago (7d) or a date and time.")] = None,
    until: Annotated[str | None, typer.Option(
        "--until", help="Trees created before: a duration ago or a date and time.")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write here instead of stdout.")] = None,
) -> None:
    """Every record of the delegation trees created in [--since, --until), as JSON Lines:
    delegations, actions, signed intents and documents (with their exact bytes and whether
    their signature verifies), and events."""
    import sys

    now = time.time()
    lo = None if since is None else moment(since, "--since", now)
    hi = None if until is None else moment(until, "--until", now)

    async def go(sink: IO[bytes]) -> tuple[int, str]:
        async with Journal(journal, create=False) as j:
            checks = await _trusted(j, keys)
            total, after = 0, None
            digest = hashlib.sha256()
            while True:
                page = await j.roots(since=lo, until=hi, after=after, limit=PAGE)
                if not page:
                    return total, digest.hexdigest()
                n, _ = await _write(j, page, sink, checks)
                total += n
                after = page[-1]

    if output is None:
        asyncio.run(go(sys.stdout.buffer))
        sys.stdout.flush()
        return
    target = Path(os.path.realpath(output))  # a symbolic link's target, not the link
    if _is_journal_file(target, journal):
        raise UserError(f"--output {output} is the journal (or its log or index); "
                        "refusing to write over it")
    try:
        kind = target.stat().st_mode
    except FileNotFoundError:
        kind = None
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
    if kind is not None and not stat.S_ISREG(kind):
        # A pipe, a terminal or a device (/dev/null) is written to, never replaced.
        try:
            with target.open("wb") as fh:
                asyncio.run(go(fh))
        except OSError as exc:
            raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
        return
    # A file: written beside the destination and moved over it whole, so a failure leaves
    # nothing (the export is private, 0600, as the journal is).
    try:
        fd, part = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
    output = target
    try:
        with os.fdopen(fd, "wb") as fh:
            asyncio.run(go(fh))
        os.replace(part, output)
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)


def _is_journal_file(target: Path, journal_url: str) -> bool:
    """Whether ``target`` is a SQLite journal's file, log or index (by path or by inode)."""
    if not journal_url.startswith("sqlite:"):
        return False
    from tether._journal.access import sqlite_path

    try:
        base = Path(os.path.realpath(sqlite_path(journal_url.split("?", 1)[0])))
    except (UserError, ValueError):
        return False
    for suffix in ("", "-wal", "-shm", "-journal"):
        side = Path(f"{base}{suffix}")
        if side == target:
            return True
        with contextlib.suppress(OSError):
            if os.path.samefile(side, target):
                return True
    return False


def prune_cmd(
    before: Annotated[str, typer.Option(
        "--before", help="Prune trees that ended before: a duration ago (30d) or a date.")],
    journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
    archive: Annotated[Path | None, typer.Option(
        "--archive", help="First write what is pruned here (JSON Lines, as tether export); "
        "its SHA-256 is recorded in the journal.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; change "
                                          "nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove whole delegation trees that are settled and ended before --before: never one
    with anything running, in doubt, UNKNOWN or needing attention. The prune is recorded in
    the journal (counts, cut-off, archive digest)."""
    from tether._runtime.clockcheck import check_host_clock

    now = time.time()
    cutoff = moment(before, "--before", now)
    if archive is not None and archive.exists():
        raise UserError(f"--archive {archive} exists; refusing to overwrite an archive")

    async def go() -> dict[str, Any]:
        async with Journal(journal, create=False) as j:
            # Calls are prunable only past their deadlines, judged on this host's clock.
            await check_host_clock(j, "tether prune cannot judge dispatch deadlines")
            candidates: list[str] = []
            after = None
            while True:
                page = await j.roots(since=None, until=cutoff, after=after, limit=PAGE,
                                     settled_only=True)
                if not page:
                    break
                candidates += await j.prunable(page, cutoff, now)
                after = page[-1]
            # A root that goes with another listed on an earlier page is named once.
            candidates = list(dict.fromkeys(candidates))
            if dry_run:
                return {"dry_run": True, "before": cutoff, "roots": len(candidates),
                        "root_ids": candidates}
            saved = None
            if archive is not None and candidates:
                checks = await _trusted(j, keys)
                try:  # private, like the journal it copies
                    fh = os.fdopen(os.open(archive, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                           0o600), "wb")
                except FileExistsError:
                    raise UserError(f"--archive {archive} exists; refusing to overwrite an "
                                    "archive") from None
                except OSError as exc:
                    raise UserError(f"cannot write the archive {archive}: "
                                    f"{exc.strerror or exc}") from None
                try:
                    with fh:
                        n, digest = await _write(j, candidates, fh, checks)
                        fh.flush()
                        os.fsync(fh.fileno())
                except OSError as exc:  # a full disk, say: no half archive, nothing pruned
                    with contextlib.suppress(OSError):
                        os.unlink(archive)
                    raise UserError(f"cannot write the archive {archive}: "
                                    f"{exc.strerror or exc}; nothing was pruned") from None
                saved = {"path": str(archive), "sha256": digest, "records": n}
            return await j.prune(candidates, cutoff, now, saved)

    result = run(go())
    if as_json:
        emit_json(result)
        return
    if result.get("dry_run"):
        out.print(f"would prune {result['roots']} tree(s) that ended before "
                  f"{safe(time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(cutoff)))}Z",
                  highlight=False)
        return
    kept = f"; {len(result['kept'])} changed since and kept" if result["kept"] else ""
    out.print(safe(f"pruned {result['roots']} tree(s): {result['delegations']} delegation(s), "
                   f"{result['actions']} action(s){kept}"), highlight=False)
    if "archive" in result:
        a = result["archive"]
        out.print(safe(f"archive: {a['path']} ({a['records']} records, sha256 {a['sha256']})"),
                  highlight=False, soft_wrap=True)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def register(app: typer.Typer, errors: Any) -> None:
    app.command("export")(errors(export_cmd))
    app.command("prune")(errors(prune_cmd))
