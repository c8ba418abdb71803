"""OpenTelemetry spans and counters, and user hooks, keyed by task and attempt.

Only the OpenTelemetry API is a dependency: without an SDK installed and configured, every call
here is a no-op. Each attempt is its own trace (a fresh child has a fresh trace id), linked to the
delegation's span in the orchestrator's trace and to the attempt before it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace

VERSION = "0.1.0"


@dataclass(frozen=True)
class HookEvent:
    """What a hook receives. ``attempt`` lets a hook that is not idempotent dedupe: the stop
    hook fires once per attempt, so a re-dispatched child stops twice."""

    task_id: str
    delegation_id: str
    attempt: int
    agent: str
    outcome: str | None = None  # the attempt's final state, for the stop hook
    reason: str | None = None  # failure or decision code


Hook = Callable[[HookEvent], Awaitable[None]]


@dataclass(frozen=True)
class Hooks:
    on_child_start: Hook | None = None  # awaited while the child is forked, before its code runs
    on_child_stop: Hook | None = None  # once per attempt, when its state is final
    on_redispatch: Hook | None = None  # right before a re-dispatched child is dispatched


class Telemetry:
    def __init__(self, tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: metrics.MeterProvider | None = None) -> None:
        tp = tracer_provider or trace.get_tracer_provider()
        mp = meter_provider or metrics.get_meter_provider()
        self.tracer = tp.get_tracer("tether", VERSION)
        meter = mp.get_meter("tether", VERSION)
        self.failed = meter.create_counter(
            "tether.children.failed", unit="1", description="failed child attempts")
        self.decisions = meter.create_counter(
            "tether.redispatch.decisions", unit="1", description="re-dispatch decisions")
        self.actions = meter.create_counter(
            "tether.actions", unit="1", description="journaled actions started")

    def delegation_span(self, task_id: str, agent: str) -> trace.Span:
        """In the caller's trace: the whole task, across attempts."""
        return self.tracer.start_span("tether.delegation", attributes={
            "tether.task": task_id, "tether.agent": agent})

    def attempt_span(self, task_id: str, delegation_id: str, attempt: int, agent: str,
                     links: list[trace.Span]) -> trace.Span:
        """A new root: each attempt has its own trace id."""
        return self.tracer.start_span(
            "tether.attempt", context=otel_context.Context(),
            attributes={"tether.task": task_id, "tether.delegation": delegation_id,
                        "tether.attempt": attempt, "tether.agent": agent},
            links=[trace.Link(s.get_span_context()) for s in links])

    def action_span(self, parent: trace.Span | None, tool: str, effect: str, task_id: str,
                    attempt: int) -> trace.Span:
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_span("tether.action", context=ctx, attributes={
            "tether.tool": tool, "tether.effect": effect, "tether.task": task_id,
            "tether.attempt": attempt})


def trace_id_of(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def end(span: trace.Span | None, **attributes: Any) -> None:
    if span is None:
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"tether.{key}", value)
    span.end()
