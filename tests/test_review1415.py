"""Adversarial review of the framework adapters and the MCP proxy: ways around the gateway
that each test shows closed (I1, I7, I8)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
from agents import Agent as SdkAgent
from agents import Runner, function_tool, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call
from mcp.shared.exceptions import MCPError

import tether
from tests.mcp_helpers import ROOT, connect, paid, text
from tests.test_mcp_proxy import cli, proxy, session_delegation
from tests.test_mcp_proxy_http import key_meta, serving
from tether.openai_agents import as_tether_agent, idempotency_key
from tether.testing import PaymentService

set_tracing_disabled(True)


async def test_a_tool_added_to_the_agent_after_planning_never_runs_unmediated(
        journal_url: str) -> None:
    pay = PaymentService(latency=0.0)

    @function_tool
    async def lookup(order_id: str) -> str:
        """Look an order up."""
        return f"order {order_id}"

    @function_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key() or "none")

    model = ScriptedModel([[function_call("refund", {"order_id": "A", "cents": 5},
                                          call_id="c1")], [assistant_message("done")]])
    sdk = SdkAgent(name="helper", tools=[lookup], model=model)
    agent = as_tether_agent(sdk)
    sdk.tools.append(refund)  # after tether planned the graph: it never saw this tool
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A")
        with contextlib.suppress(tether.TetherError):
            await handle.result()
        report = await handle.report()
    # Either refused, or journaled: never a refund the journal does not hold.
    assert pay.refund_count("A") == len([a for a in report.actions if a.tool == "refund"])


@pytest.mark.parametrize("sync", [False, True], ids=["async-tools", "sync-tools"])
async def test_an_agent_run_inside_a_tool_does_not_inherit_the_outer_key(
        journal_url: str, sync: bool) -> None:
    seen: list[str | None] = []

    def refund_sync(order_id: str) -> str:
        """Refund an order."""
        seen.append(idempotency_key())
        return f"refunded {order_id}"

    async def refund_async(order_id: str) -> str:
        """Refund an order."""
        return refund_sync(order_id)

    inner_model = ScriptedModel([
        [function_call("refund", {"order_id": "X"}, call_id="i1"),
         function_call("refund", {"order_id": "Y"}, call_id="i2")],
        [assistant_message("inner done")]])
    refund = function_tool(refund_sync if sync else refund_async, name_override="refund")
    inner = SdkAgent(name="inner", tools=[refund], model=inner_model)

    def batch_sync(orders: str) -> str:
        """Refund a batch by running the refund agent (not an as_tool sub-agent)."""
        seen.append(idempotency_key())
        return str(asyncio.run(Runner.run(inner, orders)).final_output)

    async def batch_async(orders: str) -> str:
        """Refund a batch by running the refund agent (not an as_tool sub-agent)."""
        seen.append(idempotency_key())
        return str((await Runner.run(inner, orders)).final_output)

    batch = function_tool(batch_sync if sync else batch_async, name_override="batch")
    model = ScriptedModel([[function_call("batch", {"orders": "X,Y"}, call_id="c1")],
                           [assistant_message("done")]])
    agent = as_tether_agent(SdkAgent(name="outer", tools=[batch], model=model))
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund X and Y")
        await handle.result()
    outer, *inner_keys = seen
    assert outer is not None and len(inner_keys) == 2  # the tool itself has its key
    # The inner refunds are not tether calls: they must not be handed the outer call's key
    # (the provider would deduplicate the second refund and lose it, as in issue 14 case 2).
    assert outer not in inner_keys, seen



async def test_mcp_a_retry_with_the_same_key_and_other_arguments_is_refused(
        bank_env: Path, journal_url: str) -> None:
    async with proxy(journal_url) as session:
        first = await session.call_tool("pay", {"account": "S-1", "cents": 3},
                                        meta=key_meta("order-9"))
        other = await asyncio.wait_for(session.call_tool(
            "pay", {"account": "S-1", "cents": 300}, meta=key_meta("order-9")), 30)
    assert not first.is_error
    assert other.is_error and "order-9" in text(other), text(other)  # the Stripe rule
    assert paid(bank_env, "S-1") == [("order-9", 3)]


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
        | {"PYTHONPATH": str(ROOT)},
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


async def test_mcp_http_on_any_loopback_address_refuses_a_foreign_host(
        bank_env: Path, tmp_path: Path) -> None:
    """DNS rebinding: a web page whose name resolves to the proxy's loopback address must not
    reach it. 127.0.0.2 is loopback (accepted by --http) like 127.0.0.1."""
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    async with serving(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--http", "127.0.0.2:0", "--upstream",
                       f"bank={sys.executable} -m tests.mcp_bank",
                       ready="serving MCP at") as lines:
        said = next(line for line in lines if "serving MCP at" in line)
        url = said.split("serving MCP at ")[1].split()[0]
        body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "page", "version": "1"}}}
        async with httpx2.AsyncClient() as web:
            answer = await web.post(url, json=body, headers={
                "Host": "rebound.example", "Origin": "http://rebound.example",
                "Accept": "application/json, text/event-stream"})
    assert answer.status_code in (421, 403), answer.status_code


def test_mcp_config_probes_do_not_shadow_modules_imported_later(tmp_path: Path) -> None:
    """A config's probe is imported from the file's folder; that folder must not go first on
    the import path for good, or any module the proxy imports later (uvicorn when serving
    HTTP, the SDK's lazy imports) is taken from the folder instead."""
    from tether._integrations.mcp_config import load_config

    (tmp_path / "myprobes.py").write_text("async def landed(**_):\n    return None\n")
    (tmp_path / "colorsys.py").write_text("SHADOWED = True\n")
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"bank": {
        "command": "true", "probes": {"pay": "myprobes:landed"}}}}))
    before = list(sys.path)
    saved = sys.modules.pop("colorsys", None)
    try:
        loaded = load_config(config)
        import colorsys

        assert not hasattr(colorsys, "SHADOWED")
    finally:
        sys.path[:] = before
        sys.modules.pop("colorsys", None)
        sys.modules.pop("myprobes", None)
        if saved is not None:
            sys.modules["colorsys"] = saved
    assert loaded.policies["bank"].probes["pay"].__name__ == "landed"


