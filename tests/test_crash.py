"""Crash: a supervisor killed with SIGKILL mid-payment; the next one reconciles (I3, I8)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

import tether
from tether.protocol import ControlIntent, ControlKind

ROOT = Path(__file__).resolve().parent.parent


async def killed_mid_payment(tmp_path: Path) -> tuple[str, str, dict[str, str]]:
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    env = {**os.environ, "TETHER_TEST_LEDGER": str(tmp_path / "ledger.db"),
           "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.crash_tools", journal, env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode().split()
    assert line[0] == "applied", line
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL
    return journal, line[1], env


async def test_next_supervisor_reconciles_a_dead_owners_delegation(
        tmp_path: Path) -> None:
    journal, delegation, env = await killed_mid_payment(tmp_path)
    os.environ["TETHER_TEST_LEDGER"] = env["TETHER_TEST_LEDGER"]
    try:
        sys.modules.pop("tests.crash_tools", None)
        from tests import crash_tools

        async with tether.Supervisor(journal, tools=crash_tools.tools) as sup:
            report = await sup.report(delegation)
    finally:
        del os.environ["TETHER_TEST_LEDGER"]
        sys.modules.pop("tests.crash_tools", None)
    (action,) = report.actions
    assert action.state is tether.ActionState.COMPLETED
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"
    assert report.outcome is tether.DelegationState.RECONCILED
    assert report.verdict == "RECOVERED"
    controls = await _controls(journal, delegation)
    assert [c["kind"] for c in controls] == ["TERMINATE"]


async def _controls(journal: str, delegation: str) -> list[dict[str, str]]:
    async with tether.Journal(journal, create=False) as j:
        return [{"kind": c.kind.value} for c in await j.controls(delegation)]


async def test_tether_reconcile_cli_uses_the_named_probes(tmp_path: Path) -> None:
    journal, delegation, env = await killed_mid_payment(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "reconcile", "--journal", journal,
        "--tools", "tests.crash_tools:tools", "--json", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    (report,) = json.loads(out)
    assert report["delegation"] == delegation
    assert report["outcome"] == "RECONCILED"
    assert report["completed"] == [report["actions"][0]["id"]]


async def test_reconcile_without_probes_says_unknown_never_guesses(tmp_path: Path) -> None:
    journal, delegation, env = await killed_mid_payment(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "reconcile", delegation, "--journal", journal, "--json",
        env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 1, err.decode()  # it found something a person must settle
    (report,) = json.loads(out)
    assert report["outcome"] == "NEEDS_ATTENTION"
    assert report["actions"][0]["state"] == "UNKNOWN"
    assert "no tool named 'refund'" in report["actions"][0]["evidence"]["reason"]


async def test_owner_with_an_expired_lease_is_fenced_and_reconciled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor that stops heartbeating (a paused VM) loses its delegations: the next one
    terminates and reconciles them, and the paused one's late actions are refused."""
    from tether.testing import PaymentService, VirtualClock

    clock = VirtualClock()
    pay = PaymentService(clock, latency=0.0)
    journal = f"sqlite:///{tmp_path / 'j.db'}"
    keys = tether.KeyRing.ephemeral()
    resume = asyncio.Event()
    refused: list[BaseException] = []

    @tether.tool(probe=pay.lookup)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

    async def agent(ctx: tether.Context) -> None:
        await resume.wait()  # paused here while the lease runs out
        try:
            await ctx.call(refund, order_id="P-1", cents=3)
        except BaseException as exc:
            refused.append(exc)
            raise

    # Paused: it polls for nothing (no heartbeat, no control rows others write) and hears no
    # wake-up until resumed, as a stopped process would.
    silent = tether.Journal(journal)
    monkeypatch.setattr(silent, "on_notify", lambda callback: False)
    async with tether.Supervisor(silent, clock=clock, keys=keys, control_poll=3600) as paused:
        child = await paused.delegate(agent, tools=[refund])
        clock.advance(paused.policy.lease + 1)
        async with tether.Supervisor(journal, clock=clock, keys=keys, tools=[refund]) as fresh:
            report = await fresh.report(child.id)
            assert report.verdict == "RECOVERED"
            assert report.outcome is tether.DelegationState.TERMINATED
        resume.set()
        await child.wait()
    assert isinstance(refused[0], tether.Fenced | tether.Recalled)
    assert pay.entries() == []


async def test_owner_dead_during_a_recall_is_settled_as_recalled(tmp_path: Path) -> None:
    """Found by `tether chaos`: the owner died after its recall was accepted, before the drain
    ended. Recovery must finish the recall (RECALLED), not force a forbidden TERMINATED."""
    from tether._journal.rows import NewDelegation, OwnerRow

    url = f"sqlite:///{tmp_path / 'j.db'}"
    keys = tether.KeyRing.ephemeral()
    async with tether.Journal(url) as journal:
        journal.seal_with(keys.signer, keys.trusted)  # the dead owner's key sealed its writes
        await journal.genesis(keys.signer, 0.0)
        await journal.register_owner(OwnerRow("o_gone", 0, "elsewhere", 0.0, 0.0))
        await journal.create_delegation(NewDelegation("d1", "t1", None, 1, "a", (), {},
                                                      "o_gone", 1.0))
        intent = ControlIntent(ControlKind.RECALL, "d1", 0, 1, 5.0, "r", 2.0)
        await journal.accept_control(keys.signer.sign(intent), keys.trusted, "o_gone", 2.0)
    async with tether.Supervisor(url, keys=keys) as sup:
        report = await sup.report("d1")
    assert report.outcome is tether.DelegationState.RECALLED
    assert report.verdict == "RECOVERED"
