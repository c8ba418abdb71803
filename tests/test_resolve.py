"""A person's decision on an action nobody could settle: signed, journaled with who, why and
when; the delegation re-settled; a later fact that says otherwise kept and flagged."""

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
    stuck = await stuck_payment(journal_url, deadline=0.01)
    async with tether.Supervisor(journal_url, recover=False,
                                 policy=tether.Policy(clock_tolerance=0.05)) as sup:
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
        with pytest.raises(tether.UserError, match="cannot undo"):
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
        with pytest.raises(tether.ControlRefused):
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
