"""Adversarial review of the operator's tether (issue 16): each test shows one defect found,
and would fail without its fix."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._core.model import ActionState

from .operator_world import stuck_payment

runner = CliRunner()
A = ActionState


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


# -- resolve: a decision is believed only from a key the journal's registry trusts ------------

def test_resolve_with_a_key_the_journal_does_not_trust_is_refused(tmp_path: Path) -> None:
    """A key made on the spot (``tether keys init --keys DIR``) pins itself; the journal's
    registry, rooted elsewhere, does not trust it. A recall signed with it is refused, and so
    must be a decision: it would otherwise settle an UNKNOWN payment by anyone's word."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    stranger = tmp_path / "stranger"
    assert invoke("keys", "init", "--keys", str(stranger), "--journal", url)[0] == 0
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "trust me",
                            "--by", "Mallory", "--keys", str(stranger), "--journal", url)
    assert code == 2 and out == "" and err.startswith("error:"), (code, out, err)
    assert "not trusted" in err and len(err.strip().splitlines()) == 1

    async def state() -> tuple[ActionState, list[Any]]:
        async with tether.Journal(url, create=False) as j:
            return (await j.action(stuck.action)).state, await j.resolutions([stuck.delegation])

    assert asyncio.run(state()) == (A.UNKNOWN, [])


def test_resolve_by_a_key_the_registry_trusts_is_accepted(tmp_path: Path) -> None:
    """The other side: an operator whose key the root granted (``tether keys trust``) and
    who pins the journal's root may decide, as they may recall."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    root = tether.KeyRing.load(tmp_path / "keys")
    ada = tmp_path / "ada"
    assert invoke("keys", "init", "--keys", str(ada), "--journal", url)[0] == 0
    code, out, _ = invoke("keys", "show", "--keys", str(ada), "--journal", url, "--json")
    assert code == 0, out
    public = json.loads(out)["public"]
    assert invoke("keys", "trust", public, "--journal", url)[0] == 0
    assert invoke("keys", "pin", root.signer.public_b64(), "--keys", str(ada),
                  "--journal", url)[0] == 0
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "paid",
                            "--by", "Ada", "--keys", str(ada), "--journal", url)
    assert code == 0, (out, err)


# -- prune: a task's keys outlive the tree that holds them while the task may run again --------

async def test_pruning_a_re_delegated_tasks_old_attempt_does_not_pay_twice(
        journal_url: str) -> None:
    """The first attempt paid (key ``task:charge:0``, COMPLETED) and was stopped; the task
    was re-delegated, and its new attempt will call charge with the same key, which the
    journal answers with the recorded receipt (I7). Pruning the old, settled tree in between
    must not make the journal forget that key: the payment would run a second time."""
    paid: list[str] = []
    entered, gate = asyncio.Event(), asyncio.Event()
    attempts = 0

    @tether.tool(name="charge")
    async def charge(order_id: str, cents: int, *, idempotency_key: str) -> str:
        paid.append(idempotency_key)
        return f"ch_{len(paid)}"

    async def payer(ctx: tether.Context) -> str:
        nonlocal attempts
        attempts += 1
        if attempts > 1:
            await gate.wait()
        receipt = await ctx.call(charge, order_id="O-1", cents=1250)
        if attempts == 1:
            entered.set()
            await asyncio.Event().wait()  # stuck after paying: the operator stops it
        return str(receipt)

    far = time.time() + 10 * 86400  # a cut-off and a "now" past every deadline
    async with tether.Supervisor(journal_url, tools=[charge]) as sup:
        first = await sup.delegate(tether.Agent("payer", payer, (charge,)), tools=[charge])
        await entered.wait()
        await first.terminate("stuck after paying")
        assert (await sup.journal.get(first.id)).state.terminal
        second = await first.redelegate()
        j = sup.journal
        roots = await j.roots(since=None, until=far, after=None, limit=500, settled_only=True)
        assert first.id in roots
        await j.prune(await j.prunable(roots, far, far), far, far, None)
        gate.set()
        assert await second.result() == "ch_1"  # the receipt, replayed
        await second.wait()
        # Once every attempt of the task is settled, they go together.
        roots = await j.roots(since=None, until=far, after=None, limit=500, settled_only=True)
        done = await j.prune(await j.prunable(roots, far, far), far, far, None)
        assert done["delegations"] == 2 and done["kept"] == []
    assert paid == [f"{first.task_id}:charge:0"]  # once


# -- the console ----------------------------------------------------------------------------

def _client(url: str, keys: Path | None = None) -> Any:
    from starlette.testclient import TestClient

    from tether._console.server import Console, build

    app_ = build(Console(url, keys, "t" * 24))
    return TestClient(app_, base_url="http://127.0.0.1")


def test_console_actions_take_the_token_from_the_header_only(tmp_path: Path) -> None:
    """Actions need the token in X-Tether-Token; an empty header with the token in the query
    string (what a page that learnt the URL could send) must not pass for it."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    with _client(url) as client:
        r = client.post(f"/api/actions/{stuck.action}/resolve?token={'t' * 24}",
                        headers={"X-Tether-Token": ""},
                        json={"outcome": "COMPLETED", "note": "forged", "by": "Mallory"})
        assert r.status_code == 401, r.text
        r = client.post(f"/api/delegations/{stuck.delegation}/terminate?token={'t' * 24}",
                        headers={"X-Tether-Token": ""}, json={"reason": "forged"})
        assert r.status_code == 401, r.text

    async def state() -> ActionState:
        async with tether.Journal(url, create=False) as j:
            return (await j.action(stuck.action)).state

    assert asyncio.run(state()) is A.UNKNOWN


