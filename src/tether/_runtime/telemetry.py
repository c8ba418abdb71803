"""OpenTelemetry spans, counters and duration histograms, and user hooks, keyed by task and
attempt.

Spans follow the OpenTelemetry GenAI semantic conventions for agent and tool spans (semantic
conventions v1.41.0, GenAI status Development): a delegation (in the orchestrator's trace, an
invoke agent client span) and each of its attempts (each its own trace, linked to the
delegation and to the attempt before it; internal spans) are ``invoke_agent {agent}``; each
tool call, journaled or read-only, is ``execute_tool {tool}``, with ``gen_ai.tool.call.id`` the
model's id for the call when an adapter knows it and ``tether.action.id`` the journaled
action's. An attempt's span is the current span while its code runs and a call's while its tool
runs (``current``), so spans opened inside them, a framework's model calls say, nest under
tether's. ``tether.*`` attributes carry what the conventions do not (task, attempt, effect,
outcome). Every span has a ``tether.outcome``; one whose outcome is not success has status
ERROR and ``error.type``; every span is ended, those still open when the supervisor closes
with outcome IN_DOUBT.

Only the OpenTelemetry API is a dependency: without an SDK installed and configured, every call
here is a no-op.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Status, StatusCode

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


# Outcomes that are not a success: the span's status is ERROR and ``error.type`` says which.
ERROR_OUTCOMES = frozenset({"FAILED", "IN_DOUBT", "UNKNOWN", "NEEDS_ATTENTION", "CANCELLED"})
OPERATION = "gen_ai.operation.name"


@dataclass(frozen=True)
class Instruments:
    """tether's counters and histograms, made once per meter provider (``instruments``)."""

    failed: metrics.Counter
    decisions: metrics.Counter
    actions: metrics.Counter
    intents: metrics.Counter
    probes: metrics.Counter
    unknowns: metrics.Counter
    grace_expiries: metrics.Counter
    tool_duration: metrics.Histogram
    agent_duration: metrics.Histogram


# Without an SDK the global provider is OpenTelemetry's proxy, which keeps every meter and
# instrument made through it, for an SDK set up later: made per supervisor, they grew a
# process that opens many without end. By identity (providers need not hash, nor be equal
# only to themselves); an entry goes with its provider.
_MADE: dict[int, tuple[weakref.ref[metrics.MeterProvider], Instruments]] = {}


def instruments(provider: metrics.MeterProvider) -> Instruments:
    key = id(provider)
    found = _MADE.get(key)
    if found is not None and found[0]() is provider:
        return found[1]
    meter = provider.get_meter("tether", VERSION)
    counter, histogram = meter.create_counter, meter.create_histogram
    made = Instruments(
        failed=counter("tether.children.failed", unit="1",
                       description="failed child attempts"),
        decisions=counter("tether.redispatch.decisions", unit="1",
                          description="re-dispatch decisions"),
        actions=counter("tether.actions", unit="1", description="journaled actions started"),
        intents=counter("tether.intents", unit="1",
                        description="control intents, accepted or refused"),
        probes=counter("tether.probes", unit="1",
                       description="probe answers, by resulting state"),
        unknowns=counter("tether.actions.unknown", unit="1",
                         description="actions left UNKNOWN by a probe"),
        grace_expiries=counter("tether.grace.expired", unit="1",
                               description="recalls whose grace window ended with calls in "
                               "flight"),
        tool_duration=histogram("tether.tool.duration", unit="s",
                                description="execute_tool spans, by outcome"),
        agent_duration=histogram("tether.agent.duration", unit="s",
                                 description="invoke_agent spans, by outcome"))

    def gone(ref: weakref.ref[metrics.MeterProvider]) -> None:
        if _MADE.get(key, (None,))[0] is ref:
            del _MADE[key]

    # A provider no weak reference can follow: its instruments are made each time.
    with contextlib.suppress(TypeError):
        _MADE[key] = (weakref.ref(provider, gone), made)
    return made


