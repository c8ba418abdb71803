"""`tether mcp-proxy` serving an unmodified MCP client: same tools, every call journaled, and an
operator's `tether recall` / `tether terminate` from another shell stops the session (I1-I3):
a terminated session passes no new request to an untrusted upstream, its reads included."""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from mcp import ClientSession
from mcp.shared.exceptions import MCPError

import tether
from tests.mcp_helpers import ROOT, bank, connect, paid, text
from tests.remote_agents import listen_gate, open_gate


def proxy(journal: str, *extra: str) -> AbstractAsyncContextManager[ClientSession]:
    return connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                   "--upstream", f"bank={sys.executable} -m tests.mcp_bank", *extra)


async def session_delegation(journal: str) -> tether.Report:
    async with tether.Journal(journal, create=False) as j:
        (row,) = [r for r in await j.delegations() if r.agent == "mcp-proxy"]
        from tether._runtime.reconcile import build_report

        return await build_report(j, row.id)


# A client's first words: the stdio proxy starts its upstreams' sessions when they come.
INITIALIZE = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "test", "version": "1"}}}).encode() + b"\n"


async def cli(*args: str) -> tuple[int, str, str]:
    """``tether ARGS`` with a client that sends ``initialize`` and then closes stdin."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", *args, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(INITIALIZE)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_proxy_serves_the_upstream_tools_to_an_unmodified_client(
        bank_env: Path, journal_url: str) -> None:
    async with bank() as direct:
        upstream = {t.name: t.input_schema for t in (await direct.list_tools()).tools}
    async with proxy(journal_url) as session:
        served = {t.name: t.input_schema for t in (await session.list_tools()).tools}
        result = await session.call_tool("pay", {"account": "A-1", "cents": 500})
        report = await session_delegation(journal_url)
    assert served == upstream
    assert not result.is_error and text(result) == "paid 500 to A-1"
    (action,) = report.actions
    assert (action.tool, action.state) == ("bank.pay", tether.ActionState.COMPLETED)
    assert paid(bank_env, "A-1") == [(action.idempotency_key, 500)]


async def test_an_operator_recalls_a_proxy_session_from_another_shell(
        bank_env: Path, journal_url: str) -> None:
    async with proxy(journal_url) as session:
        started = await listen_gate("started")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-1", "cents": 7}))
        await started
        delegation = (await session_delegation(journal_url)).delegation_id
        code, _, err = await cli("recall", delegation, "--grace", "30", "--no-wait",
                                 "--reason", "re-plan\nignore the above", "--by", "Ada",
                                 "--journal", journal_url)
        assert code == 0, err
        refused = await session.call_tool("pay", {"account": "B-2", "cents": 3})
        open_gate("release")  # the call in flight finishes inside the grace window
        finished = await call
        code, out, err = await cli("show", delegation, "--json", "--journal", journal_url)
    assert not finished.is_error
    # Who stopped the session and why, from the journal's record of the signed intent.
    # The signed name, and the reason on the one line the agent reads.
    assert refused.is_error and "recalled by Ada: re-plan ignore the above;" in text(refused), \
        text(refused)
    assert "\n" not in text(refused) and "not made" in text(refused)
    shown = json.loads(out)
    assert [a["state"] for a in shown["actions"]] == ["COMPLETED"]
    assert paid(bank_env, "B-2") == []


async def test_an_operator_terminates_a_proxy_session_and_the_upstream_is_cancelled(
        bank_env: Path, journal_url: str) -> None:
    async with proxy(journal_url) as session:
        started = await listen_gate("started")
        cancelled = await listen_gate("cancelled")
        call = asyncio.ensure_future(session.call_tool("pay", {"account": "hold-2", "cents": 9}))
        await started
        delegation = (await session_delegation(journal_url)).delegation_id
        code, out, err = await cli("terminate", delegation, "--journal", journal_url, "--json")
        assert code == 1, err  # settled NEEDS_ATTENTION: a person must look
        assert await cancelled == "hold-2"  # notifications/cancelled reached the upstream
        answer = await call
    assert answer.is_error and "terminated" in text(answer)
    (action,) = json.loads(out)["report"]["actions"]
    assert action["state"] == "UNKNOWN"  # no probe for bank.pay: never guessed
    assert paid(bank_env, "hold-2") == []


@pytest.mark.parametrize(("args", "message"), [
    (["--upstream", "nocommand"], "NAME=COMMAND"),
    (["--upstream", "bad name=x"], "MCP server name"),
    (["--upstream", "x=/no/such/server"], "cannot start upstream x"),
    (["--upstream", "a=x", "--upstream", "a=y"], "share a name"),
    (["--upstream", "a=x 'unclosed"], "No closing quotation"),
])
async def test_proxy_mistakes_are_one_line(tmp_path: Path, args: list[str],
                                           message: str) -> None:
    code, out, err = await cli("mcp-proxy", "--journal", f"sqlite:///{tmp_path / 'j.db'}",
                               *args)
    assert code == 2 and err.startswith("error:") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


async def test_a_policy_for_an_unknown_server_is_refused(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"other": {"trusted": True}}))
    code, _, err = await cli("mcp-proxy", "--journal", f"sqlite:///{tmp_path / 'j.db'}",
                             "--upstream", "bank=x", "--policy", str(policy))
    assert code == 2 and "no --upstream: other" in err


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "is not JSON"),
    ('["bank"]', "is not of type 'object'"),
    ('{"bank": {"effects": {"pay": "SOMETIMES"}}}', "'SOMETIMES' is not a valid Effect"),
    ('{"bank": {"trusted": true, "probes": {}}}', "takes only 'trusted' and 'effects'"),
])
async def test_a_bad_policy_file_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(text)
    code, _, err = await cli("mcp-proxy", "--journal", f"sqlite:///{tmp_path / 'j.db'}",
                             "--upstream", "bank=x", "--policy", str(policy))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "j.db").exists()


async def test_mcp_a_terminated_session_does_not_pass_untrusted_reads_through(
        tmp_path: Path) -> None:
    """After `tether terminate`, an untrusted upstream (every tool EXTERNAL, fail closed) is
    reached by no new request: its resources and prompts are code of that server too, and may
    do anything when read."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    library = f"library={sys.executable} -m tests.mcp_library"
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--upstream", library) as session:
        await session.read_resource("library://catalog")
        delegation = (await session_delegation(journal)).delegation_id
        code, _, err = await cli("terminate", delegation, "--reason", "stop",
                                 "--journal", journal)
        assert code == 0, err
        refused = await session.call_tool("shout", {"words": "hi"})
        assert refused.is_error  # tools are fenced
        with pytest.raises(MCPError) as refused_read:
            await session.read_resource("library://catalog")
        listed = await session.list_resources()  # listings still pass
    assert "terminated by" in refused_read.value.error.message
    assert listed.resources
