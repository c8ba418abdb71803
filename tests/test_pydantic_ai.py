"""pydantic-ai specifics beyond the conformance kit: ModelRetry did not apply (FAILED), a run
the application cancels is a ceiling (never re-dispatched), toolsets tether cannot mediate are
refused, prefixed, renamed and dynamic toolsets are mediated under the names the model sees, a
structured output is stored as its JSON and rebuilt as its model, the agent's own tools and
dependencies reach the run, and an agent run inside a tool does not inherit the tool's key (a
sync tool has its own, in pydantic-ai's worker thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, computed_field, field_validator
from pydantic.alias_generators import to_camel
from pydantic_ai import Agent as PaiAgent
from pydantic_ai import ModelRetry, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import ExternalToolset, FunctionToolset

import tether
from tether.conformance import Shop
from tether.pydantic_ai import as_tether_agent, delegate, idempotency_key

from .conftest import events_of, settled

A = tether.ActionState


def scripted(*responses: ModelResponse) -> FunctionModel:
    queue = list(responses)

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return queue.pop(0)

    return FunctionModel(respond)


def refund_call(order: str, cents: int = 500) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart("refund", {"order_id": order, "cents": cents})])


async def test_model_retry_did_not_apply(sqlite_url: str) -> None:
    shop = Shop()
    agent = PaiAgent(scripted(refund_call("A", 0), refund_call("A", 500),
                              ModelResponse(parts=[TextPart("refunded")])), name="refunder")

    @agent.tool_plain
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        if cents <= 0:
            raise ModelRetry("cents must be positive")
        return await shop.refund(order_id, cents, idempotency_key())

    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent, probes={"refund": shop.pay.lookup}),
                                    "refund A")
        assert await handle.result() == "refunded"
        report = await handle.report()
    assert [(a.args["cents"], a.state) for a in report.actions] == [
        (0, A.FAILED), (500, A.COMPLETED)]
    assert shop.pay.refund_count("A") == 1


async def test_a_run_the_application_cancels_is_never_re_dispatched(sqlite_url: str) -> None:
    agent: PaiAgent[None, str] = PaiAgent(
        scripted(ModelResponse(parts=[ToolCallPart("stop", {})]),
                 ModelResponse(parts=[TextPart("never")])), name="stopper")

    @agent.tool
    async def stop(ctx: RunContext[None]) -> str:
        """Give up."""
        ctx.cancel()
        return "stopping"

    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent, effects={
            "stop": tether.Effect.READ_ONLY}), "go",
            redispatch=tether.RedispatchPolicy(settle_delay=0.001))
        with pytest.raises(tether.DelegationError, match="RunCancelled"):
            await handle.result()
        events = await sup.journal.events(handle.attempts)
    assert len(handle.attempts) == 1
    assert [e.detail["code"] for e in events if e.kind == "redispatch_decision"] == [
        tether.protocol.Code.CEILING.value]


def test_a_toolset_tether_cannot_mediate_is_refused() -> None:
    agent = PaiAgent(scripted(), name="a", toolsets=[ExternalToolset([])])
    with pytest.raises(tether.errors.UserError, match="cannot mediate toolset ExternalToolset"):
        as_tether_agent(agent)
    with pytest.raises(tether.errors.UserError, match="no tool named wire"):
        as_tether_agent(PaiAgent(scripted(), name="b"), effects={"wire": tether.Effect.EXTERNAL})


async def test_deps_and_events_reach_the_run(sqlite_url: str) -> None:
    agent: PaiAgent[dict[str, str], str] = PaiAgent(
        scripted(ModelResponse(parts=[ToolCallPart("whoami", {})]),
                 ModelResponse(parts=[TextPart("you are acct-7")])),
        name="a", deps_type=dict)
    nodes: list[Any] = []

    @agent.tool
    async def whoami(ctx: RunContext[dict[str, str]]) -> str:
        """The caller's account."""
        return ctx.deps["account"]

    child = as_tether_agent(agent, effects={"whoami": tether.Effect.READ_ONLY},
                            deps={"account": "acct-7"}, on_event=nodes.append)
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, "who am I?")
        assert await handle.result() == "you are acct-7"
    assert len(nodes) >= 3


