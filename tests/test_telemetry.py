"""OpenTelemetry: GenAI semantic conventions for agent and tool spans, status and error.type,
every span ended (a call still out when the supervisor closes ends IN_DOUBT), duration
histograms and counters; checked with the SDK's in-memory exporters."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint
from opentelemetry.trace import StatusCode

import tether
from tether._runtime.telemetry import Telemetry, instruments
from tether.testing import PaymentService

from .conftest import events_of
from .otel_helpers import Otel, attempt_of, new_otel, parent_of


@pytest.fixture
def otel() -> Otel:
    return new_otel()


def refund_tools(pay: PaymentService) -> tuple[tether.Tool, tether.Tool]:
    """A READ_ONLY lookup and an EXTERNAL refund, with the payment service's probe."""

    @tether.tool(effect=tether.Effect.READ_ONLY)
    async def lookup(order_id: str) -> int:
        return 1250

    @tether.tool(probe=pay.lookup)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

    return lookup, refund


async def test_agent_and_tool_spans_follow_the_genai_conventions(tmp_path: Path,
                                                                 otel: Otel) -> None:
    pay = PaymentService(latency=0.0)
    lookup, refund = refund_tools(pay)

    @tether.tool(probe=pay.lookup)
    async def broken(order_id: str, *, idempotency_key: str) -> None:
        raise RuntimeError("connection reset")

    @tether.agent(tools=[lookup, refund, broken])
    async def refunder(ctx: tether.Context, order_id: str) -> None:
        cents = await ctx.call(lookup, order_id=order_id)
        await ctx.call(refund, order_id=order_id, cents=cents)
        await ctx.call(broken, order_id=order_id)

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[refund, broken],
                                 tracer_provider=otel.tracer,
                                 meter_provider=otel.meter) as sup:
        handle = await sup.delegate(refunder, "O-7")
        with pytest.raises(tether.DelegationError):
            await handle.result()
        report = await handle.report()
    by_tool = {a.tool: a for a in report.actions}

    agents = otel.named("invoke_agent refunder")
    assert len(agents) == 2  # the delegation (caller's trace) and its one attempt
    attempt = next(s for s in agents if s.attributes and "tether.attempt" in s.attributes)
    assert attempt.attributes is not None
    assert attempt.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert attempt.attributes["gen_ai.agent.name"] == "refunder"
    assert attempt.attributes["gen_ai.agent.id"] == handle.id
    assert attempt.status.status_code is StatusCode.ERROR

    (paid,) = otel.named("execute_tool refund")
    assert paid.attributes is not None
    assert paid.attributes["gen_ai.operation.name"] == "execute_tool"
    assert paid.attributes["gen_ai.tool.name"] == "refund"
    assert paid.attributes["tether.action.id"] == by_tool["refund"].id
    assert "gen_ai.tool.call.id" not in paid.attributes  # no model gave the call an id
    assert paid.attributes["tether.effect"] == "EXTERNAL"
    assert paid.status.status_code is StatusCode.UNSET and "error.type" not in paid.attributes
    assert paid.parent is not None and paid.parent.span_id == attempt.context.span_id

    (read,) = otel.named("execute_tool lookup")  # read-only calls have spans too
    assert read.attributes is not None and "gen_ai.tool.call.id" not in read.attributes

    (failed,) = otel.named("execute_tool broken")
    assert failed.attributes is not None
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "RuntimeError"
    assert failed.attributes["tether.outcome"] == "IN_DOUBT"

    durations = otel.points("tether.tool.duration")
    assert {a["gen_ai.tool.name"] for a, _ in durations} == {"lookup", "refund", "broken"}
    assert all(p.count >= 1 for _, p in durations)
    assert all(a["tether.outcome"] in {"COMPLETED", "IN_DOUBT"} for a, _ in durations)
    assert any(a.get("error.type") == "RuntimeError" for a, _ in durations)
    agent_durations = otel.points("tether.agent.duration")
    assert {a["tether.outcome"] for a, _ in agent_durations} == {"FAILED"}
    probes = otel.points("tether.probes")
    assert probes and sum(p.value for _, p in probes) >= 1


