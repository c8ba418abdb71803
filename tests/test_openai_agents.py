"""An OpenAI Agents SDK Agent run as a tether child, with the SDK's own ScriptedModel (the
model interface, no network): recall, terminate with reconciliation, and cut streams that are
re-dispatched or kept per the rules (I1, I2, I3, I6, I8)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
from typing import Any

import httpx2
import pytest
from agents import Agent as SdkAgent
from agents import StopAtTools, function_tool, set_tracing_disabled
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from pydantic import BaseModel, Field, TypeAdapter

import tether
from tether.agents import as_tether_agent, idempotency_key
from tether.testing import PaymentService

from .conftest import ONE_CLOCK, events_of, settled

S = tether.DelegationState
set_tracing_disabled(True)  # offline: the SDK would try to export traces


class Refunds:
    """A provider with its own ledger, and an SDK function tool that refunds through it."""

    def __init__(self) -> None:
        self.pay = PaymentService(latency=0.0)
        self.gate: asyncio.Event | None = None  # when set, a refund waits for it first
        self.started = asyncio.Event()
        self.fail: BaseException | None = None  # raised after the provider applied it

        @function_tool
        async def refund(order_id: str, cents: int) -> str:
            """Refund an order."""
            self.started.set()
            if self.gate is not None:
                await self.gate.wait()
            key = idempotency_key()
            assert key is not None  # tether hands the tool its key
            if isinstance(self.fail, tether.ToolRejected):
                raise self.fail  # the provider refused it: certainly not applied
            ref = await self.pay.refund(order_id, cents, idempotency_key=key)
            if self.fail is not None:
                raise self.fail
            return ref

        self.tool = refund

    def agent(self, *steps: Any, deadline: float = 30.0) -> tether.Agent:
        model = ScriptedModel(steps)
        sdk = SdkAgent(name="refunder", instructions="Refund what the user asks.",
                       tools=[self.tool], model=model)
        agent = as_tether_agent(sdk, probes={"refund": self.pay.lookup},
                                deadlines={"refund": deadline})
        MODELS[agent] = model
        return agent


def refund_call(order: str, call_id: str) -> Any:
    return [function_call("refund", {"order_id": order, "cents": 500}, call_id=call_id)]


@pytest.fixture
def refunds() -> Refunds:
    return Refunds()


async def test_an_sdk_agent_runs_its_tools_through_the_gateway(
        refunds: Refunds, journal_url: str) -> None:
    agent = refunds.agent(refund_call("A", "c1"), [assistant_message("refunded A")])
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund order A")
        assert await handle.result() == "refunded A"
        report = await handle.report()
    (action,) = report.actions
    assert (action.tool, action.effect, action.state) == (
        "refund", tether.Effect.EXTERNAL, tether.ActionState.COMPLETED)  # undeclared: EXTERNAL
    assert refunds.pay.refund_count("A") == 1


async def test_recall_lets_the_in_flight_tool_finish_and_stops_the_next(
        refunds: Refunds, journal_url: str) -> None:
    refunds.gate = asyncio.Event()
    agent = refunds.agent(refund_call("A", "c1"), refund_call("B", "c2"),
                          [assistant_message("done")])
    async with tether.Supervisor(journal_url) as sup:
        waiter = events_of(sup)
        handle = await sup.delegate(agent, "refund A then B")
        await refunds.started.wait()
        recall = asyncio.ensure_future(handle.recall(grace=30, reason="re-plan"))
        await waiter("drain", handle.id).wait()
        refunds.gate.set()  # A finishes inside the grace window
        report = await recall
    assert report.outcome is S.RECALLED
    assert [(a.args["order_id"], a.state) for a in report.actions] == [
        ("A", tether.ActionState.COMPLETED)]
    assert refunds.pay.refund_count("A") == 1 and refunds.pay.refund_count("B") == 0


async def test_terminate_cancels_the_tool_and_reconciles_it(refunds: Refunds,
                                                            journal_url: str) -> None:
    refunds.gate = asyncio.Event()  # never set: the refund hangs before the provider
    # Its provider can no longer apply a refund 1 s after its intent.
    agent = refunds.agent(refund_call("A", "c1"), [assistant_message("done")], deadline=1.0)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        handle = await sup.delegate(agent, "refund A")
        await refunds.started.wait()
        report = await handle.terminate(reason="stop")
        assert report.verdict == "TERMINATE"
        if not report.outcome.terminal:  # probed within the deadline: "not applied yet"
            assert report.actions[0].state is tether.ActionState.IN_DOUBT
            report = await settled(sup, handle.id)  # probed again at the deadline
    (action,) = report.actions
    assert action.state is tether.ActionState.NOT_APPLIED  # the provider's own answer
    assert action.evidence is not None and action.evidence["probe"] == "NOT_APPLIED"
    assert report.outcome is tether.DelegationState.RECONCILED


async def test_a_stream_cut_before_any_tool_is_re_dispatched(refunds: Refunds,
                                                              journal_url: str) -> None:
    agent = refunds.agent(ModelStep.raise_error(httpx2.ConnectError("connection refused")),
                          refund_call("A", "c1"), [assistant_message("refunded A")])
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A",
                                    redispatch=tether.RedispatchPolicy(settle_delay=0.001))
        assert await handle.result() == "refunded A"
        attempts = handle.attempts
        events = await sup.journal.events(attempts)
    assert len(attempts) == 2
    decisions = [e.detail["code"] for e in events if e.kind == "redispatch_decision"]
    assert decisions[0] == tether.protocol.Code.REDISPATCH_NO_TOOL_RAN.value
    assert refunds.pay.refund_count("A") == 1


async def test_a_stream_cut_after_a_refund_is_never_re_dispatched(refunds: Refunds,
                                                                   journal_url: str) -> None:
    """The refund went through before the cut: re-running the agent could refund twice, so
    what was salvaged is returned instead (the journal records why)."""
    agent = refunds.agent(refund_call("A", "c1"),
                          ModelStep.raise_error(httpx2.RemoteProtocolError("peer closed")))
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A")
        partial = await handle.result()
        attempts = handle.attempts
        report = await handle.report()
        events = await sup.journal.events(attempts)
    assert len(attempts) == 1 and isinstance(partial, tether.protocol.Partial)
    assert report.outcome is S.SUCCEEDED_PARTIAL
    decisions = [e.detail["code"] for e in events if e.kind == "redispatch_decision"]
    assert decisions == [tether.protocol.Code.PARTIAL_SALVAGED.value]
    assert refunds.pay.refund_count("A") == 1


async def test_an_ordinary_model_error_is_not_a_cut(refunds: Refunds, journal_url: str) -> None:
    agent = refunds.agent(ModelStep.raise_error(ValueError("bad request")))
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A")
        with pytest.raises(tether.DelegationError, match="bad request"):
            await handle.result()
        assert len(handle.attempts) == 1


def test_declarations_for_tools_the_agent_lacks_are_refused(refunds: Refunds) -> None:
    sdk = SdkAgent(name="refunder", tools=[refunds.tool], model=ScriptedModel([]))
    with pytest.raises(tether.errors.UserError, match="no function tool named wire"):
        as_tether_agent(sdk, effects={"wire": tether.Effect.EXTERNAL})
    with pytest.raises(tether.errors.UserError, match="DELEGATE"):
        as_tether_agent(sdk, effects={"refund": tether.Effect.DELEGATE})
    with pytest.raises(tether.errors.UserError, match="max_turns"):
        as_tether_agent(sdk, max_turns=0)


async def test_a_cut_stream_is_refused_when_the_policy_allows_no_retry(
        refunds: Refunds, journal_url: str) -> None:
    agent = refunds.agent(ModelStep.raise_error(httpx2.ConnectTimeout("no answer")))
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A",
                                    redispatch=tether.RedispatchPolicy(budget=0))
        with pytest.raises(tether.DelegationError, match="connect_timeout"):
            await handle.result()
        events = await sup.journal.events(handle.attempts)
    assert len(handle.attempts) == 1
    assert [e.detail["code"] for e in events if e.kind == "redispatch_decision"] == [
        tether.protocol.Code.RETRY_DISABLED.value]


async def test_a_tool_that_raised_is_in_doubt_and_probed_not_reported_done(
        refunds: Refunds, journal_url: str) -> None:
    """The SDK turns a tool's exception into a message for the model; tether still records
    that the refund's outcome was unknown, and the provider's ledger settles it."""
    refunds.fail = RuntimeError("reply lost")
    agent = refunds.agent(refund_call("A", "c1"), [assistant_message("could not confirm")])
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A")
        assert await handle.result() == "could not confirm"
        report = await handle.report()
    (action,) = report.actions
    assert action.state is tether.ActionState.COMPLETED  # applied, despite the exception
    assert action.evidence is not None and action.evidence["probe"] == "COMPLETED"
    assert model_saw_error(agent)


async def test_a_rejected_tool_call_is_failed(refunds: Refunds, journal_url: str) -> None:
    refunds.fail = tether.ToolRejected("card declined")
    agent = refunds.agent(refund_call("A", "c1"), [assistant_message("declined")])
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(agent, "refund A")
        await handle.result()
        report = await handle.report()
    (action,) = report.actions
    assert action.state is tether.ActionState.FAILED and refunds.pay.refund_count("A") == 0


def model_saw_error(agent: tether.Agent) -> bool:
    """The model's second call carried the SDK's error message as the tool's output."""
    return any("error" in str(item).lower() for item in MODELS[agent].calls[1].input)