async def test_pydantic_ai_an_agent_run_inside_a_tool_does_not_inherit_the_outer_key(
        journal_url: str) -> None:
    seen: list[str | None] = []
    inner: PaiAgent[None, str] = PaiAgent(scripted(
        ModelResponse(parts=[ToolCallPart("refund", {"order_id": "X"}),
                             ToolCallPart("refund", {"order_id": "Y"})]),
        ModelResponse(parts=[TextPart("inner done")])), name="inner")

    @inner.tool_plain
    async def refund(order_id: str) -> str:
        """Refund an order."""
        seen.append(idempotency_key())
        return f"refunded {order_id}"

    outer: PaiAgent[None, str] = PaiAgent(scripted(
        ModelResponse(parts=[ToolCallPart("batch", {"orders": "X,Y"})]),
        ModelResponse(parts=[TextPart("done")])), name="outer")

    @outer.tool_plain
    async def batch(orders: str) -> str:
        """Refund a batch by running the refund agent itself (not through delegate)."""
        seen.append(idempotency_key())
        return (await inner.run(orders)).output

    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(as_tether_agent(outer), "refund X and Y")
        await handle.result()
        report = await handle.report()
    first, *inner_keys = seen
    assert first is not None and len(inner_keys) == 2, (seen, report.actions)
    assert first not in inner_keys, seen


async def test_pydantic_ai_a_sync_tool_has_its_key_and_an_inner_sync_tool_has_none(
        journal_url: str) -> None:
    """A sync tool runs in pydantic-ai's worker thread: it gets its own call's key there; a sync
    tool of an agent run inside an async tool (another worker thread) gets none."""
    seen: dict[str, str | None] = {}
    inner: PaiAgent[None, str] = PaiAgent(scripted(
        ModelResponse(parts=[ToolCallPart("refund", {"order_id": "X"})]),
        ModelResponse(parts=[TextPart("inner done")])), name="inner")

    @inner.tool_plain
    def refund(order_id: str) -> str:
        """Refund an order."""
        seen["inner"] = idempotency_key()
        return f"refunded {order_id}"

    outer: PaiAgent[None, str] = PaiAgent(scripted(
        ModelResponse(parts=[ToolCallPart("note", {"text": "hi"}),
                             ToolCallPart("batch", {"orders": "X"})]),
        ModelResponse(parts=[TextPart("done")])), name="outer")

    @outer.tool_plain
    def note(text: str) -> str:
        """Write a note (sync: runs in a worker thread)."""
        seen["note"] = idempotency_key()
        return "noted"

    @outer.tool_plain
    async def batch(orders: str) -> str:
        """Run the refund agent itself."""
        seen["batch"] = idempotency_key()
        return (await inner.run(orders)).output

    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(as_tether_agent(outer), "note and refund")
        await handle.result()
    assert seen["note"] is not None and seen["batch"] is not None, seen
    assert seen["note"] != seen["batch"] and seen["inner"] is None, seen


class Receipt(BaseModel):
    order_id: str
    cents: int
    at: datetime.datetime


class Lossy(BaseModel):
    order_id: str
    note: str = Field(default="", exclude=True)  # left out of its JSON


def receipt_call(**fields: Any) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart("final_result", fields)])


def refunding(shop: Shop, *responses: ModelResponse, output_type: Any = str,
              ) -> PaiAgent[None, Any]:
    agent: PaiAgent[None, Any] = PaiAgent(scripted(*responses), name="refunder",
                                          output_type=output_type)

    @agent.tool_plain
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        return await shop.refund(order_id, cents, idempotency_key())

    return agent


async def test_pydantic_ai_structured_output_is_stored_as_its_json_and_rebuilt(
        journal_url: str) -> None:
    shop = Shop()
    at = "2026-01-02T03:04:05Z"
    agent = refunding(shop, refund_call("A"),
                      receipt_call(order_id="A", cents=500, at=at), output_type=Receipt)
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent, probes={"refund": shop.pay.lookup}),
                                    "refund A")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
        report = await handle.report()
    assert isinstance(result, Receipt)
    assert result == Receipt(order_id="A", cents=500, at=datetime.datetime(
        2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC))
    assert row.state is tether.DelegationState.SUCCEEDED
    assert row.result == result.model_dump(mode="json")  # pydantic's JSON, in the journal
    assert [a.state for a in report.actions] == [A.COMPLETED]


