"""The CLI in a terminal: a mistake of any kind (click's own too) is one ``error:`` line and
exit 2; help reads as sentences; tables fit ``$COLUMNS`` with ids whole."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app

from .operator_world import stuck_payment

runner = CliRunner()


def invoke(*args: str, columns: int = 100) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": str(columns)})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(("args", "names"), [
    (["resolve"], "action_id"),  # a missing argument
    (["resolve", "a_x", "--note", "checked"], "--as"),  # a missing option
    (["ls", "--bogus"], "--bogus"),  # an unknown option
    (["ls", "--limit", "many"], "--limit"),  # not an integer
    (["chaos", "--trials", "0"], "--trials"),  # out of range
    (["console", "--port", "99999"], "--port"),
    (["nocommand"], "nocommand"),  # an unknown command
    (["keys", "show", "--bogus"], "--bogus"),  # in a sub-group
    (["trace", "analyze", "--failure"], "--failure"),  # an option without its value
])
def test_every_usage_mistake_is_one_error_line(args: list[str], names: str) -> None:
    code, out, err = invoke(*args)
    assert code == 2, (code, out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert names in lines[0] and "--help" in lines[0], err
    assert not set(err) & set("╭╮╰╯│─"), err  # no boxed panel


def test_a_bare_tether_prints_its_help() -> None:
    code, out, _ = invoke()
    assert code == 2 and "Usage: " in out and "recall" in out


def _helps() -> list[list[str]]:
    from typer.main import get_command

    root = get_command(app)
    found: list[list[str]] = [[]]

    def walk(command: object, path: list[str]) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            found.append([*path, name])
            walk(sub, [*path, name])

    walk(root, [])
    return found


def test_help_is_written_as_sentences() -> None:
    """typer keeps a docstring's line breaks, so a sentence broke where its source line did,
    and ``literal`` markup was printed as typed."""
    helps = _helps()
    assert ["actions"] in helps and ["keys", "init"] in helps and len(helps) > 20
    for path in helps:
        code, out, _ = invoke(*path, "--help", columns=100)
        assert code == 0, path
        assert "``" not in out and "`" not in out, (path, out)
        assert "4611686018427387904" not in out, (path, out)
        wide = invoke(*path, "--help", columns=400)[1]
        for line in _descriptions(wide):
            assert line.endswith((".", ")", ":")), (
                f"tether {' '.join(path)} --help breaks a sentence: {line!r}")
        for line in out.splitlines():
            assert len(line) <= 100, (path, line)


def _descriptions(help_text: str) -> list[str]:
    """At a width where nothing needs wrapping, the lines of a help's description and of its
    commands' descriptions: each is a whole paragraph, so each ends a sentence."""
    lines = help_text.splitlines()
    found = []
    usage = next(i for i, ln in enumerate(lines) if "Usage:" in ln)
    for line in lines[usage + 1:]:
        if line.startswith("╭"):
            break
        if line.strip():
            found.append(line.strip())
    in_commands = False
    for line in lines:
        if line.startswith("╭"):
            in_commands = "Commands" in line
        elif in_commands and line.startswith("│"):
            found.append(re.sub(r"^\S+\s+", "", line.strip(" │")))
    return found