MODELS: dict[tether.Agent, ScriptedModel] = {}


class Receipt(BaseModel):
    order_id: str
    cents: int
    at: datetime.datetime


@dataclasses.dataclass
class Slip:
    order_id: str
    at: datetime.date


@pytest.mark.parametrize("kind", ["model", "dataclass"])
async def test_a_structured_output_is_stored_as_its_json_and_rebuilt(
        kind: str, refunds: Refunds, journal_url: str) -> None:
    """A pydantic model, or a dataclass (which the SDK asks the model for wrapped in
    {"response": ...}), comes back as the declared type; the journal holds its JSON."""
    output_type: Any
    if kind == "model":
        output_type, text = Receipt, {"order_id": "A", "cents": 500, "at": "2026-01-02T03:04:05Z"}
        expected: Any = Receipt(order_id="A", cents=500, at=datetime.datetime(
            2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC))
    else:
        output_type, text = Slip, {"response": {"order_id": "A", "at": "2026-01-02"}}
        expected = Slip("A", datetime.date(2026, 1, 2))
    model = ScriptedModel([refund_call("A", "c1"), [assistant_message(json.dumps(text))]])
    sdk = SdkAgent(name="refunder", tools=[refunds.tool], model=model, output_type=output_type)
    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(as_tether_agent(sdk, probes={"refund": refunds.pay.lookup}),
                                    "refund order A")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
        report = await handle.report()
    assert type(result) is output_type and result == expected
    assert row.state is S.SUCCEEDED
    assert row.result == TypeAdapter(output_type).dump_python(expected, mode="json")
    assert [a.state for a in report.actions] == [tether.ActionState.COMPLETED]