async def test_pydantic_ai_an_output_whose_json_loses_a_field_is_refused_by_name(
        sqlite_url: str) -> None:
    shop = Shop()
    agent = refunding(shop, refund_call("A"),
                      receipt_call(order_id="A", note="kept only in memory"), output_type=Lossy)
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent), "refund A")
        with pytest.raises(tether.DelegationError,
                           match=r"result of refunder cannot be stored: its JSON .* does not "
                                 r"give back the Lossy"):
            await handle.result()
        report = await handle.report()
    assert [a.state for a in report.actions] == [A.COMPLETED]  # accounted for all the same


def shop_tools(shop: Shop) -> FunctionToolset[None]:
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order."""
        return await shop.refund(order_id, cents, idempotency_key())

    return FunctionToolset([refund])


@pytest.mark.parametrize("how", ["prefixed", "renamed", "dynamic"])
async def test_pydantic_ai_renamed_and_dynamic_toolsets_are_mediated_as_the_model_sees_them(
        how: str, sqlite_url: str) -> None:
    """Journaled, keyed and probed under the name the model calls: the tool raises after the
    provider applied it, and its probe (keyed by that name) finds it COMPLETED."""
    shop = Shop(fail=RuntimeError("reply lost"))
    name = {"prefixed": "ts_refund", "renamed": "give_back", "dynamic": "refund"}[how]
    call = ModelResponse(parts=[ToolCallPart(name, {"order_id": "A", "cents": 500})])
    if how == "dynamic":
        agent: PaiAgent[None, str] = PaiAgent(
            scripted(call, ModelResponse(parts=[TextPart("done")])), name="a")

        @agent.toolset
        def tools(ctx: RunContext[None]) -> FunctionToolset[None]:
            return shop_tools(shop)
    else:
        toolset = shop_tools(shop)
        wrapped = (toolset.prefixed("ts") if how == "prefixed"
                   else toolset.renamed({"give_back": "refund"}))
        agent = PaiAgent(scripted(call, ModelResponse(parts=[TextPart("done")])), name="a",
                         deps_type=type(None), toolsets=[wrapped])
    child = as_tether_agent(agent, probes={name: shop.pay.lookup}, deadlines={name: 30.0})
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, "refund A")
        with pytest.raises(tether.DelegationError, match="reply lost"):
            await handle.result()
        report = await settled(sup, handle.id)
    (action,) = report.actions
    assert (action.tool, action.state) == (name, A.COMPLETED), report
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"
    assert shop.keys == [action.idempotency_key] and shop.pay.refund_count("A") == 1


async def test_pydantic_ai_a_dynamic_toolsets_undeclared_tool_is_external_and_fenced(
        sqlite_url: str) -> None:
    gate = asyncio.Event()
    shop = Shop(gate=gate)
    agent: PaiAgent[None, str] = PaiAgent(scripted(refund_call("A"), refund_call("B"),
                                                   ModelResponse(parts=[TextPart("done")])),
                                          name="a")

    @agent.toolset
    def tools(ctx: RunContext[None]) -> FunctionToolset[None]:
        return shop_tools(shop)

    async with tether.Supervisor(sqlite_url) as sup:
        waiter = events_of(sup)
        handle = await sup.delegate(as_tether_agent(agent), "refund A then B")
        await shop.started.wait()
        recall = asyncio.ensure_future(handle.recall(grace=30))
        await waiter("drain", handle.id).wait()
        gate.set()  # A finishes inside the grace window
        report = await recall
    assert report.outcome is tether.DelegationState.RECALLED
    assert [(a.tool, a.effect, a.state) for a in report.actions] == [
        ("refund", tether.Effect.EXTERNAL, A.COMPLETED)]
    assert shop.pay.refund_count("B") == 0  # the recall fenced the next call


async def test_pydantic_ai_a_queued_structured_output_is_rebuilt_from_the_journal(
        sqlite_url: str) -> None:
    """The worker records the JSON; the handle ``delegate`` gave rebuilds the model from it, a
    handle known only by id (which does not know the agent) gives the JSON."""
    shop = Shop()
    at = "2026-01-02T03:04:05Z"
    child = as_tether_agent(refunding(shop, refund_call("A"),
                                      receipt_call(order_id="A", cents=500, at=at),
                                      output_type=Receipt))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, "refund A", remote=True)
        async with tether.Worker(sqlite_url, [child], poll=0.01) as worker:
            running = asyncio.ensure_future(worker.run())
            result = await handle.result()
            by_id = await sup.handle_for(handle.id).result()
            worker.stop()
            await running
    assert isinstance(result, Receipt) and result.at.year == 2026
    assert by_id == result.model_dump(mode="json")



async def send_refund(order_id: str, cents: int) -> Receipt:
    """An output function: the model calls it as final_result, and it pays."""
    raise AssertionError("an output function must not run")


async def send_refund_ctx(ctx: RunContext[None], order_id: str) -> Receipt:
    """Likewise, taking the run's context."""
    raise AssertionError("an output function must not run")


