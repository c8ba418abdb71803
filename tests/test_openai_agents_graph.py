"""The whole agent graph of an OpenAI Agents SDK run goes through tether: tools reached through
handoffs are mediated, ``Agent.as_tool`` sub-agents are nested delegations with their own keys
and fence, a tool tether cannot see is refused or makes the agent never re-dispatched (one
added to the agent after planning included), an agent run inside a tool does not inherit the
tool's key, and the SDK's own run options and stream stay the user's (I1, I6, I7, I8, I9,
I10)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx2
import pytest
from agents import Agent as SdkAgent
from agents import (
    RunConfig,
    RunHooks,
    Runner,
    WebSearchTool,
    function_tool,
    handoff,
    set_tracing_disabled,
)
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

import tether
from tether.openai_agents import as_tether_agent, idempotency_key
from tether.protocol import Code
from tether.testing import PaymentService

from .conftest import events_of

S = tether.DelegationState
A = tether.ActionState
set_tracing_disabled(True)


class Shop:
    def __init__(self) -> None:
        self.pay = PaymentService(latency=0.0)
        self.keys: list[str | None] = []
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()

        @function_tool
        async def refund(order_id: str, cents: int) -> str:
            """Refund an order."""
            key = idempotency_key()
            self.keys.append(key)
            self.started.set()
            if self.gate is not None:
                await self.gate.wait()
            if key is None:  # what a tool outside tether would do: no key to send
                key = f"unkeyed-{order_id}"
            return await self.pay.refund(order_id, cents, idempotency_key=key)

        self.refund = refund


def call(name: str, call_id: str, **args: Any) -> Any:
    return [function_call(name, args, call_id=call_id)]


def refund(order: str, call_id: str) -> Any:
    return call("refund", call_id, order_id=order, cents=500)


@pytest.fixture
def shop() -> Shop:
    return Shop()


async def test_a_handoff_targets_tools_go_through_the_gateway(shop: Shop,
                                                               sqlite_url: str) -> None:
    refunder = SdkAgent(name="refunder", tools=[shop.refund], model=ScriptedModel([
        refund("A", "c2"), [assistant_message("refunded A")]]))
    triage = SdkAgent(name="triage", handoffs=[refunder], model=ScriptedModel([
        call("transfer_to_refunder", "c1")]))
    child = as_tether_agent(triage, probes={"refund": shop.pay.lookup})
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, "refund A")
        assert await handle.result() == "refunded A"
        report = await handle.report()
    (action,) = report.actions
    assert (action.tool, action.state) == ("refund", A.COMPLETED)
    assert shop.keys == [action.idempotency_key] and action.idempotency_key is not None


async def test_recall_fences_a_handoff_target(shop: Shop, sqlite_url: str) -> None:
    shop.gate = asyncio.Event()
    refunder = SdkAgent(name="refunder", tools=[shop.refund], model=ScriptedModel([
        refund("A", "c2"), refund("B", "c3"), [assistant_message("done")]]))
    triage = SdkAgent(name="triage", handoffs=[handoff(refunder)], model=ScriptedModel([
        call("transfer_to_refunder", "c1")]))
    async with tether.Supervisor(sqlite_url) as sup:
        waiter = events_of(sup)
        handle = await sup.delegate(as_tether_agent(triage), "refund A then B")
        await shop.started.wait()
        recall = asyncio.ensure_future(handle.recall(grace=30))
        await waiter("drain", handle.id).wait()
        shop.gate.set()
        report = await recall
    assert report.outcome is S.RECALLED
    assert [(a.args["order_id"], a.state) for a in report.actions] == [("A", A.COMPLETED)]
    assert shop.pay.refund_count("B") == 0


async def test_agents_that_hand_off_to_each_other_share_one_delegation(
        shop: Shop, sqlite_url: str) -> None:
    triage = SdkAgent(name="triage", model=ScriptedModel([
        call("transfer_to_refunder", "c1"), [assistant_message("refunded, back at triage")]]))
    refunder = SdkAgent(name="refunder", tools=[shop.refund], handoffs=[triage],
                        model=ScriptedModel([refund("A", "c2"), call("transfer_to_triage", "c3")]))
    triage.handoffs = [refunder]
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(triage), "refund A")
        assert await handle.result() == "refunded, back at triage"
        report = await handle.report()
    assert [(a.tool, a.state) for a in report.actions] == [("refund", A.COMPLETED)]
    assert report.children == ()


def test_a_handoff_to_a_tool_tether_cannot_mediate_is_refused(shop: Shop) -> None:
    searcher = SdkAgent(name="searcher", tools=[WebSearchTool()], model=ScriptedModel([]))
    triage = SdkAgent(name="triage", tools=[shop.refund], handoffs=[searcher],
                      model=ScriptedModel([]))
    with pytest.raises(tether.errors.UserError, match=r"web_search.*triage -> searcher"):
        as_tether_agent(triage)
    # Granted on purpose, by name: allowed, and then never re-dispatched (see below).
    as_tether_agent(triage, unmediated=["web_search"])


def test_an_mcp_server_on_the_agent_is_refused(shop: Shop) -> None:
    class Server:
        name = "bank"

    agent = SdkAgent(name="a", tools=[shop.refund], model=ScriptedModel([]))
    agent.mcp_servers = [Server()]  # type: ignore[list-item]
    with pytest.raises(tether.errors.UserError, match="MCP server bank"):
        as_tether_agent(agent)


def nested(shop: Shop, inner_steps: list[Any], outer_steps: list[Any]) -> SdkAgent[Any]:
    refunder = SdkAgent(name="refunder", tools=[shop.refund],
                        model=ScriptedModel(inner_steps))
    return SdkAgent(name="manager", model=ScriptedModel(outer_steps), tools=[
        refunder.as_tool("refund_agent", "Refunds orders.")])


async def test_an_as_tool_sub_agent_is_a_nested_delegation_with_its_own_keys(
        shop: Shop, sqlite_url: str) -> None:
    manager = nested(
        shop, [refund("A", "i1"), refund("B", "i2"), [assistant_message("A and B refunded")]],
        [call("refund_agent", "o1", input="refund A and B"), [assistant_message("all done")]])
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(manager), "refund A and B")
        assert await handle.result() == "all done"
        report = await handle.report()
    assert report.actions == ()  # the manager itself ran no tool: its sub-agent did
    (sub,) = report.children
    assert sub.agent == "refunder" and sub.outcome is S.SUCCEEDED
    keys = [a.idempotency_key for a in sub.actions]
    assert [a.args["order_id"] for a in sub.actions] == ["A", "B"]
    assert len(set(keys)) == 2 and shop.keys == keys
    assert shop.pay.refund_count("A") == 1 and shop.pay.refund_count("B") == 1


async def test_recalling_the_root_fences_its_nested_sub_agent(shop: Shop,
                                                               sqlite_url: str) -> None:
    shop.gate = asyncio.Event()
    manager = nested(
        shop, [refund("A", "i1"), refund("B", "i2"), [assistant_message("done")]],
        [call("refund_agent", "o1", input="refund A and B"), [assistant_message("done")]])
    async with tether.Supervisor(sqlite_url) as sup:
        waiter = events_of(sup)
        handle = await sup.delegate(as_tether_agent(manager), "refund A and B")
        await shop.started.wait()
        recall = asyncio.ensure_future(handle.recall(grace=30))
        await waiter("drain", handle.id).wait()
        shop.gate.set()
        report = await recall
    (sub,) = report.children
    assert [(a.args["order_id"], a.state) for a in sub.actions] == [("A", A.COMPLETED)]
    assert shop.pay.refund_count("B") == 0 and shop.keys == [sub.actions[0].idempotency_key]


async def test_a_surface_with_an_unmediated_tool_is_never_re_dispatched(
        shop: Shop, sqlite_url: str) -> None:
    """No journaled tool ran, but web_search runs where tether cannot see it: "no tool ran"
    is unprovable, so the cut attempt is not re-run."""
    agent = SdkAgent(name="researcher", tools=[shop.refund, WebSearchTool()],
                     model=ScriptedModel([
                         ModelStep.raise_error(httpx2.ConnectError("refused")),
                         [assistant_message("never reached")]]))
    child = as_tether_agent(agent, unmediated=["web_search"])
    async with tether.Supervisor(sqlite_url) as sup:
        # refund is listed as retry-safe: only the unseen web_search stands in the way
        policy = tether.RedispatchPolicy(retry_safe=frozenset({"refund"}), settle_delay=0.001)
        handle = await sup.delegate(child, "look it up", redispatch=policy)
        with pytest.raises(tether.DelegationError):
            await handle.result()
        events = await sup.journal.events(handle.attempts)
    assert len(handle.attempts) == 1
    codes = [e.detail["code"] for e in events if e.kind == "redispatch_decision"]
    assert codes == [Code.UNKNOWN_TOOL.value]


def test_no_tool_ran_is_unprovable_when_a_reachable_tool_is_granted_by_name() -> None:
    from tether._core.redispatch import AttemptFacts, Ending, decide_redispatch

    def decide(surface: tuple[str, ...], agents: dict[str, tuple[str, ...]]) -> Code:
        return decide_redispatch(AttemptFacts(
            ending=Ending.STREAM_CUT, partial_usable=False, attempt=1, side_effects_started=0,
            tools_ran=0, surface=surface, agents=agents, known_tools=frozenset({"refund"}),
            generation_at_start=0, generation_now=0), tether.RedispatchPolicy()).code

    assert decide(("refund",), {}) is Code.REDISPATCH_NO_TOOL_RAN
    assert decide(("refund", "web_search"), {}) is Code.TOOL_NOT_RETRY_SAFE
    assert decide(("agent:sub",), {"sub": ("web_search",)}) is \
        Code.DELEGATE_REACHES_UNSAFE


async def test_run_options_input_items_and_the_stream_are_the_users(
        shop: Shop, sqlite_url: str) -> None:
    seen: list[str] = []
    tools_started: list[str] = []

    class Hooks(RunHooks[Any]):
        async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
            tools_started.append(tool.name)

    @function_tool
    async def whoami(ctx: Any) -> str:
        """The caller's account."""
        return str(ctx.context["account"])

    agent = SdkAgent(name="a", tools=[whoami], model=ScriptedModel([
        call("whoami", "c1"), [assistant_message("you are acct-7")]]))
    child = as_tether_agent(
        agent, effects={"whoami": tether.Effect.READ_ONLY}, context={"account": "acct-7"},
        hooks=Hooks(), run_config=RunConfig(workflow_name="refunds"),
        on_event=lambda event: seen.append(event.type))
    items = [{"role": "user", "content": "who am I?"}]
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, items)
        assert await handle.result() == "you are acct-7"
    assert tools_started == ["whoami"]
    assert "run_item_stream_event" in seen and "raw_response_event" in seen


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
    # (the provider would deduplicate the second refund and lose it).
    assert outer not in inner_keys, seen