@pytest.mark.xfail(strict=True, reason="open finding: pydantic-ai's idempotency_key() is a "
                   "plain ContextVar, inherited by an agent run started inside a tool")
async def test_pydantic_ai_an_agent_run_inside_a_tool_does_not_inherit_the_outer_key(
        journal_url: str) -> None:
    from pydantic_ai import Agent as PaiAgent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from tether.pydantic_ai import as_tether_agent as pai_agent
    from tether.pydantic_ai import idempotency_key as pai_key

    def scripted(*responses: ModelResponse) -> FunctionModel:
        queue = list(responses)

        def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return queue.pop(0)

        return FunctionModel(respond)

    seen: list[str | None] = []
    inner: PaiAgent[None, str] = PaiAgent(scripted(
        ModelResponse(parts=[ToolCallPart("refund", {"order_id": "X"}),
                             ToolCallPart("refund", {"order_id": "Y"})]),
        ModelResponse(parts=[TextPart("inner done")])), name="inner")

    @inner.tool_plain
    async def refund(order_id: str) -> str:
        """Refund an order."""
        seen.append(pai_key())
        return f"refunded {order_id}"

    outer: PaiAgent[None, str] = PaiAgent(scripted(
        ModelResponse(parts=[ToolCallPart("batch", {"orders": "X,Y"})]),
        ModelResponse(parts=[TextPart("done")])), name="outer")

    @outer.tool_plain
    async def batch(orders: str) -> str:
        """Refund a batch by running the refund agent itself (not through delegate)."""
        seen.append(pai_key())
        return (await inner.run(orders)).output

    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(pai_agent(outer), "refund X and Y")
        await handle.result()
        report = await handle.report()
    first, *inner_keys = seen
    assert first is not None and len(inner_keys) == 2, (seen, report.actions)
    assert first not in inner_keys, seen


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