def test_trace_analyze_says_what_it_has_no_data_for(tmp_path: Path) -> None:
    """It printed "median lifetime Nones" on a journal with nothing ended, or nothing failed."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(empty(url))
    code, out, _ = invoke("trace", "analyze", "--journal", url)
    assert code == 0 and "None" not in out and "no delegation has ended" in out, out
    asyncio.run(stuck_payment(url))  # one ended, none failed
    code, out, _ = invoke("trace", "analyze", "--journal", url)
    assert code == 0 and "None" not in out, out
    assert "0 stream_cut failures among 1 ended delegation " in out, out
    assert "none failed" in out and re.search(r"median lifetime [0-9.]+s", out), out


async def empty(url: str) -> None:
    async with tether.Journal(url):
        pass


async def parent_and_child(url: str) -> tuple[str, str, str, str]:
    """A delegation and its child, whose refund completed with a long result."""
    from tether._core.model import Effect
    from tether._journal.rows import NewAction, NewDelegation, OwnerRow
    from tether._runtime.state import new_id

    now = time.time()
    async with tether.Journal(url) as j:
        parent, child, action, key = new_id("d"), new_id("d"), new_id("a"), new_id("k")
        ring = tether.KeyRing.load_or_init(j.keys_dir)
        j.seal_with(ring.signer, ring.trusted)  # written as a supervisor writes: sealed
        await j.register_owner(OwnerRow("o_x", os.getpid(), socket.gethostname(), now, now))
        for did, up in ((parent, None), (child, parent)):
            row = await j.create_delegation(NewDelegation(
                id=did, task_id=new_id("t"), parent_id=up, attempt=1, agent="refund-desk",
                surface=(), args={}, owner_id="o_x", now=now - 5, parent_epoch=0))
        args = {"order_id": "O-7731", "cents": 1250, "note": "customer asked twice " * 8}
        await j.begin_action(NewAction(
            id=action, delegation_id=child, epoch=row.epoch, ordinal=0, tool="refund",
            effect=Effect.EXTERNAL, args_json=json.dumps(args), args_hash="h", idem_key=key,
            now=now - 4, deadline_at=now + 26))
        await j.settle_action(action, tether.ActionState.COMPLETED, now - 3,
                              {"probe": "COMPLETED"}, result={"refund": "re_" + "9" * 120})
    return parent, child, action, key


def test_tables_fit_a_100_column_terminal(tmp_path: Path) -> None:
    """Tables about 190 columns wide wrapped every row in a 100-column pane."""
    from rich.cells import cell_len

    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    parent, child, action, key = asyncio.run(parent_and_child(url))
    whole = {("ls",): [stuck.delegation, parent, child],
             ("actions",): [stuck.action, stuck.delegation, stuck.key, action, child, key],
             ("show", parent): [parent, child, action, key]}
    for args, ids in whole.items():
        _, out, err = invoke(*args, "--journal", url, columns=100)
        assert out and not err, (args, err)
        for line in out.splitlines():
            assert cell_len(line) <= 100, (args, line)
        lines = out.splitlines()
        for ident in ids:  # whole, on one line
            assert any(ident in line for line in lines), (args, ident, out)
    # show lists each action's arguments and result, cut with a marker; --json has them whole.
    _, out, _ = invoke("show", parent, "--journal", url, columns=100)
    assert '"order_id": "O-7731"' in out and '"cents": 1250' in out, out
    assert "re_999" in out and "…" in out and "re_" + "9" * 120 not in out, out
    _, out, _ = invoke("show", parent, "--journal", url, "--json")
    (shown,) = json.loads(out)["actions"]
    assert shown["result"] == {"refund": "re_" + "9" * 120}


def test_chaos_on_a_named_schema_is_refused_before_any_trial(tmp_path: Path) -> None:
    # Each trial makes its own schema: a URL naming one made every trial crash, reported as
    # a clean run that exited 0.
    code, out, err = invoke("chaos", "--trials", "1", "--traces", str(tmp_path), "--journal",
                            "postgresql://postgres@127.0.0.1:5432/test?schema=mine")
    assert code == 2 and out == "", out
    assert err.startswith("error:") and "schema" in err and len(err.strip().splitlines()) == 1


def test_a_chaos_run_whose_trials_crashed_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial whose orchestrator crashed judged nothing: the run is not clean."""
    from tether._chaos import harness

    real = harness.run_chaos

    def crashing(*args: object, **kwargs: object) -> dict[str, object]:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        result["trials_detail"][0].update(outcome="crashed", error="RuntimeError: boom")
        return result

    monkeypatch.setattr(harness, "run_chaos", crashing)
    code, out, _ = invoke("chaos", "--trials", "1", "--faults", "probe_fail")
    assert code == 1 and "crashed" in out and "RuntimeError: boom" in out, out


def test_a_schema_too_long_for_its_notification_channel_is_refused() -> None:
    """The journal's channel is ``tether_<schema>``: past PostgreSQL's 63 bytes LISTEN cuts
    it short and pg_notify refuses it, so no process would ever be woken."""
    schema = "s" * 57
    code, out, err = invoke("ls", "--journal",
                            f"postgresql://postgres@127.0.0.1:5432/test?schema={schema}")
    assert code == 2 and out == "", out
    assert err.startswith("error:") and "longer than 56" in err, err
    assert len(err.strip().splitlines()) == 1
