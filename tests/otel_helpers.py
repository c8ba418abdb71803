"""The OpenTelemetry SDK's in-memory exporters, for tests of what tether's spans and metrics
say, and how they nest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@dataclass
class Otel:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer: TracerProvider
    meter: MeterProvider

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.finished() if s.name == name]

    def operation(self, name: str) -> list[ReadableSpan]:
        """Spans of one GenAI operation (invoke_agent, execute_tool, chat), whoever made them."""
        return [s for s in self.finished()
                if (s.attributes or {}).get("gen_ai.operation.name") == name]

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        data = self.metrics.get_metrics_data()
        assert data is not None
        return [(dict(p.attributes or {}), p) for rm in data.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics if m.name == metric
                for p in m.data.data_points]


def new_otel() -> Otel:
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    return Otel(spans, reader, tracer, MeterProvider(metric_readers=[reader]))


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def attempt_of(otel: Otel, agent: str) -> ReadableSpan:
    """The attempt's span (the one with ``tether.attempt``) of the one delegation of ``agent``."""
    (found,) = [s for s in otel.named(f"invoke_agent {agent}")
                if "tether.attempt" in (s.attributes or {})]
    return found
