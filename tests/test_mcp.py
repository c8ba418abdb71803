"""The MCP gateway against real MCP servers over stdio: one built here with the SDK's server
API (tests/mcp_bank.py) and one published server from the registry (mcp-server-git). Effects
come from the operator's policy, then trusted annotations, else EXTERNAL (I1, I2, I3, I8)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.mcp_helpers import bank, connect, paid, probe_for
from tests.remote_agents import listen_gate, open_gate
from tether.mcp import ServerPolicy, mcp_tools

from .conftest import ONE_CLOCK, events_of, settled

ROOT = Path(__file__).resolve().parent.parent
E = tether.Effect


async def test_an_untrusted_servers_tools_are_external(bank_env: Path) -> None:
    async with bank() as session:
        tools = {t.name: t.effect for t in await mcp_tools(session, "bank")}
    # fail closed
    assert tools == {"bank.balance": E.EXTERNAL, "bank.pay": E.EXTERNAL, "bank.paid": E.EXTERNAL}


async def test_a_trusted_servers_annotations_are_used_unless_policy_says_otherwise(
        bank_env: Path) -> None:
    async with bank() as session:
        trusted = {t.name: t.effect for t in await mcp_tools(
            session, ServerPolicy("bank", trusted=True))}
        overridden = {t.name: t.effect for t in await mcp_tools(
            session, ServerPolicy("bank", trusted=True, effects={"pay": E.EXTERNAL}))}
    assert trusted == {"bank.balance": E.READ_ONLY, "bank.pay": E.IDEMPOTENT,
                       "bank.paid": E.READ_ONLY}
    assert overridden == {"bank.balance": E.READ_ONLY, "bank.pay": E.EXTERNAL,
                          "bank.paid": E.READ_ONLY}


async def test_a_policy_naming_a_tool_the_server_lacks_is_refused(bank_env: Path) -> None:
    async with bank() as session:
        with pytest.raises(tether.errors.UserError, match="does not offer: transfer"):
            await mcp_tools(session, ServerPolicy("bank", effects={"transfer": E.EXTERNAL}))


@pytest.mark.parametrize("kwargs", [{"name": ""}, {"name": "a b"}, {"name": "x", "trusted": 1},
                                    {"name": "x", "effects": {"pay": "EXTERNAL"}},
                                    {"name": "x", "effects": {"pay": E.DELEGATE}}])
def test_bad_policies_are_user_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(tether.errors.UserError):
        ServerPolicy(**kwargs)


async def test_recall_lets_an_in_flight_mcp_call_finish_and_refuses_the_next(
        bank_env: Path, journal_url: str) -> None:
    async with bank() as session, tether.Supervisor(journal_url) as sup:
        tools = {t.name: t for t in await mcp_tools(session, "bank")}

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(tools["bank.pay"], account="hold-1", cents=700)
            await ctx.call(tools["bank.pay"], account="B-2", cents=300)

        waiter = events_of(sup)
        started = await listen_gate("started")
        handle = await sup.delegate(agent, tools=list(tools.values()))
        assert await started == "hold-1"
        recall = asyncio.ensure_future(handle.recall(grace=30, reason="re-plan"))
        await waiter("drain", handle.id).wait()
        open_gate("release")
        report = await recall
    (action,) = report.actions
    assert (action.tool, action.state) == ("bank.pay", tether.ActionState.COMPLETED)
    # The server saw tether's idempotency key, so it can deduplicate a retry.
    assert paid(bank_env, "hold-1") == [(action.idempotency_key, 700)]
    assert paid(bank_env, "B-2") == []


async def test_terminate_sends_notifications_cancelled_and_reconciles(
        bank_env: Path, journal_url: str) -> None:
    async with bank() as session, tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        # The operator declares that the bank cannot apply a payment 1 s after its intent.
        tools = {t.name: t for t in await mcp_tools(
            session, ServerPolicy("bank", probes={"pay": probe_for(bank_env)},
                                  deadlines={"pay": 1.0}))}

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(tools["bank.pay"], account="hold-2", cents=900)

        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        handle = await sup.delegate(agent, tools=list(tools.values()))
        await started
        report = await handle.terminate(reason="stop")
        # The server's handler was cancelled by the client's notifications/cancelled; the
        # session itself stays open and usable.
        assert await cancelled == "hold-2"
        assert await tools["bank.balance"].fn(account="hold-2") == {"result": 0}
        if not report.outcome.terminal:  # probed within the deadline: "not applied yet"
            assert report.actions[0].state is tether.ActionState.IN_DOUBT
            report = await settled(sup, handle.id)
    (action,) = report.actions
    assert action.state is tether.ActionState.NOT_APPLIED
    assert action.evidence is not None and action.evidence["probe"] == "NOT_APPLIED"
    assert paid(bank_env, "hold-2") == []


async def test_an_error_result_is_in_doubt_and_probed(bank_env: Path, journal_url: str) -> None:
    """An isError result says the tool failed, not that nothing happened: here it had paid."""
    async with bank() as session, tether.Supervisor(journal_url) as sup:
        tools = {t.name: t for t in await mcp_tools(
            session, ServerPolicy("bank", probes={"pay": probe_for(bank_env)}))}

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(tools["bank.pay"], account="flaky-1", cents=400)

        handle = await sup.delegate(agent, tools=list(tools.values()))
        with pytest.raises(tether.DelegationError, match="replica timed out"):
            await handle.result()
        report = await handle.report()
    (action,) = report.actions
    assert action.state is tether.ActionState.COMPLETED  # the probe found the payment
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"
    assert paid(bank_env, "flaky-1") == [(action.idempotency_key, 400)]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    git(path, "config", "user.email", "agent@example.com")
    git(path, "config", "user.name", "agent")
    (path / "notes.txt").write_text("hello\n")
    return path


def git_server(repo: Path) -> Any:
    return connect(str(Path(sys.executable).parent / "mcp-server-git"), "--repository",
                   str(repo))


@pytest.mark.parametrize("trusted", [True, False])
async def test_a_published_server_from_the_registry_commits_through_the_gateway(
        repo: Path, journal_url: str, trusted: bool) -> None:
    """mcp-server-git, as installed from the package registry: a real commit, journaled."""
    async with git_server(repo) as session, tether.Supervisor(journal_url) as sup:
        tools = {t.name: t for t in await mcp_tools(session, ServerPolicy("git", trusted))}

        async def agent(ctx: tether.Context) -> str:
            await ctx.call(tools["git.git_status"], repo_path=str(repo))
            await ctx.call(tools["git.git_add"], repo_path=str(repo), files=["notes.txt"])
            result: str = await ctx.call(tools["git.git_commit"], repo_path=str(repo),
                                         message="first note")
            return result

        handle = await sup.delegate(agent, tools=list(tools.values()))
        await handle.result()
        report = await handle.report()
    expected = [("git.git_add", "IDEMPOTENT"), ("git.git_commit", "EXTERNAL")]
    if not trusted:  # every tool of an untrusted server is EXTERNAL, reads included
        expected = [("git.git_status", "EXTERNAL"), ("git.git_add", "EXTERNAL"),
                    ("git.git_commit", "EXTERNAL")]
    assert [(a.tool, a.effect.value) for a in report.actions] == expected
    assert all(a.state is tether.ActionState.COMPLETED for a in report.actions)
    assert git(repo, "log", "--format=%s") == "first note\n"
