"""`tether mcp-proxy` is honest about each call (I3, I8): an upstream's refusal is not a false
alarm, an error result reaches the client as the upstream wrote it, a call the client cancels
is cancelled upstream and reconciled, progress reaches the client, and a completion that
arrives after a recall's grace window settles the session's accounting."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from mcp.shared.exceptions import MCPError

import tether
from tests.mcp_helpers import bank, paid, text
from tests.remote_agents import listen_gate, open_gate
from tests.test_mcp_proxy import cli, proxy, session_delegation

A = tether.ActionState


async def test_a_call_the_upstream_refuses_before_running_is_failed_not_in_doubt(
        bank_env: Path, journal_url: str) -> None:
    async with bank() as direct:
        with pytest.raises(MCPError) as refused_direct:
            await direct.call_tool("pay", {"account": "closed-1", "cents": 5})
    async with proxy(journal_url) as session:
        with pytest.raises(MCPError) as refused:
            await session.call_tool("pay", {"account": "closed-1", "cents": 5})
    # The client gets the upstream's JSON-RPC error as it was: code, message and data.
    assert refused.value.error == refused_direct.value.error
    report = await session_delegation(journal_url)
    (action,) = report.actions
    assert action.state is A.FAILED  # certainly not applied: no probe, no person needed
    assert report.outcome is tether.DelegationState.SUCCEEDED


async def test_an_error_result_reaches_the_client_unchanged_and_stays_in_doubt(
        bank_env: Path, journal_url: str) -> None:
    async with bank() as direct:
        expected = await direct.call_tool("pay", {"account": "flaky-0", "cents": 5})
    async with proxy(journal_url) as session:
        got = await session.call_tool("pay", {"account": "flaky-1", "cents": 5})
        during = await session_delegation(journal_url)
    report = await session_delegation(journal_url)
    assert got.is_error and got.content == expected.content  # no prefix added by tether
    assert text(got) == "Error executing tool pay: ledger replica timed out"
    assert during.actions[0].state is A.IN_DOUBT
    (action,) = report.actions  # settled when the session ended
    assert action.state is A.UNKNOWN  # it had applied; without a probe, never guessed


async def test_a_call_the_client_cancels_is_cancelled_upstream_and_never_completed(
        bank_env: Path, journal_url: str) -> None:
    async with proxy(journal_url) as session:
        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-3", "cents": 9}))
        await started
        call.cancel()  # the SDK sends notifications/cancelled to the proxy
        assert await asyncio.wait_for(cancelled, 30) == "hold-3"  # and it reached the bank
        # The session goes on: the next call runs as usual.
        after = await session.call_tool("pay", {"account": "A-9", "cents": 1})
        assert not after.is_error
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            report = await session_delegation(journal_url)
            first = report.actions[0]
            if first.state is not A.PENDING or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
    assert [a.state for a in report.actions] == [A.UNKNOWN, A.COMPLETED]  # no probe: UNKNOWN
    assert first.evidence is not None and "no probe" in str(first.evidence)
    assert paid(bank_env, "hold-3") == []


async def test_progress_notifications_reach_the_client(bank_env: Path, tmp_path: Path) -> None:
    seen: list[tuple[float, float | None, str | None]] = []
    direct_seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    async def on_direct(progress: float, total: float | None, message: str | None) -> None:
        direct_seen.append((progress, total, message))

    async with bank() as direct:
        await direct.call_tool("paid", {"account": "A-1"}, progress_callback=on_direct)
    async with proxy(f"sqlite:///{tmp_path / 'j.db'}") as session:
        result = await session.call_tool("paid", {"account": "A-1"},
                                         progress_callback=on_progress)
    assert not result.is_error
    assert seen == direct_seen == [(1.0, 3.0, "step 1"), (2.0, 3.0, "step 2"),
                                   (3.0, 3.0, "step 3")]


async def test_a_late_receipt_after_a_recall_settles_the_session(
        bank_env: Path, journal_url: str) -> None:
    """A recall whose in-flight call outlasts grace: UNKNOWN at the window's end, then the
    call's own receipt settles it, and the session with it; the next call says who recalled."""
    async with proxy(journal_url) as session:
        started = await listen_gate("started")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-4", "cents": 4}))
        await started
        delegation = (await session_delegation(journal_url)).delegation_id
        code, out, err = await cli("recall", delegation, "--grace", "0.5", "--reason",
                                   "budget cut", "--json", "--journal", journal_url)
        assert code == 1, err  # NEEDS_ATTENTION at the window's end: not settled (exit 1)
        at_window_end = json.loads(out)["report"]
        open_gate("release")  # the call finishes after the window: a late receipt
        finished = await call
        refused = await session.call_tool("pay", {"account": "B-4", "cents": 1})
    assert [a["state"] for a in at_window_end["actions"]] == ["UNKNOWN"]
    assert at_window_end["outcome"] == "NEEDS_ATTENTION"
    assert not finished.is_error
    report = await session_delegation(journal_url)
    (action,) = report.actions
    assert action.state is A.COMPLETED and action.late
    assert report.outcome is tether.DelegationState.RECONCILED
    assert refused.is_error and "recalled by cli:" in text(refused)
    assert "budget cut" in text(refused)
    assert paid(bank_env, "hold-4") == [(action.idempotency_key, 4)]
    assert paid(bank_env, "B-4") == []