async def test_a_call_still_out_at_exit_ends_in_doubt(tmp_path: Path, otel: Otel) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    @tether.tool(dispatch_deadline=2.0)
    async def stubborn(*, idempotency_key: str) -> None:
        entered.set()
        try:
            await release.wait()
        except asyncio.CancelledError:  # shrugs off the cut: still out when we leave
            await release.wait()

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(stubborn)

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[stubborn],
                                 policy=tether.Policy(ack_timeout=0.2),
                                 tracer_provider=otel.tracer,
                                 meter_provider=otel.meter) as sup:
        handle = await sup.delegate(agent, tools=[stubborn])
        await entered.wait()
        await handle.terminate("leaving")
    try:
        (span,) = otel.named("execute_tool stubborn")  # ended although the call is still out
        assert span.attributes is not None
        assert span.attributes["tether.outcome"] == "IN_DOUBT"
        assert span.status.status_code is StatusCode.ERROR
        intents = otel.points("tether.intents")
        assert [(a["tether.kind"], a["tether.accepted"]) for a, _ in intents] == [
            ("TERMINATE", True)]
        unknown = otel.points("tether.actions.unknown")
        assert unknown and sum(p.value for _, p in unknown) == 1  # no probe: UNKNOWN
    finally:
        release.set()
        await asyncio.sleep(0)


async def test_spans_opened_by_the_agent_and_its_tools_nest_under_tethers(
        tmp_path: Path, otel: Otel) -> None:
    """What the child's code opens (and what a task it creates opens) is a child of its
    attempt's span; what a tool opens, journaled or read-only, a child of its call's span."""
    inner = otel.tracer.get_tracer("app")

    @tether.tool(effect=tether.Effect.READ_ONLY)
    async def lookup(order_id: str) -> int:
        with inner.start_as_current_span("db query"):
            return 1250

    @tether.tool(effect=tether.Effect.IDEMPOTENT)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        with inner.start_as_current_span("POST /refunds"):
            return "r-1"

    @tether.agent(tools=[lookup, refund])
    async def refunder(ctx: tether.Context, order_id: str) -> None:
        with inner.start_as_current_span("plan"):
            pass

        async def side() -> None:
            with inner.start_as_current_span("in a task"):
                pass

        await asyncio.create_task(side())
        cents = await ctx.call(lookup, order_id=order_id)
        await ctx.call(refund, order_id=order_id, cents=cents)

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[refund],
                                 tracer_provider=otel.tracer,
                                 meter_provider=otel.meter) as sup:
        handle = await sup.delegate(refunder, "O-7")
        await handle.result()
    attempt = attempt_of(otel, "refunder")
    (read,) = otel.named("execute_tool lookup")
    (paid,) = otel.named("execute_tool refund")
    (plan,) = otel.named("plan")
    (in_task,) = otel.named("in a task")
    (query,) = otel.named("db query")
    (post,) = otel.named("POST /refunds")
    assert parent_of(plan) == attempt.context.span_id
    assert parent_of(in_task) == attempt.context.span_id
    assert parent_of(query) == read.context.span_id
    assert parent_of(post) == paid.context.span_id
    assert {s.context.trace_id for s in (plan, in_task, query, post)} == {
        attempt.context.trace_id}


async def test_a_recalled_delegation_has_an_outcome_on_every_span_and_metric(
        tmp_path: Path, otel: Otel) -> None:
    pay = PaymentService(latency=0.0)
    entered, release = asyncio.Event(), asyncio.Event()

    @tether.tool(probe=pay.lookup)
    async def refund(order_id: str, *, idempotency_key: str) -> str:
        entered.set()
        await release.wait()
        return await pay.refund(order_id, 500, idempotency_key=idempotency_key)

    @tether.agent(tools=[refund])
    async def refunder(ctx: tether.Context) -> None:
        await ctx.call(refund, order_id="A")
        await ctx.call(refund, order_id="B")

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[refund],
                                 tracer_provider=otel.tracer,
                                 meter_provider=otel.meter) as sup:
        waiter = events_of(sup)
        handle = await sup.delegate(refunder)
        await entered.wait()
        recall = asyncio.create_task(handle.recall(grace=30.0, reason="enough"))
        await waiter("drain", handle.id).wait()
        release.set()  # A finishes inside the grace window; B never starts
        report = await recall
    assert report.outcome is tether.DelegationState.RECALLED
    spans = otel.named("invoke_agent refunder")
    assert len(spans) == 2  # the delegation and its attempt
    assert [(s.attributes or {}).get("tether.outcome") for s in spans] == ["RECALLED"] * 2
    (paid,) = otel.named("execute_tool refund")
    assert (paid.attributes or {}).get("tether.outcome") == "COMPLETED"
    outcomes = [a["tether.outcome"] for name in ("tether.agent.duration", "tether.tool.duration")
                for a, _ in otel.points(name)]
    assert sorted(outcomes) == ["COMPLETED", "RECALLED"]


class _Pending:
    def __await__(self) -> Generator[None, None, None]:
        yield None