class Aliased(BaseModel):
    order_id: str = Field(alias="orderId")


class RefundOut(BaseModel):
    order_id: str


class ChargeOut(BaseModel):
    order_id: str


async def test_an_aliased_output_model_round_trips(sqlite_url: str) -> None:
    model = ScriptedModel([[assistant_message(json.dumps({"orderId": "A"}))]])
    sdk = SdkAgent(name="a", output_type=Aliased, model=model)
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(sdk), "go")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
    assert type(result) is Aliased and result.order_id == "A"
    assert row.result == {"order_id": "A"}  # by field name, read back by name


async def test_a_handoff_to_an_agent_of_a_look_alike_output_type_rebuilds_that_type(
        sqlite_url: str) -> None:
    """The run ends in the charger (output ChargeOut, the same fields as the triage's
    RefundOut): the journal keeps which type it was, and the rebuild is a ChargeOut."""
    charger = SdkAgent(name="charger", output_type=ChargeOut, model=ScriptedModel(
        [[assistant_message(json.dumps({"order_id": "A"}))]]))
    triage = SdkAgent(name="triage", output_type=RefundOut, handoffs=[charger], model=ScriptedModel(
        [[function_call("transfer_to_charger", {}, call_id="c1")]]))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(triage), "go")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
    assert type(result) is ChargeOut and result.order_id == "A"
    assert row.result == {"type": "ChargeOut", "value": {"order_id": "A"}}


@pytest.mark.parametrize("behavior", ["stop_on_first_tool", "stop_at_tools"])
async def test_a_run_stopped_at_a_tool_ends_with_its_output_despite_an_output_type(
        behavior: str, refunds: Refunds, sqlite_url: str) -> None:
    """The SDK makes the tool's output the final output, of no declared type: kept as a plain
    value, as the run gave it (not a failure)."""
    stop: Any = (behavior if behavior == "stop_on_first_tool"
                 else StopAtTools(stop_at_tool_names=["refund"]))
    sdk = SdkAgent(name="r", tools=[refunds.tool], output_type=Receipt, tool_use_behavior=stop,
                   model=ScriptedModel([refund_call("A", "c1")]))
    async with tether.Supervisor(sqlite_url) as sup:
        handle = await sup.delegate(as_tether_agent(sdk, probes={"refund": refunds.pay.lookup}),
                                    "refund A")
        result = await handle.result()
        row = await sup.journal.get(handle.id)
        report = await handle.report()
    assert isinstance(result, str) and result.startswith("re_")
    assert row.state is S.SUCCEEDED and row.result == {"type": None, "value": result}
    assert [a.state for a in report.actions] == [tether.ActionState.COMPLETED]
    assert refunds.pay.refund_count("A") == 1
