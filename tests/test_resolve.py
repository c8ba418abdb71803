"""A person's decision on an action nobody could settle: signed, journaled with who, why and
when; the delegation re-settled; a later fact that says otherwise kept and flagged. Only a key
the journal's registry trusts may decide; two decisions in one delegation at once are both
recorded; "not applied" waits for a call's deadline even where none was journaled; and
`tether verify` checks a decision like any signed record (a copy onto another delegation is
named)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._core.model import ActionState
from tether._core.resolution import Resolution, contradicts, judge_resolution

from .operator_world import stuck_payment
from .test_cli import tether_cli
from .test_trust import one_error_line

runner = CliRunner()
A = ActionState


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def one_line_error(*args: str) -> str:
    code, out, err = invoke(*args)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    return err


def show(url: str, delegation: str) -> dict[str, Any]:
    code, out, _ = invoke("show", delegation, "--journal", url, "--json")
    assert code == 0
    data: dict[str, Any] = json.loads(out)
    return data


def test_resolve_from_the_cli_records_who_decided_what_and_why(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    ring = tether.KeyRing.load(tmp_path / "keys")
    code, out, _ = invoke("resolve", stuck.action, "--as", "COMPLETED", "--by", "Ada",
                          "--note", "provider dashboard shows charge ch_42", "--journal", url)
    assert code == 0, out
    assert "RECONCILED" in out and "Ada" in out
    data = show(url, stuck.delegation)
    (action,) = data["actions"]
    assert action["state"] == "COMPLETED"
    assert data["delegations"][0]["state"] == "RECONCILED"
    (decision,) = data["decisions"]
    assert decision["operator"] == "Ada" and decision["key_id"] == ring.signer.key_id
    assert decision["note"] == "provider dashboard shows charge ch_42"
    assert decision["old"] == "UNKNOWN" and decision["outcome"] == "COMPLETED"
    assert decision["at"] > 0
    signed = [i for i in data["intents"] if i["kind"] == "RESOLUTION"]
    assert len(signed) == 1 and signed[0]["verified"] == "ok"
    assert signed[0]["body"]["operator"] == "Ada"
    _, text, _ = invoke("show", stuck.delegation, "--journal", url)
    assert "Ada" in text and "provider" in text and "ch_42" in text  # the note, folded
    assert "resolved" in text
    # Settled now: a second decision is refused, and changes nothing.
    one_line_error("resolve", stuck.action, "--as", "NOT_APPLIED", "--note", "oops",
                   "--journal", url)
    assert show(url, stuck.delegation)["decisions"] == data["decisions"]


def test_resolve_refuses_mistakes_with_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))  # its call may apply for 30 s
    before = show(url, stuck.delegation)
    assert "may still apply" in one_line_error(
        "resolve", stuck.action, "--as", "NOT_APPLIED", "--note", "not in the ledger",
        "--journal", url)
    assert "COMPLETED or NOT_APPLIED" in one_line_error(
        "resolve", stuck.action, "--as", "FAILED", "--note", "x", "--journal", url)
    assert "note" in one_line_error("resolve", stuck.action, "--as", "COMPLETED", "--note",
                                    " ", "--journal", url)
    assert "a_nobody" in one_line_error("resolve", "a_nobody", "--as", "COMPLETED", "--note",
                                        "x", "--journal", url)
    assert show(url, stuck.delegation) == before


async def test_a_later_receipt_that_contradicts_a_decision_is_kept_and_flagged(
        journal_url: str) -> None:
    # A deadline that passes soon after the call starts, yet not before its intent is
    # committed (a call whose deadline passed before dispatch is never made).
    stuck = await stuck_payment(journal_url, deadline=0.5)
    async with tether.Supervisor(journal_url, recover=False,
                                 policy=tether.Policy(clock_tolerance=1.0)) as sup:
        # "Not applied" only once the call can no longer apply (its deadline plus the clock
        # tolerance): wait (bounded) for that.
        deadline = (await sup.journal.action(stuck.action)).deadline_at
        assert deadline is not None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 5
        while sup.clock.wall() <= deadline + sup.policy.clock_tolerance:
            assert loop.time() < give_up
            await asyncio.sleep(0.005)
        action = await sup.resolve(stuck.action, "NOT_APPLIED", "not in the provider's ledger",
                                   operator="Grace")
        assert action.state is A.NOT_APPLIED
        assert (await sup.journal.get(stuck.delegation)).state is tether.DelegationState.RECONCILED
        # The executor's receipt turns up after all: the payment went through.
        sup.journal.finish_action(stuck.action, A.COMPLETED, sup.clock.wall(),
                                  result="ch_43")
        await sup.journal.flush()
        after = await sup.journal.action(stuck.action)
        assert after.state is A.COMPLETED and after.late and after.result == "ch_43"
        assert after.evidence is not None and after.evidence["resolution"]["operator"] == "Grace"
        row = await sup.journal.get(stuck.delegation)
        assert row.state is tether.DelegationState.NEEDS_ATTENTION
        kinds = [d["kind"] for d in await sup.journal.resolutions([stuck.delegation])]
        assert kinds == ["resolved", "resolution_contradicted"]
        # A person cannot undo the fact, but acknowledges it, and it settles again.
        with pytest.raises(tether.errors.UserError, match="cannot undo"):
            await sup.resolve(stuck.action, "NOT_APPLIED", "still think so", operator="Grace")
        await sup.resolve(stuck.action, "COMPLETED", "receipt ch_43 confirmed", operator="Ada")
        assert (await sup.journal.get(stuck.delegation)).state is \
            tether.DelegationState.RECONCILED
        decisions = await sup.journal.resolutions([stuck.delegation])
        assert [(d["kind"], d.get("operator")) for d in decisions] == [
            ("resolved", "Grace"), ("resolution_contradicted", None), ("resolved", "Ada")]


async def test_a_failure_receipt_after_a_completed_decision_is_kept(journal_url: str) -> None:
    stuck = await stuck_payment(journal_url)
    async with tether.Supervisor(journal_url, recover=False) as sup:
        await sup.resolve(stuck.action, "COMPLETED", "bank says paid", operator="Ada")
        sup.journal.finish_action(stuck.action, A.FAILED, sup.clock.wall(),
                                  error="card declined")
        await sup.journal.flush()
        assert (await sup.journal.action(stuck.action)).state is A.COMPLETED
        (_, flagged) = await sup.journal.resolutions([stuck.delegation])
        assert flagged["kind"] == "resolution_contradicted"
        assert flagged["new"] == "FAILED" and flagged["error"] == "card declined"
        row = await sup.journal.get(stuck.delegation)
        assert row.state is tether.DelegationState.NEEDS_ATTENTION


async def test_a_decision_signed_by_an_untrusted_key_is_refused(journal_url: str) -> None:
    stuck = await stuck_payment(journal_url)
    stranger = tether.KeyRing.ephemeral()
    async with tether.Journal(journal_url, create=False) as j:
        signed = stranger.signer.sign(Resolution(
            action_id=stuck.action, delegation_id=stuck.delegation, outcome=A.COMPLETED,
            note="trust me", operator="Mallory", issued_at=1.0))
        ring = tether.KeyRing.load(j.keys_dir)
        with pytest.raises(tether.errors.ControlRefused):
            await j.resolve(signed, ring.trusted, 2.0)
        assert (await j.action(stuck.action)).state is A.UNKNOWN
        assert await j.resolutions([stuck.delegation]) == []


def test_who_may_decide_what() -> None:
    # Nothing to decide for an action in flight or settled; "not applied" only past the
    # deadline; after a contradiction, only what the facts allow.
    assert judge_resolution(A.UNKNOWN, A.COMPLETED, tolerance=2, deadline_at=10, now=5) is None
    assert judge_resolution(A.IN_DOUBT, A.COMPLETED, tolerance=2, deadline_at=10, now=5) is None
    assert "may still apply" in str(judge_resolution(A.UNKNOWN, A.NOT_APPLIED,
                                                     tolerance=2, deadline_at=10, now=5))
    # The deadline was written on another clock: "not applied" only past it plus the tolerance.
    assert "may still apply" in str(judge_resolution(A.UNKNOWN, A.NOT_APPLIED, tolerance=2,
                                                     deadline_at=10, now=11))
    assert judge_resolution(A.UNKNOWN, A.NOT_APPLIED, tolerance=2, deadline_at=10,
                            now=12) is None
    assert "in flight" in str(judge_resolution(A.PENDING, A.COMPLETED, tolerance=2,
                                               deadline_at=0, now=1))
    assert "already settled" in str(judge_resolution(A.COMPLETED, A.COMPLETED,
                                                     tolerance=2, deadline_at=0, now=1))
    assert judge_resolution(A.COMPLETED, A.COMPLETED, tolerance=2, deadline_at=0, now=1,
                            contradicted=True) is None
    assert "cannot undo" in str(judge_resolution(A.COMPLETED, A.NOT_APPLIED, tolerance=2,
                                                 deadline_at=0, now=1, contradicted=True))
    assert "COMPLETED or NOT_APPLIED" in str(judge_resolution(A.UNKNOWN, A.FAILED,
                                                              tolerance=2, deadline_at=0, now=1))
    assert contradicts(A.NOT_APPLIED, A.COMPLETED) and contradicts(A.COMPLETED, A.FAILED)
    assert not contradicts(A.NOT_APPLIED, A.FAILED) and not contradicts(A.COMPLETED,
                                                                        A.COMPLETED)
    assert not contradicts(A.COMPLETED, A.UNKNOWN)


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


async def test_a_resolution_signed_by_an_untrusted_key_is_refused(
        journal_url: str, tmp_path: Path) -> None:
    """As for a recall (tests/test_trust.py), so for a person's decision: `keys init --keys
    OTHER` then `resolve --keys OTHER` recorded the decision (the caller's own pins were its
    trust) and re-settled the delegation, and `tether show` printed it as a signed operator's
    decision."""
    stuck = await stuck_payment(journal_url)
    other = str(tmp_path / "other")
    code, _, err = await tether_cli("keys", "init", "--journal", journal_url, "--keys", other)
    assert code == 0, err
    code, _, err = await tether_cli("resolve", stuck.action, "--as", "COMPLETED", "--note",
                                    "trust me", "--by", "mallory", "--journal", journal_url,
                                    "--keys", other)
    assert code == 2, err
    assert "not trusted" in one_error_line(err)
    async with tether.Journal(journal_url) as j:
        assert (await j.action(stuck.action)).state is tether.ActionState.UNKNOWN
        assert await j.resolutions([stuck.delegation]) == []


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


async def test_verify_accepts_a_trusted_operators_resolution(journal_url: str) -> None:
    """`tether verify` read every document that is not an acknowledgement as a no-effects
    receipt: after any legitimate `tether resolve`, it exited 1 naming the decision."""
    stuck = await stuck_payment(journal_url)
    code, _, err = await tether_cli("resolve", stuck.action, "--as", "COMPLETED", "--note",
                                    "bank statement", "--by", "alice", "--journal", journal_url)
    assert code == 0, err
    code, out, err = await tether_cli("verify", "--journal", journal_url, "--json")
    assert code == 0, out + err
    assert json.loads(out)["problems"] == []
