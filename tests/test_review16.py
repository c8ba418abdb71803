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
from tether._core.model import ActionState, DelegationState

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
