"""OpenTelemetry: GenAI semantic conventions for agent and tool spans, status and error.type,
every span ended (a call still out when the supervisor closes ends IN_DOUBT), duration
histograms and counters; checked with the SDK's in-memory exporters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tether
from tether.testing import PaymentService


@dataclass
class Otel:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer: TracerProvider
    meter: MeterProvider

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        data = self.metrics.get_metrics_data()
        assert data is not None
        return [(dict(p.attributes or {}), p) for rm in data.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics if m.name == metric
                for p in m.data.data_points]


@pytest.fixture
def otel() -> Otel:
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    return Otel(spans, reader, tracer, MeterProvider(metric_readers=[reader]))


async def test_agent_and_tool_spans_follow_the_genai_conventions(tmp_path: Path,
                                                                 otel: Otel) -> None:
    pay = PaymentService(latency=0.0)

    @tether.tool(effect=tether.Effect.READ_ONLY)
    async def lookup(order_id: str) -> int:
        return 1250

    @tether.tool(probe=pay.lookup)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

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
    assert paid.attributes["gen_ai.tool.call.id"] == by_tool["refund"].id
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
    assert any(a.get("error.type") == "RuntimeError" for a, _ in durations)
    assert otel.points("tether.agent.duration")
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