def test_console_and_export_verify_signatures_as_tether_show_does(tmp_path: Path) -> None:
    """A decision signed by an operator the registry trusts (granted by the root) is
    'verified' in ``tether show``; the console must not call it REFUSED because the key is
    not one of its configuration's pinned roots."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    root = tether.KeyRing.load(tmp_path / "keys")
    ada = tmp_path / "ada"
    assert invoke("keys", "init", "--keys", str(ada), "--journal", url)[0] == 0
    public = json.loads(invoke("keys", "show", "--keys", str(ada), "--journal", url,
                               "--json")[1])["public"]
    assert invoke("keys", "trust", public, "--journal", url)[0] == 0
    assert invoke("keys", "pin", root.signer.public_b64(), "--keys", str(ada),
                  "--journal", url)[0] == 0
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "paid",
                            "--by", "Ada", "--keys", str(ada), "--journal", url)
    assert code == 0, (out, err)
    shown = json.loads(invoke("show", stuck.delegation, "--journal", url, "--json")[1])
    with _client(url) as client:
        r = client.get(f"/api/delegations/{stuck.delegation}?token={'t' * 24}")
        assert r.status_code == 200, r.text
        served = r.json()
    verdicts = [(i["kind"], i["verified"]) for i in shown["intents"]]
    assert ("RESOLUTION", "ok") in verdicts
    assert [(i["kind"], i["verified"]) for i in served["intents"]] == verdicts
    # And so does tether export (the archive prune writes is the same).
    code, out, _ = invoke("export", "--journal", url)
    assert code == 0
    signed = [r for r in map(json.loads, out.splitlines()) if "signature" in r]
    assert len(signed) == len(verdicts) and all(r["verified"] == "ok" for r in signed), signed


def test_console_on_a_public_address_warns(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host 0.0.0.0`` serves the journal and its buttons to the network over plain HTTP,
    the token in the URL: said on stderr at start, not only in --help."""
    import uvicorn

    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    ran: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.append(sockets))
    code, out, err = invoke("console", "--host", "0.0.0.0", "--port", "0", "--journal", url)
    assert code == 0 and ran, (out, err)
    for socks in ran:
        for sock in socks:
            sock.close()
    assert "warning:" in err and "0.0.0.0" in err, err
    code, out, err = invoke("console", "--host", "127.0.0.1", "--port", "0", "--journal", url)
    for socks in ran[1:]:
        for sock in socks:
            sock.close()
    assert code == 0 and "warning" not in err, err