async def text_refund(text: str) -> str:
    raise AssertionError("an output function must not run")


def output_function_forms() -> dict[str, Any]:
    from pydantic_ai import NativeOutput, PromptedOutput, TextOutput, ToolOutput
    return {"bare": send_refund, "ToolOutput": ToolOutput(send_refund, name="pay"),
            "listed with str": [send_refund, str], "TextOutput": TextOutput(text_refund),
            "NativeOutput": NativeOutput(send_refund), "PromptedOutput": PromptedOutput(
                [Receipt, send_refund]), "with RunContext": send_refund_ctx}


@pytest.mark.parametrize("form", list(output_function_forms()))
def test_pydantic_ai_an_output_function_is_refused_when_the_agent_is_built(form: str) -> None:
    """An output function runs outside any toolset tether wraps (unjournaled, unkeyed,
    unfenced, and a lost reply would read as a cut with no tool run): refused, naming the
    supported way, in an agent and in a sub-agent."""
    agent: PaiAgent[None, Any] = PaiAgent(scripted(), name="payer",
                                          output_type=output_function_forms()[form])
    with pytest.raises(tether.errors.UserError, match=r"agent payer: output function \w+ would run "
                       r"outside tether's gateway .* do the work in a tool"):
        as_tether_agent(agent)
    parent: PaiAgent[None, str] = PaiAgent(scripted(), name="parent")

    @parent.tool_plain
    async def ask(question: str) -> str:
        """Ask the payer."""
        return str(await delegate(agent, question))

    with pytest.raises(tether.errors.UserError, match="agent payer: output function"):
        as_tether_agent(parent, delegates={"ask": agent})


async def test_pydantic_ai_a_tool_borrowing_a_delegate_tools_name_passes_the_gateway(
        sqlite_url: str) -> None:
    """Only the planned delegate tool runs its sub-agent outside the gateway: a dynamic
    toolset's tool shown under its name (the delegate tool filtered out by then) is
    journaled and keyed like any other."""
    ran: list[tuple[str, str | None]] = []
    billing: PaiAgent[None, str] = PaiAgent(scripted(ModelResponse(parts=[TextPart("hi")])),
                                            name="billing")

    async def ask_billing(question: str) -> str:
        """Ask billing."""
        return str(await delegate(billing, question))

    static = FunctionToolset([ask_billing]).filtered(lambda ctx, td: ctx.run_step <= 1)
    asks = [ModelResponse(parts=[ToolCallPart("ask_billing", {"question": q})])
            for q in ("hello", "pay me")]
    agent: PaiAgent[None, str] = PaiAgent(scripted(*asks, ModelResponse(parts=[TextPart("ok")])),
                                          name="a", toolsets=[static])

    @agent.toolset
    def later(ctx: RunContext[None]) -> FunctionToolset[None]:
        async def ask_billing(question: str) -> str:
            """Wires money, under the delegate tool's name."""
            ran.append((question, idempotency_key()))
            return "wired"

        return FunctionToolset([ask_billing] if ctx.run_step > 1 else [])

    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent, delegates={"ask_billing": billing}),
                                    "go")
        assert await handle.result() == "ok"
        report = await handle.report()
    (action,) = report.actions
    assert (action.tool, action.effect, action.state) == (
        "ask_billing", tether.Effect.EXTERNAL, A.COMPLETED)
    assert ran == [("pay me", action.idempotency_key)]
    assert len(report.children) == 1  # the planned delegate tool ran billing, nested


class Aliased(BaseModel):
    order_id: str = Field(alias="orderId")


class Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel)
    order_id: str


class SplitAlias(BaseModel):
    order_id: str = Field(validation_alias="oid", serialization_alias="orderRef")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cents: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def dollars(self) -> float:
        return self.cents / 100


@pytest.mark.parametrize(("output_type", "fields"), [
    (Aliased, {"orderId": "A"}), (Camel, {"orderId": "A"}), (SplitAlias, {"oid": "A"}),
    (Strict, {"cents": 250})], ids=["alias", "alias_generator", "split_alias", "forbid_computed"])
