"""The CLI as an operator meets it: output that journal strings cannot subvert (the key
registry's labels and ignored entries too), ids that are never cut, dates on times, events in
``show``, exit codes that tell a script the truth."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import unicodedata
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app

from .operator_world import HOSTILE, orphan, stuck_payment

MARKUP = "pay[/bold] [red]x[/red] [link=http://evil]y[/link]"

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def raw_controls(text: str) -> list[str]:
    """Control and format characters that reached the terminal (newlines and box drawing are
    fine)."""
    return [repr(ch) for ch in text
            if unicodedata.category(ch) in ("Cc", "Cf") and ch != "\n"]


def test_markup_escapes_and_control_characters_pass_through_every_command(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url, agent=HOSTILE, tool=HOSTILE, reason=HOSTILE))
    commands = [
        ["ls"], ["ls", "--live"], ["show", stuck.delegation], ["trace", "show", stuck.delegation],
        ["trace", "analyze", "--failure", HOSTILE], ["reconcile", stuck.delegation],
        ["recall", stuck.delegation, "--reason", HOSTILE],
        ["terminate", stuck.delegation, "--reason", HOSTILE],
        ["show", HOSTILE], ["recall", HOSTILE], ["reconcile", HOSTILE], ["keys", "show"],
        ["actions"], ["actions", "--state", "UNKNOWN"], ["ls", "--agent", HOSTILE],
        ["ls", "--state", HOSTILE], ["actions", "--older-than", HOSTILE],
        ["resolve", HOSTILE, "--as", "COMPLETED", "--note", HOSTILE],
        ["resolve", stuck.action, "--as", HOSTILE, "--note", HOSTILE],
        ["export"], ["prune", "--before", HOSTILE], ["prune", "--before", "0s", "--dry-run"],
    ]
    for args in commands:
        _, out, err = invoke(*args, "--journal", url)
        assert raw_controls(out + err) == [], (args, out, err)
        assert "Traceback" not in out + err
    # What was typed is what is shown: the markup literally, the escapes visibly.
    _, out, _ = invoke("show", stuck.delegation, "--journal", url)
    assert "pay[/bold] [red]x[/red] [link=http://evil]y[/link]" in out
    assert "\\x1b[31mred\\x1b[0m" in out and "\\u202e" in out
    _, out, _ = invoke("ls", "--journal", url)
    assert "pay[/bold]" in out
    # The evidence of a probe (it names the tool, brackets and all) is not swallowed.
    code, out, _ = invoke("reconcile", stuck.delegation, "--journal", url)
    assert code == 1 and "has no probe" in out and "pay[/bold]" in out, out
    _, _, err = invoke("recall", HOSTILE, "--journal", url)
    assert err.startswith("error:") and "pay[/bold]" in err
    # A name with control characters is no name: refused, nothing recorded.
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "n",
                            "--by", HOSTILE, "--journal", url)
    assert code == 2 and err.startswith("error:") and "--by" in err, err
    # A person's decision with a name of markup and a hostile note, then all that shows it.
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", HOSTILE,
                            "--by", MARKUP, "--journal", url)
    assert code == 0 and raw_controls(out + err) == [] and "pay[/bold]" in out, err
    for args in (["show", stuck.delegation], ["actions", "--state", "COMPLETED"], ["export"]):
        _, out, err = invoke(*args, "--journal", url)
        assert raw_controls(out + err) == [], (args, out)


def test_error_lines_keep_brackets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # the MCP SDK not installed
    code, _, err = invoke("mcp-proxy", "--upstream", "a=b")
    assert code == 2 and "pip install 'tether[mcp]'" in err, err
    code, _, err = invoke("ls", "--journal", f"sqlite:///{tmp_path}/[mcp].db")
    assert code == 2 and "[mcp].db" in err, err


def test_show_prints_events_dated_times_and_whole_ids(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url, reason="customer withdrew"))
    code, out, _ = invoke("show", stuck.delegation, "--journal", url)
    assert code == 0
    assert "events" in out
    for kind in ("delegated", "control", "in_doubt", "verdict"):
        assert re.search(rf"\b{kind}\b", out), kind
    today = datetime.fromtimestamp(time.time(), UTC).strftime("%Y-%m-%d")
    assert today in out
    # At 80 columns every id and key is printed whole, on one line.
    for ident in (stuck.delegation, stuck.action, stuck.key):
        assert ident in out, ident
    _, out, _ = invoke("ls", "--journal", url)
    assert stuck.delegation in out and today in out


def test_recall_of_a_dead_owners_delegation_exits_nonzero_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    code, out, _ = invoke("recall", delegation, "--grace", "5", "--journal", url)
    assert code == 1, out
    # Said as soon as the owner was found gone (not "has not settled it within" the budget).
    assert "is gone" in out and f"tether reconcile {delegation}" in out
    code, _, _ = invoke("terminate", delegation, "--journal", url, "--json")
    assert code == 1


def intents_of(url: str, delegation: str) -> list[dict[str, object]]:
    code, out, _ = invoke("show", delegation, "--journal", url, "--json")
    assert code == 0, out
    return [i for i in json.loads(out)["intents"] if i["kind"] in ("RECALL", "TERMINATE")]


def test_a_recall_and_a_terminate_name_the_person_who_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    code, out, _ = invoke("recall", delegation, "--by", "Ada Lovelace", "--reason", "refund",
                          "--no-wait", "--journal", url)
    assert code == 0 and "issued by cli:Ada Lovelace" in out, out
    # Unless told, $TETHER_OPERATOR names who asks.
    monkeypatch.setenv("TETHER_OPERATOR", "night operator")
    code, out, _ = invoke("terminate", delegation, "--no-wait", "--journal", url, "--json")
    assert code == 0 and json.loads(out)["issuer"] == "cli:night operator", out
    recall, terminate = intents_of(url, delegation)
    # The name is signed into the intent, and the journal records it as the issuer.
    assert (recall["issuer"], recall["verified"]) == ("cli:Ada Lovelace", "ok")
    assert recall["body"]["by"] == "Ada Lovelace"  # type: ignore[index]
    assert (terminate["issuer"], terminate["body"]["by"]) == (  # type: ignore[index]
        "cli:night operator", "night operator")
    _, out, _ = invoke("show", delegation, "--journal", url)
    assert "cli:Ada Lovelace" in out and "cli:night operator" in out


@pytest.mark.parametrize("by", ["", "   ", "x" * 201, "a\x00b", "alice\nbob", "\u200b",
                                "\u202eeve", "\ud800", "ada\u2028ERROR forged", "a\u2029b",
                                "\u3164", "\u2800", "alice\ufe0f", "ali\u034fce",
                                "a" + "\u0301" * 5, "\u0301ada"])
def test_a_recall_without_a_readable_name_is_refused_and_changes_nothing(
        tmp_path: Path, by: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    for verb in ("recall", "terminate"):
        code, out, err = invoke(verb, delegation, "--by", by, "--journal", url)
        assert code == 2 and out == "", out
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
        assert "--by" in err
    assert intents_of(url, delegation) == []


def test_a_blank_operator_variable_is_unset_and_a_bad_one_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import getpass

    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    monkeypatch.setattr(getpass, "getuser", lambda: "login-name")
    monkeypatch.setenv("TETHER_OPERATOR", "  ")
    code, out, _ = invoke("recall", delegation, "--no-wait", "--json", "--journal", url)
    assert code == 0 and json.loads(out)["issuer"] == "cli:login-name", out
    monkeypatch.setenv("TETHER_OPERATOR", "y" * 201)
    code, _, err = invoke("terminate", delegation, "--no-wait", "--journal", url)
    assert code == 2 and err.startswith("error: $TETHER_OPERATOR"), err
    # The console checks its name when it starts, not at an operator's first click.
    code, out, err = invoke("console", "--journal", url, "--port", "0")
    assert code == 2 and err.startswith("error: $TETHER_OPERATOR") and out == "", (out, err)
    assert len(intents_of(url, delegation)) == 1


def test_recall_that_ends_needing_attention_exits_nonzero(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    code, out, _ = invoke("reconcile", stuck.delegation, "--journal", url)
    assert code == 1 and "NEEDS_ATTENTION" in out


def test_reconcile_of_an_unknown_id_is_an_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    code, out, err = invoke("reconcile", "d_nobody", "--journal", url)
    assert code == 2 and out == ""
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "d_nobody" in err


def test_version() -> None:
    from importlib.metadata import version

    code, out, _ = invoke("--version")
    assert code == 0 and out.strip() == f"tether {version('tether')}"


def test_keys_init_speaks_json(tmp_path: Path) -> None:
    import json

    code, out, _ = invoke("keys", "init", "--keys", str(tmp_path / "k"), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["signing"] and data["directory"] == str(tmp_path / "k")


def test_keys_registry_prints_hostile_labels_and_entries_literally(tmp_path: Path) -> None:
    """``tether keys registry`` (added with the trust registry, after the injection test was
    written) printed labels and ignored entries as markup: a label ``[/bold]`` crashed it
    (MarkupError), and a garbage registry row, which anyone with write access to the journal
    may add (docs/security.md), sent its escape sequences to the operator's terminal."""
    import sqlite3

    from tether._core.documents import KeyGrant

    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    other = tmp_path / "other"
    assert invoke("keys", "init", "--keys", str(other), "--journal", url)[0] == 0
    public = json.loads(invoke("keys", "show", "--keys", str(other), "--journal", url,
                               "--json")[1])["public"]
    assert invoke("keys", "trust", public, "--label", HOSTILE, "--journal", url)[0] == 0
    # A forged entry: signed by a stranger, naming a hostile signer.
    stranger = tether.KeyRing.ephemeral().signer
    signed = stranger.sign(KeyGrant("trust", "k" * 16, public, "x", 1.0))
    with sqlite3.connect(tmp_path / "j.db") as db:
        db.execute("INSERT INTO trust (op, key_id, body, signer, signature, recorded_at) "
                   "VALUES (?, ?, ?, ?, ?, ?)",
                   ("trust", "k" * 16, signed.body, HOSTILE, signed.signature, 2.0))
    code, out, err = invoke("keys", "registry", "--journal", url)
    assert code == 0, (out, err)
    assert raw_controls(out + err) == [], out
    assert "pay[/bold] [red]x[/red]" in out and "\\x1b[31m" in out
    assert out.count("pay[/bold]") == 2  # the label, and the ignored entry's signer