# -- triage: a limit the database cannot hold ----------------------------------------------

@pytest.mark.parametrize("command", ["ls", "actions"])
def test_a_huge_limit_is_a_usage_error_not_a_traceback(tmp_path: Path, command: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    code, out, err = invoke(command, "--limit", str(2 ** 80), "--journal", url)
    assert code == 2 and out == "" and "--limit" in err, (code, out, err)
    code, out, _ = invoke(command, "--limit", str(2 ** 62), "--journal", url)
    assert code in (0, 1) and ("charge" in out or "payer" in out), out


# -- keys registry: labels and ignored entries are journal text too ---------------------------

def _raw_controls(text: str) -> list[str]:
    import unicodedata

    return [repr(ch) for ch in text if unicodedata.category(ch) in ("Cc", "Cf") and ch != "\n"]


def test_keys_registry_prints_hostile_labels_and_entries_literally(tmp_path: Path) -> None:
    """``tether keys registry`` (added with the trust registry, after the injection test was
    written) printed labels and ignored entries as markup: a label ``[/bold]`` crashed it
    (MarkupError), and a garbage registry row, which anyone with write access to the journal
    may add (docs/security.md), sent its escape sequences to the operator's terminal."""
    import sqlite3

    from tether._core.documents import KeyGrant

    from .operator_world import HOSTILE

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
    assert _raw_controls(out + err) == [], out
    assert "pay[/bold] [red]x[/red]" in out and "\\x1b[31m" in out
    assert out.count("pay[/bold]") == 2  # the label, and the ignored entry's signer


@pytest.mark.parametrize("host", ["bad\x00host", "\u202ehost[/bold]"])
def test_console_with_an_unusable_host_is_one_error_line(tmp_path: Path, host: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    code, out, err = invoke("console", "--host", host, "--port", "0", "--journal", url)
    assert code == 2 and out == "" and err.startswith("error:"), (code, out, err)
    assert len(err.strip().splitlines()) == 1 and _raw_controls(err) == []


# -- resolve: two decisions on one delegation at once (PostgreSQL) ----------------------------

async def test_two_decisions_in_one_delegation_at_once_are_both_recorded(pg_url: str) -> None:
    """Each decision's document takes the delegation's next sequence number. Another process
    deciding on another action of the same delegation holds number 1 in its open transaction;
    this decision must wait for it and take number 2, not count the committed rows, take
    number 1 too and fail on the unique index with a database error."""
    import psycopg

    stuck = await stuck_payment(pg_url)
    base, _, query = pg_url.partition("?")
    schema = dict(p.split("=", 1) for p in query.split("&"))["schema"]
    other = await psycopg.AsyncConnection.connect(base, options=f"-c search_path={schema}")
    try:
        # The other resolver, mid-transaction: the delegation locked, its document written.
        await other.execute("SELECT id FROM delegations WHERE id = %s FOR UPDATE",
                            (stuck.delegation,))
        await other.execute(
            "INSERT INTO documents (delegation_id, seq, type, body, key_id, signature, "
            "recorded_at) VALUES (%s, 1, 'resolution', %s, 'k', %s, 1)",
            (stuck.delegation, b"{}", b"s"))
        async with tether.Supervisor(pg_url, recover=False) as sup:
            task = asyncio.create_task(sup.resolve(stuck.action, "COMPLETED", "paid",
                                                   operator="Ada"))
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 20
            while True:  # until this decision waits for the other transaction's lock
                cur = await (await psycopg.AsyncConnection.connect(
                    base, autocommit=True)).execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY("
                    "pg_blocking_pids(pid))", (other.info.backend_pid,))
                row = await cur.fetchone()
                await cur.connection.close()
                if row is not None and row[0] > 0:
                    break
                assert loop.time() < give_up and not task.done(), task
                await asyncio.sleep(0.01)
            await other.commit()
            action = await task
            assert action.state is A.COMPLETED
            seqs = [r[0] async for r in await other.execute(
                "SELECT seq FROM documents WHERE delegation_id = %s AND type = 'resolution' "
                "ORDER BY seq", (stuck.delegation,))]
            assert seqs == [1, 2]
    finally:
        await other.close()


# -- logs: journal text reaches the terminal of a service command ---------------------------

async def test_text_logs_show_control_characters_instead_of_sending_them(
        tmp_path: Path) -> None:
    """``tether worker``/``console``/``mcp-proxy`` log to stderr, a terminal. A reason, an
    agent's name or a tool's error logged as text must not carry escape sequences, a bidi
    override or a carriage return to it (nor forge a log line with a newline)."""
    import io
    import logging

    from tether._runtime.logs import configure

    from .operator_world import HOSTILE

    stream = io.StringIO()
    handler = configure("info", "text", stream)
    try:
        await stuck_payment(f"sqlite:///{tmp_path / 'j.db'}", reason=HOSTILE + "\nforged line")
    finally:
        logging.getLogger("tether").removeHandler(handler)
    text = stream.getvalue()
    assert "pay[/bold]" in text and "\\x1b[31m" in text, text
    assert _raw_controls(text) == [], text
    assert not any(line.startswith("forged") for line in text.splitlines()), text


# -- verify: a person's signed decision is a record like the others ------------------------

def test_verify_checks_a_decision_instead_of_calling_it_malformed(tmp_path: Path) -> None:
    """``tether verify`` ran every document through the child documents' decoder, so a
    journal where a person resolved an action failed verification ("unknown document type
    'resolution'") though nothing was wrong; and a decision copied onto another delegation
    was not told from a genuine one."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "paid",
                            "--by", "Ada", "--journal", url)
    assert code == 0, (out, err)
    code, out, _ = invoke("verify", "--journal", url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["problems"] == [], report
    # The same signed decision copied onto another delegation's documents.
    other = asyncio.run(stuck_payment(url, order="O-2"))
    with sqlite3.connect(tmp_path / "j.db") as db:
        db.execute("INSERT INTO documents (delegation_id, seq, type, body, key_id, signature, "
                   "recorded_at) SELECT ?, seq, type, body, key_id, signature, recorded_at "
                   "FROM documents WHERE delegation_id = ? AND type = 'resolution'",
                   (other.delegation, stuck.delegation))
    code, out, _ = invoke("verify", "--journal", url, "--json")
    report = json.loads(out)
    # Named as a copy (its signed body names another delegation), and as a row no writer
    # chained (docs/security.md, "The chain").
    assert code == 1 and {p["delegation"] for p in report["problems"]} == {other.delegation}
    assert any("copied" in p["problem"] for p in report["problems"]), report
    assert any(p["problem"].startswith("inserted") for p in report["problems"]), report
    # tether show says so too, instead of "verified".
    shown = json.loads(invoke("show", other.delegation, "--journal", url, "--json")[1])
    (copy,) = [i for i in shown["intents"] if i["kind"] == "RESOLUTION"]
    assert copy["verified"].startswith("REFUSED") and "copied" in copy["verified"], copy


def test_a_call_without_a_journaled_deadline_is_not_decided_not_applied_at_once(
        tmp_path: Path) -> None:
    """A row from before deadlines were journaled (schema v3) has none: a probe then waits
    for its start plus the default dispatch deadline (``deadline_of``); a person deciding
    "not applied" must wait as long, not be allowed at once (its start taken as deadline)."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    with sqlite3.connect(tmp_path / "j.db") as db:
        db.execute("UPDATE actions SET deadline_at = NULL WHERE id = ?", (stuck.action,))
    code, out, err = invoke("resolve", stuck.action, "--as", "NOT_APPLIED", "--note", "x",
                            "--journal", url)
    assert code == 2 and "may still apply" in err, (code, out, err)
