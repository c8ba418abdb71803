"""`tether mcp-proxy` is honest about each call (I3, I8): an upstream's refusal is not a false
alarm, an error result reaches the client as the upstream wrote it, a call the client cancels
is cancelled upstream and reconciled, progress reaches the client, a completion that arrives
after a recall's grace window settles the session's accounting, and a call after the upstream
died is not one more call in doubt. A client's idempotency key is used or refused, never
ignored: a retry with other arguments is refused, a retry of a call in doubt is told so in a
tool error, a malformed key is refused (I7)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import types as mcp_types
from mcp.shared.exceptions import MCPError

import tether
from tests.mcp_helpers import PYTHONPATH, ROOT, bank, connect, paid, text
from tests.remote_agents import listen_gate, open_gate
from tests.test_mcp_proxy import cli, proxy, session_delegation
from tests.test_mcp_proxy_http import key_meta

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
    assert refused.is_error and "recalled by " in text(refused)
    assert "budget cut" in text(refused)
    assert paid(bank_env, "hold-4") == [(action.idempotency_key, 4)]
    assert paid(bank_env, "B-4") == []


async def test_mcp_a_retry_with_the_same_key_and_other_arguments_is_refused(
        bank_env: Path, journal_url: str) -> None:
    async with proxy(journal_url) as session:
        first = await session.call_tool("pay", {"account": "S-1", "cents": 3},
                                        meta=key_meta("order-9"))
        other = await asyncio.wait_for(session.call_tool(
            "pay", {"account": "S-1", "cents": 300}, meta=key_meta("order-9")), 30)
    assert not first.is_error
    assert other.is_error and "order-9" in text(other), text(other)  # the Stripe rule
    assert paid(bank_env, "S-1") == [("client:order-9", 3)]


async def test_mcp_a_retry_of_a_call_in_doubt_gets_a_tool_error_not_a_code_0(
        bank_env: Path, tmp_path: Path) -> None:
    """The upstream answered isError (applied, then failed): the client retries with the same
    key, as a client should. Past the call's deadline, with no probe, the key is a person's to
    reconcile: the client is told so in a tool error result, as for every other tether refusal,
    not with a JSON-RPC error of code 0 (not a JSON-RPC code at all)."""
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"bank": {
        "command": sys.executable, "args": ["-m", "tests.mcp_bank"],
        "env": {k: v for k, v in os.environ.items() if k.startswith("TETHER_TEST_")}
        | {"PYTHONPATH": PYTHONPATH},
        "cwd": str(ROOT), "deadlines": {"pay": 1}}}}))
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--config", str(config)) as session:
        first = await session.call_tool("pay", {"account": "flaky-2", "cents": 4},
                                        meta=key_meta("order-10"))
        assert first.is_error
        again = await asyncio.wait_for(session.call_tool(
            "pay", {"account": "flaky-2", "cents": 4}, meta=key_meta("order-10")), 30)
    assert again.is_error and "order-10" in text(again) and "reconciled" in text(again)


async def test_arguments_the_tools_input_schema_refuses_are_refused_before_journaling(
        bank_env: Path, journal_url: str) -> None:
    """A call whose arguments its tool's own inputSchema rejects is an invalid-params refusal,
    with nothing journaled: sent, the server's refusal left it in doubt and a person asked."""
    async with proxy(journal_url) as session:
        for bad in ({"account": "S-1", "cents": "two"}, {"account": "S-1"},
                    {"account": 7, "cents": 1}):
            with pytest.raises(MCPError) as refused:
                await session.call_tool("pay", bad)
            assert refused.value.error.code == mcp_types.INVALID_PARAMS, refused.value.error
            assert refused.value.error.message.startswith("tether mcp-proxy: pay: at ")
        ok = await session.call_tool("pay", {"account": "S-1", "cents": 2})
    assert not ok.is_error
    report = await session_delegation(journal_url)
    assert [a.state for a in report.actions] == [A.COMPLETED]  # only the good call
    assert report.outcome is tether.DelegationState.SUCCEEDED
    assert len(paid(bank_env, "S-1")) == 1


async def test_mcp_a_malformed_client_key_is_refused_not_ignored(
        bank_env: Path, journal_url: str) -> None:
    """A client that sends a key tether cannot use (a number, an empty or a huge string) meant
    to make its retries safe: ignoring it would pay a retry twice."""
    async with proxy(journal_url) as session:
        for bad in (12, "", "k" * 256):
            meta: Any = {"io.tether/idempotency-key": bad}
            with pytest.raises(MCPError) as refused:
                await session.call_tool("pay", {"account": "K-1", "cents": 1}, meta=meta)
            assert "idempotency-key" in refused.value.error.message
    assert paid(bank_env, "K-1") == []


DYING = '''
import os
from mcp.server.mcpserver import MCPServer

server = MCPServer("dying")


@server.tool()
async def charge(cents: int) -> str:
    with open(os.environ["DYING_LEDGER"], "a") as ledger:
        ledger.write(f"{cents}\\n")
    os._exit(1)  # applied, then the server dies before it answers


if __name__ == "__main__":
    server.run()
'''


async def test_mcp_a_call_after_the_upstream_died_is_not_a_false_alarm(tmp_path: Path) -> None:
    """The call during which the upstream died is in doubt (it applied); the next call was
    certainly never sent: FAILED, not one more UNKNOWN for a person to reconcile."""
    server, ledger = tmp_path / "dying.py", tmp_path / "ledger"
    server.write_text(DYING)
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--upstream", f"d={sys.executable} {server}",
                       env={"DYING_LEDGER": str(ledger)}) as session:
        with pytest.raises(MCPError):
            await session.call_tool("charge", {"cents": 5})
        after = await session.call_tool("charge", {"cents": 6})
        async with tether.Journal(journal, create=False) as j:
            (row,) = await j.delegations()
            actions = await j.actions([row.id])
    assert after.is_error and "not sent" in text(after)
    assert ledger.read_text() == "5\n"
    assert [(a.args["cents"], a.state) for a in actions] == [
        (5, tether.ActionState.IN_DOUBT), (6, tether.ActionState.FAILED)]


def test_a_schema_that_cannot_judge_leaves_the_arguments_to_the_server() -> None:
    """An invalid schema, or one whose $ref cannot be resolved (never fetched), checks nothing:
    the call goes on and its server judges it; a valid one names what is missing."""
    from tether._integrations.mcp_gateway import argument_error

    def spec(schema: dict[str, Any]) -> mcp_types.Tool:
        return mcp_types.Tool(name="t", input_schema=schema)

    unresolvable = {"type": "object", "properties": {"a": {"$ref": "https://x.invalid/s"}}}
    assert argument_error(spec(unresolvable), {"a": 1}) is None
    assert argument_error(spec({"type": "object", "properties": {"a": {"type": "no"}}}),
                          {"a": 1}) is None
    required = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert argument_error(spec(required), {}) == "t: at the arguments: 'a' is a required property"
    assert argument_error(spec(required), {"a": 3}) is None