@pytest.mark.parametrize("login", ["   ", "eve\x1b[2J", "mallory\u202e", "z" * 201])
def test_a_login_name_that_is_no_readable_name_is_refused_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, login: str) -> None:
    """With neither --by nor $TETHER_OPERATOR, the login name signs the intent: it comes from
    $LOGNAME or $USER, which anyone may set, so it passes the same check as --by."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    monkeypatch.delenv("TETHER_OPERATOR", raising=False)
    monkeypatch.setenv("LOGNAME", login)
    for verb in ("recall", "terminate"):
        code, out, err = invoke(verb, delegation, "--no-wait", "--journal", url)
        assert code == 2 and out == "", out
        assert err.startswith("error: the login name") and len(err.strip().splitlines()) == 1
        assert "--by" in err, err
    assert intents_of(url, delegation) == []
    # A readable one is used, trimmed.
    monkeypatch.setenv("LOGNAME", "  ada ")
    code, out, _ = invoke("recall", delegation, "--no-wait", "--json", "--journal", url)
    assert code == 0 and json.loads(out)["issuer"] == "cli:ada", out


@pytest.mark.parametrize("by", ["Nguyễn Thị Minh", "Nguye\u0323\u0302n", "देवनागरी",
                                "José Ñúñez", "山田 太郎", "O'Brien-Smith (night shift)"])
def test_names_in_any_script_are_signed_as_given(tmp_path: Path, by: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    code, out, err = invoke("recall", delegation, "--by", by, "--no-wait", "--json",
                            "--journal", url)
    assert code == 0 and json.loads(out)["issuer"] == f"cli:{by}", (out, err)
