"""Flipped bits in journal rows and signatures, rows of the wrong type (SQLite columns take
any) and a parent id edited into a cycle are detected and refused: one error line naming the
row, never a crash or a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tether
from tether._cli.app import app

from .test_cli import ROOT, tether_cli
from .test_signed_work import pay, payer
from .test_trust import one_error_line, raw


async def journal_with_a_terminated_child(sqlite_url: str, shop: Any) -> str:
    shop.gate = asyncio.Event()
    async with tether.Supervisor(sqlite_url, tools=shop.tools) as sup:
        child = await sup.delegate(shop.refund_agent, "Z-1", tools=shop.tools)
        await child.terminate("done")
        return child.id


def tamper(sqlite_url: str, sql: str, *params: object) -> None:
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    conn.execute(sql, params)
    conn.commit()
    conn.close()


@pytest.mark.parametrize(("sql", "command"), [
    ("UPDATE delegations SET state = 'RUNNINX'", ["ls"]),
    ("UPDATE delegations SET surface = '{not json'", ["ls"]),
    ("UPDATE controls SET kind = 'PAUSE'", ["show", "{id}"]),
])
async def test_a_corrupted_row_is_a_clear_error(sqlite_url: str, shop: Any, sql: str,
                                                command: list[str]) -> None:
    delegation = await journal_with_a_terminated_child(sqlite_url, shop)
    tamper(sqlite_url, sql)
    code, out, err = await tether_cli(*[c.format(id=delegation) for c in command],
                                      "--journal", sqlite_url)
    assert code == 2
    assert err.startswith("error:") and "is corrupted" in err and "Traceback" not in err + out


@pytest.mark.parametrize("column", ["signature", "body"])
async def test_a_flipped_bit_in_a_signed_intent_is_refused(sqlite_url: str, shop: Any,
                                                           column: str) -> None:
    delegation = await journal_with_a_terminated_child(sqlite_url, shop)
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    (value,) = conn.execute(f"SELECT {column} FROM controls").fetchone()
    flipped = bytearray(value)
    flipped[len(flipped) // 2] ^= 0x04
    conn.execute(f"UPDATE controls SET {column} = ?", (bytes(flipped),))
    conn.commit()
    conn.close()
    code, out, err = await tether_cli("show", delegation, "--journal", sqlite_url, "--json")
    assert code == 0, err
    (intent,) = [i for i in json.loads(out)["intents"] if i["kind"] == "TERMINATE"]
    assert intent["verified"].startswith("REFUSED")


WORDS = ["ls", "show", "recall", "terminate", "reconcile", "keys", "init", "trace", "analyze",
         "chaos", "--grace", "--journal", "--json", "--reason", "--tools", "--trials", "-1",
         "nan", "0", "1e309", "d_x", "sqlite:///", "x:y", "--keys", "", "\x00", "--live"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS) | st.text(max_size=6), max_size=5))
def test_cli_arguments_never_crash(tmp_path: Path, argv: list[str]) -> None:
    if argv[:1] == ["chaos"]:
        argv = ["chaos", "--trials", "0"]  # keep the fuzz fast: a usage error, not a run
    with contextlib.chdir(tmp_path):  # a fuzzed "--keys ''" must not write into the repo
        result = CliRunner().invoke(app, [*argv, "--journal", f"sqlite:///{tmp_path}/none.db"])
    assert result.exception is None or isinstance(result.exception, SystemExit), argv
    assert "Traceback" not in result.output


async def test_rows_of_the_wrong_type_are_named_not_a_traceback(tmp_path: Path) -> None:
    """SQLite columns take any type: a registry entry, a work order or a document written by
    hand as text crashed every reader of it with a bare TypeError (`tether keys registry`,
    `verify`, `show`, and every acceptance, which reads the registry). A registry entry is
    now ignored and listed like any entry that does not verify; the others are one error
    line naming the row."""
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    async with tether.Supervisor(url, tools=[pay]) as sup:
        queued = await sup.delegate(payer, f"G-{uuid.uuid4().hex[:6]}", 1, remote=True)
        await raw(sup.journal, "INSERT INTO trust (op, key_id, body, signer, signature, "
                  "recorded_at) VALUES ('trust', 'k', 'text', 's', 'sig', 0)")
        code, out, err = await tether_cli("keys", "registry", "--journal", url)
        assert code == 0, err
        assert "ignored: registry entry 2" in out
        # Acceptance still works: the garbage entry is ignored, not fatal.
        report = await queued.terminate("before anyone claims it")
        assert report.outcome is tether.DelegationState.TERMINATED
        await raw(sup.journal, "UPDATE delegations SET work_body = 'text' WHERE id = ?",
                  queued.id)
        code, _, err = await tether_cli("verify", "--journal", url)
        assert code == 2 and "table delegations" in one_error_line(err), err
        await raw(sup.journal, "UPDATE delegations SET work_body = NULL WHERE id = ?",
                  queued.id)
        await raw(sup.journal, "INSERT INTO documents (delegation_id, seq, type, body, key_id, "
                  "signature, recorded_at) VALUES (?, 1, 'ack', 'text', 'k', 7, 0)", queued.id)
        for args in (("verify",), ("show", queued.id)):
            code, _, err = await tether_cli(*args, "--journal", url)
            assert code == 2 and "table documents" in one_error_line(err), (args, err)


async def cli_within(seconds: float, *args: str) -> tuple[int, str, str]:
    """tether_cli, killed (and the test failed) if it hangs."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", *args, cwd=ROOT, env={**os.environ},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), seconds)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"tether {' '.join(args)} hung") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_parent_id_edited_into_a_cycle_is_named_not_a_hang(journal_url: str) -> None:
    """The subtree query recursed without bound: one row made its own parent hung `tether
    show`, `tether verify ID`, and any recall's fence inside its transaction (so the journal's
    writer, and the process, with it)."""

    @tether.agent(tools=[])
    async def idle(ctx: tether.Context) -> int:
        return 1

    async with tether.Supervisor(journal_url) as sup:
        h = await sup.delegate(idle)
        await h.result()
        await raw(sup.journal, "UPDATE delegations SET parent_id = id WHERE id = ?", h.id)
    # In other processes, killed if they hang (in this one a hang would take the test along).
    for args in (("show", h.id), ("verify", h.id), ("verify",)):
        code, out, err = await cli_within(60, *args, "--journal", journal_url)
        if args == ("verify",):
            assert code in (0, 1), out + err  # the whole journal: read row by row
        else:
            assert code == 2 and "its own ancestor" in one_error_line(err), (args, err)
