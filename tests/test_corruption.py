"""Flipped bits in journal rows and signatures are detected and refused, never a crash."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tether
from tether._cli.app import app

from .test_cli import tether_cli


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
