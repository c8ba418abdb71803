"""Logging: one standard logger per component, silent in a library unless configured, text or
JSON lines (on stderr) in the CLI commands that run services; text lines show journal strings'
control characters instead of sending them to the terminal."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._runtime.logs import configure

from . import remote_agents
from .operator_world import HOSTILE, stuck_payment
from .test_operator_cli import raw_controls
from .test_workers import Cluster, cluster, supervisor  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_components_log_intents_verdicts_and_refusals(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    caplog.set_level(logging.INFO, logger="tether")
    stuck = asyncio.run(stuck_payment(url, reason="customer withdrew"))
    by = {(r.name, r.levelno, r.getMessage()) for r in caplog.records}
    assert ("tether.supervisor", logging.INFO,
            f"TERMINATE accepted for {stuck.delegation} (sequence 1)") in by
    (verdict,) = [r for r in caplog.records if "settled" in r.getMessage()]
    assert verdict.levelno == logging.WARNING  # a person must look
    assert verdict.__dict__["delegation"] == stuck.delegation
    assert verdict.__dict__["unknown"] == [stuck.action]

    async def stale() -> None:
        async with tether.Supervisor(url, recover=False) as sup:
            with contextlib.suppress(tether.TetherError):  # settled: nothing to recall
                await sup.handle_for(stuck.delegation).recall(1.0, "again")

    caplog.clear()
    asyncio.run(stale())
    refused = [r for r in caplog.records if r.name == "tether.journal"]
    assert refused and refused[0].getMessage().startswith("intent refused")
    assert refused[0].__dict__["delegation"] == stuck.delegation


def test_json_lines_carry_the_fields(tmp_path: Path) -> None:
    stream = io.StringIO()
    handler = configure("info", "json", stream)
    try:
        stuck = asyncio.run(stuck_payment(f"sqlite:///{tmp_path / 'j.db'}"))
    finally:
        logging.getLogger("tether").removeHandler(handler)
        logging.getLogger("tether").setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    accepted = next(x for x in lines if x["message"].startswith("TERMINATE accepted"))
    assert accepted["logger"] == "tether.supervisor" and accepted["level"] == "INFO"
    assert accepted["delegation"] == stuck.delegation and accepted["seq"] == 1
    assert "time" in accepted


async def test_the_library_is_silent_unless_configured(tmp_path: Path) -> None:
    """A warning (a delegation needing attention) reaches no terminal of an application that
    did not configure logging."""
    code = ("import asyncio, sys; sys.path.insert(0, '.');"
            "from tests.operator_world import stuck_payment;"
            f"asyncio.run(stuck_payment('sqlite:///{tmp_path / 'j.db'}'))")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert out == b"" and err == b""


@pytest.mark.parametrize(("args", "message"), [(["--log-level", "loud"], "--log-level"),
                                               (["--log-format", "xml"], "--log-format")])
def test_bad_log_options_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["worker", "--agents", "tests.remote_agents:AGENTS",
                                      "--journal", f"sqlite:///{tmp_path / 'j.db'}", *args])
    assert result.exit_code == 2 and result.stderr.startswith("error:")
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


async def test_a_worker_logs_its_claims_as_json(cluster: Cluster) -> None:  # noqa: F811
    async with supervisor(cluster.url) as sup:
        proc = await cluster.worker("--log-format", "json")
        assert proc.stderr is not None
        log = asyncio.ensure_future(proc.stderr.read())  # read all along: a full pipe blocks it
        handle = await sup.delegate(remote_agents.refunder, "L-1", remote=True)
        await handle.result()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    lines = [json.loads(line) for line in (await log).decode().splitlines()]
    ready = next(x for x in lines if x["message"].startswith("worker "))
    assert ready["logger"] == "tether.worker" and ready["agents"]
    claim = next(x for x in lines if x["message"].startswith("claimed"))
    assert claim["delegation"] == handle.id and claim["owner"] == ready["owner"]
    assert any(x["message"].startswith("stopping") for x in lines)


def test_configuring_again_replaces_and_follows_the_current_stderr(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A service command run twice in one process (tests, an embedding application) logs each
    line once, to the stderr of the moment: never to a stream an earlier run swapped in and
    closed (the logging module would print a "Logging error" traceback there instead)."""
    root = logging.getLogger("tether")
    before = list(root.handlers)
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        configure("info", "text")
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        configure("info", "text")
        logging.getLogger("tether.supervisor").info("once")
        assert second.getvalue().count("once") == 1
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)


async def test_text_logs_show_control_characters_instead_of_sending_them(
        tmp_path: Path) -> None:
    """``tether worker``/``console``/``mcp-proxy`` log to stderr, a terminal. A reason, an
    agent's name or a tool's error logged as text must not carry escape sequences, a bidi
    override or a carriage return to it (nor forge a log line with a newline)."""
    stream = io.StringIO()
    handler = configure("info", "text", stream)
    try:
        await stuck_payment(f"sqlite:///{tmp_path / 'j.db'}", reason=HOSTILE + "\nforged line")
    finally:
        logging.getLogger("tether").removeHandler(handler)
    text = stream.getvalue()
    assert "pay[/bold]" in text and "\\x1b[31m" in text, text
    assert raw_controls(text) == [], text
    assert not any(line.startswith("forged") for line in text.splitlines()), text


async def test_the_mcp_proxy_logs_nothing_but_json_lines(bank_env: Path, tmp_path: Path) -> None:
    """With --log-format json every stderr line is a JSON object: the session's delegation
    and how to stop it, once a plain line, is a record with the delegation as a field."""
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    from .mcp_helpers import PYTHONPATH

    journal = f"sqlite:///{tmp_path / 'j.db'}"
    mine = {k: v for k, v in os.environ.items() if k.startswith("TETHER_TEST_")}
    params = StdioServerParameters(
        command=sys.executable, cwd=ROOT, env={**mine, "PYTHONPATH": PYTHONPATH},
        args=["-m", "tether", "mcp-proxy", "--journal", journal, "--log-format", "json",
              "--log-level", "warning", "--upstream", f"bank={sys.executable} -m tests.mcp_bank"])
    with (tmp_path / "stderr").open("w+") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(
                read, write) as session:
            await session.initialize()
            result = await session.call_tool("pay", {"account": "A-1", "cents": 500})
            assert not result.is_error
        errlog.seek(0)
        lines = errlog.read().splitlines()
    records = [json.loads(line) for line in lines]  # each one JSON, or this fails
    started = [r for r in records if "delegation" in r and "tether recall" in r["message"]]
    assert len(started) == 1 and started[0]["delegation"].startswith("d_"), records


def test_the_journal_drivers_reconnection_warnings_stay_out_of_the_log(
        capsys: pytest.CaptureFixture[str]) -> None:
    """psycopg's pool warns on every reconnection attempt while the server is away; with no
    handler of its own, Python printed each raw on stderr, outside the log's format (a JSON
    log then held lines no reader could parse). tether reports the loss itself: only the
    driver's errors are kept, in the log's format."""
    from tether._runtime.logs import configure

    stream = io.StringIO()
    configure("info", "json", stream=stream)
    pool = logging.getLogger("psycopg.pool")
    pool.warning("error connecting in 'tether': connection refused")
    assert capsys.readouterr().err == "" and stream.getvalue() == ""
    pool.error("the pool is broken")
    (line,) = stream.getvalue().splitlines()
    assert json.loads(line)["message"] == "the pool is broken"