def test_a_call_closed_where_it_stands_leaves_no_error_in_the_logs(
        caplog: pytest.LogCaptureFixture) -> None:
    """A task's coroutine closed without finishing (the task dropped and collected, a host
    crashed in the simulator) is closed from whatever context closes it: leaving tether's
    span there must not try to reset a context that is not that one's (OpenTelemetry logged
    "Failed to detach context" with a traceback)."""
    import contextvars

    from opentelemetry import trace

    from tether._runtime.telemetry import current

    span = trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)

    async def call() -> None:
        with current(span):
            await _Pending()

    coro = call()
    contextvars.copy_context().run(coro.send, None)  # it runs in a context of its own
    with caplog.at_level("DEBUG"):
        coro.close()  # closed from this one
    assert [r.getMessage() for r in caplog.records] == []


async def test_an_attempt_nobody_traces_costs_its_calls_no_span_work(tmp_path: Path) -> None:
    """Without a tracing SDK set up (the API's no-op provider), an attempt's span records
    nothing, and neither would its calls': no call starts a span, attaches a context or ends
    one (issue 24: no per-action OpenTelemetry work without an SDK)."""
    from opentelemetry import trace

    started: list[str] = []

    class Counting(trace.NoOpTracer):
        def start_span(self, name: str, *args: object, **kwargs: object) -> trace.Span:
            started.append(name)
            return super().start_span(name, *args, **kwargs)  # type: ignore[arg-type]

    class Provider(trace.NoOpTracerProvider):
        def get_tracer(self, *args: object, **kwargs: object) -> trace.Tracer:
            return Counting()

    lookup, refund = refund_tools(PaymentService(latency=0.0))

    @tether.agent(tools=[lookup, refund])
    async def refunder(ctx: tether.Context, order_id: str) -> None:
        cents = await ctx.call(lookup, order_id=order_id)
        for _ in range(3):
            await ctx.call(refund, order_id=order_id, cents=cents)

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[refund],
                                 tracer_provider=Provider()) as sup:
        handle = await sup.delegate(refunder, "O-7")
        await handle.result()
        report = await handle.report()
    assert len(report.actions) == 3
    assert [n for n in started if n.startswith("invoke_agent")], started  # the attempt's own
    assert not [n for n in started if n.startswith("execute_tool")], started


def test_supervisors_without_an_sdk_leave_nothing_behind_in_the_global_meter_provider(
        tmp_path: Path) -> None:
    """Without an SDK, the global meter provider is OpenTelemetry's proxy, which keeps every
    meter and instrument made through it (to hand them to an SDK set up later). A process
    that opens supervisors one after another (a service, a test run, a simulation) must not
    grow it with each: tether's instruments are made once per provider."""

    def proxies() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects()
                   if str(type(o).__module__).startswith("opentelemetry.metrics"))

    async def open_and_close() -> None:
        async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}",
                                     keys=tether.KeyRing.ephemeral()):
            pass

    asyncio.run(open_and_close())  # the first makes tether's instruments
    before = proxies()
    for _ in range(20):
        asyncio.run(open_and_close())
    assert proxies() <= before


def counted(reader: InMemoryMetricReader, name: str) -> float:
    data = reader.get_metrics_data()
    assert data is not None
    total = 0.0
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    total += sum(p.value for p in m.data.data_points
                                 if isinstance(p, NumberDataPoint))
    return total


def test_instruments_follow_their_meter_provider_by_identity() -> None:
    """Made once per provider, never shared by two (even two that compare equal), and made
    for a provider that cannot be hashed or weakly referenced, every time."""

    class Equal(MeterProvider):
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Equal)

        def __hash__(self) -> int:
            return 1

    class Unhashable(MeterProvider):
        __hash__ = None  # type: ignore[assignment]

    class Slotted:  # no weak reference can follow it
        __slots__ = ()

        def get_meter(self, *args: Any, **kw: Any) -> metrics.Meter:
            return metrics.NoOpMeter("tether")

    readers = [InMemoryMetricReader(), InMemoryMetricReader()]
    first, second = (Equal(metric_readers=[r]) for r in readers)
    try:
        assert instruments(first) is instruments(first)
        Telemetry(meter_provider=first).actions.add(2)
        Telemetry(meter_provider=second).actions.add(5)
        assert [counted(r, "tether.actions") for r in readers] == [2, 5]
        reader = InMemoryMetricReader()
        unhashable = Unhashable(metric_readers=[reader])
        Telemetry(meter_provider=unhashable).actions.add(3)
        assert counted(reader, "tether.actions") == 3
        assert instruments(unhashable) is instruments(unhashable)
        slotted = cast(metrics.MeterProvider, Slotted())
        Telemetry(meter_provider=slotted).actions.add(1)
        assert instruments(slotted) is not instruments(slotted)
    finally:
        first.shutdown()
        second.shutdown()