class Telemetry:
    def __init__(self, tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: metrics.MeterProvider | None = None) -> None:
        tp = tracer_provider or trace.get_tracer_provider()
        self.tracer = tp.get_tracer("tether", VERSION)
        made = instruments(meter_provider or metrics.get_meter_provider())
        self.failed, self.decisions, self.actions = made.failed, made.decisions, made.actions
        self.intents, self.probes, self.unknowns = made.intents, made.probes, made.unknowns
        self.grace_expiries = made.grace_expiries
        self.tool_duration, self.agent_duration = made.tool_duration, made.agent_duration
        # Spans started and not yet ended, with what their duration is recorded under.
        self._open: weakref.WeakKeyDictionary[trace.Span, tuple[float, dict[str, Any]]] = \
            weakref.WeakKeyDictionary()

    def _start(self, name: str, attributes: dict[str, Any], metric: dict[str, Any],
               context: otel_context.Context | None = None,
               links: list[trace.Link] | None = None,
               kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> trace.Span:
        span = self.tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                                      links=links)
        if span.is_recording():
            self._open[span] = (time.monotonic(), metric)
        return span

    def delegation_span(self, task_id: str, agent: str) -> trace.Span:
        """In the caller's trace: the whole task, across attempts."""
        return self._start(f"invoke_agent {agent}", {
            OPERATION: "invoke_agent", "gen_ai.agent.name": agent, "tether.task": task_id},
            {OPERATION: "invoke_agent", "gen_ai.agent.name": agent},
            kind=trace.SpanKind.CLIENT)

    def attempt_span(self, task_id: str, delegation_id: str, attempt: int, agent: str,
                     links: list[trace.Span]) -> trace.Span:
        """A new root: each attempt has its own trace id."""
        return self._start(
            f"invoke_agent {agent}",
            {OPERATION: "invoke_agent", "gen_ai.agent.name": agent,
             "gen_ai.agent.id": delegation_id, "tether.task": task_id,
             "tether.delegation": delegation_id, "tether.attempt": attempt,
             "tether.agent": agent},
            {OPERATION: "invoke_agent", "gen_ai.agent.name": agent},
            context=otel_context.Context(),
            links=[trace.Link(s.get_span_context()) for s in links])

    def action_span(self, parent: trace.Span | None, tool: str, effect: str, task_id: str,
                    attempt: int, action_id: str | None = None,
                    call_id: str | None = None) -> trace.Span | None:
        """``call_id`` is the model's id for the call, ``action_id`` the journal's. None under
        an attempt nobody traces (no SDK set up when it began, or a sampler that dropped it):
        its calls' spans would record nothing either, and no call pays for making them."""
        if parent is not None and not parent.is_recording():
            return None
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        attributes: dict[str, Any] = {
            OPERATION: "execute_tool", "gen_ai.tool.name": tool, "gen_ai.tool.type": "function",
            "tether.tool": tool, "tether.effect": effect, "tether.task": task_id,
            "tether.attempt": attempt}
        if call_id is not None:
            attributes["gen_ai.tool.call.id"] = call_id
        if action_id is not None:
            attributes["tether.action.id"] = action_id
        return self._start(f"execute_tool {tool}", attributes,
                           {OPERATION: "execute_tool", "gen_ai.tool.name": tool,
                            "tether.effect": effect}, context=ctx)

    def finish(self, span: trace.Span | None, outcome: str,
               error: BaseException | str | None = None, **attributes: Any) -> None:
        """End ``span`` with its outcome (status, ``error.type``) and record its duration."""
        if span is None:
            return
        started = self._open.pop(span, None)
        kind = end(span, outcome=outcome, error=error, **attributes)
        if started is not None:
            at, metric = started
            labels = {**metric, "tether.outcome": outcome}
            if kind is not None:
                labels["error.type"] = kind
            histogram = (self.tool_duration if metric[OPERATION] == "execute_tool"
                         else self.agent_duration)
            histogram.record(time.monotonic() - at, labels)

    def close(self) -> None:
        """End every span still open (a call or attempt whose outcome is not known when the
        supervisor closes): IN_DOUBT, which is what the journal holds for it."""
        for span in list(self._open.keys()):
            if span.is_recording():
                self.finish(span, "IN_DOUBT", "in_doubt")
            else:
                self._open.pop(span, None)

    def probed(self, state: str) -> None:
        self.probes.add(1, {"tether.outcome": state})
        if state == "UNKNOWN":
            self.unknowns.add(1)


@contextmanager
def current(span: trace.Span | None) -> Iterator[None]:
    """``span`` is the current span inside: what the code run there opens is its child, and so
    is what tasks created there open (they copy the context when they are created). tether
    ends its spans itself, with their outcome, so leaving does not end or mark it."""
    if span is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    closed = False
    try:
        yield
    except GeneratorExit:
        # The coroutine was closed where it stood (its task dropped and collected, a crashed
        # host in the simulator), maybe from another context: the value is not that
        # context's to reset (OpenTelemetry logged a traceback), and the task's own goes too.
        closed = True
        raise
    finally:
        if not closed:
            otel_context.detach(token)


def trace_id_of(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def error_type(outcome: str | None, error: BaseException | str | None) -> str | None:
    """``error.type`` for an outcome: the exception's class, or the outcome itself."""
    if isinstance(error, BaseException):
        return type(error).__qualname__
    if error is not None:
        return error
    if outcome in ERROR_OUTCOMES:
        return outcome.lower() if outcome else None
    return None


def end(span: trace.Span | None, outcome: str | None = None,
        error: BaseException | str | None = None, **attributes: Any) -> str | None:
    """Set the outcome, status and ``error.type``, and end the span. Returns the error type."""
    if span is None or not span.is_recording():
        return None  # no SDK, or ended already (at the supervisor's close)
    if outcome is not None:
        span.set_attribute("tether.outcome", outcome)
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"tether.{key}", value)
    kind = error_type(outcome, error)
    if kind is not None:
        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, outcome or kind))
    span.end()
    return kind