async def test_pydantic_ai_aliased_and_strict_models_round_trip(
        output_type: type[BaseModel], fields: dict[str, Any], sqlite_url: str) -> None:
    agent: PaiAgent[None, Any] = PaiAgent(scripted(receipt_call(**fields)), name="o",
                                          output_type=output_type)
    expected = await PaiAgent(scripted(receipt_call(**fields)), output_type=output_type).run("")
    async with tether.Supervisor(sqlite_url) as sup:
        result = await (await sup.delegate(as_tether_agent(agent), "go")).result()
    assert type(result) is output_type and result == expected.output


class LooksLikeB(BaseModel):
    amount: int


class LooksLikeA(BaseModel):
    amount: int


async def test_pydantic_ai_a_union_of_look_alike_types_rebuilds_the_member_it_was(
        sqlite_url: str) -> None:
    """Same fields, so the JSON alone cannot tell them apart: the journal keeps which."""
    call = ModelResponse(parts=[ToolCallPart("final_result_LooksLikeB", {"amount": 2})])
    agent: PaiAgent[None, Any] = PaiAgent(scripted(call), name="o",
                                          output_type=[LooksLikeA, LooksLikeB])
    child = as_tether_agent(agent)
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(child, "go")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
    assert type(result) is LooksLikeB and result.amount == 2
    assert row.result == {"type": "LooksLikeB", "value": {"amount": 2}}
    assert child.output is not None and type(child.output.load(row.result)) is LooksLikeB


class Cents(BaseModel):
    v: int

    @field_validator("v")
    @classmethod
    def to_cents(cls, v: int) -> int:
        if v >= 1000:
            raise ValueError("already in cents?")
        return v * 100


class Ratio(BaseModel):
    x: float


@dataclasses.dataclass(eq=False)
class NoEq:
    v: int


@pytest.mark.parametrize(("output_type", "fields", "error"), [
    (Cents, {"v": 12}, 'its JSON {"v": 1200} does not validate as Cents: v: Value error, '
                       "already in cents?"),
    (Ratio, {"x": float("nan")}, "value['x'] is nan: JSON has no NaN or infinity"),
    (Ratio, {"x": float("inf")}, "value['x'] is inf: JSON has no NaN or infinity"),
    (NoEq, {"v": 1}, None)], ids=["validator", "nan", "inf", "no_value_equality"])
async def test_pydantic_ai_an_output_that_cannot_be_stored_says_why_in_one_line(
        output_type: Any, fields: dict[str, Any], error: str | None, sqlite_url: str) -> None:
    agent: PaiAgent[None, Any] = PaiAgent(scripted(receipt_call(**fields)), name="o",
                                          output_type=output_type)
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(agent), "go")
        try:
            result = await handle.result()
        except tether.DelegationError:
            result = None
        row = await sup.journal.get(handle.id)
    if error is None:  # compared by its JSON, which gives back that same JSON
        assert type(result) is NoEq and result.v == 1
        return
    assert row.error == f"UserError: the result of o cannot be stored: {error}"


async def test_pydantic_ai_a_queued_output_that_no_longer_validates_is_a_delegation_error(
        sqlite_url: str) -> None:
    """The worker's agent (another version) declared another type: the JSON it recorded does
    not rebuild here, which is the task's failure to give its result, said as such."""
    mine = as_tether_agent(PaiAgent(scripted(), name="refunder", output_type=Receipt))
    theirs = as_tether_agent(PaiAgent(scripted(receipt_call(x=1.5)), name="refunder",
                                      output_type=Ratio))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(mine, "go", remote=True)
        async with tether.Worker(sqlite_url, [theirs], poll=0.01) as worker:
            running = asyncio.ensure_future(worker.run())
            with pytest.raises(tether.DelegationError) as caught:
                await handle.result()
            worker.stop()
            await running
    message = str(caught.value)
    assert "UserError: the result of refunder cannot be rebuilt: the stored output does not "\
           "validate as Receipt: order_id: Field required; cents: Field required" in message
    assert "\n" not in message


def test_a_value_not_of_the_declared_type_is_refused_in_one_line() -> None:
    """pydantic's serializer warnings span lines: the refusal is one."""
    from tether._integrations.outputs import output_codec
    codec = output_codec([Receipt])
    assert codec is not None
    with pytest.raises(tether.errors.UserError) as caught:
        codec.dump("re_1")
    assert str(caught.value).startswith("str is not of its declared output type Receipt: ")
    assert "\n" not in str(caught.value)
