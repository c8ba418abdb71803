"""Re-dispatch of a child whose model stream was cut (I6), through the supervisor."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tether
from tether.protocol import Code, Hooks
from tether.testing import VirtualClock

RETRY_SAFE = frozenset({"read_file", "grep", "web_fetch"})
CUT = tether.protocol.CutReason.STREAM_INCOMPLETE


@tether.tool(effect=tether.Effect.READ_ONLY)
async def read_file(path: str) -> str:
    return f"contents of {path}"


@tether.tool(effect=tether.Effect.READ_ONLY)
async def grep(pattern: str) -> list[str]:
    return [pattern]


@tether.tool(effect=tether.Effect.READ_ONLY)
async def web_fetch(url: str) -> str:
    return f"page {url}"


@tether.tool(effect=tether.Effect.READ_ONLY)
async def bash(command: str) -> str:  # "read-only" by its own claim: never replay-safe
    return ""


@tether.tool(effect=tether.Effect.EXTERNAL)
async def write_file(path: str, text: str, *, idempotency_key: str) -> None:
    return None


@tether.tool(effect=tether.Effect.IDEMPOTENT)
async def bump_counter(name: str, *, idempotency_key: str) -> None:
    return None


@tether.agent(tools=[read_file, grep])
async def git_investigator(ctx: tether.Context, question: str) -> str:
    return str(await ctx.call(grep, pattern=question))


@tether.agent(tools=[write_file])
async def scribe(ctx: tether.Context) -> None:
    return None


RESEARCH: list[tether.Tool | tether.Agent | str] = [read_file, web_fetch, git_investigator]


@dataclass
class World:
    sup: tether.Supervisor
    clock: VirtualClock
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    hooks: list[tuple[str, int, str | None]] = field(default_factory=list)
    on_stop: Callable[[tether.protocol.HookEvent], Awaitable[None]] | None = None
    on_start: Callable[[tether.protocol.HookEvent], Awaitable[None]] | None = None

    async def decisions(self, handle: tether.Handle) -> list[tuple[int, str, str]]:
        ids = handle.attempts + [d.id for d in await self.sup.journal.delegations()
                                 if d.task_id == handle.task_id and d.id not in handle.attempts]
        return [(e.detail["attempt"], e.detail["check"], e.detail["code"])
                for e in await self.sup.journal.events(ids) if e.kind == "redispatch_decision"]


@pytest.fixture
async def world(journal_url: str, clock: VirtualClock) -> AsyncIterator[World]:
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    holder: list[World] = []

    async def start(e: tether.protocol.HookEvent) -> None:
        holder[0].hooks.append(("start", e.attempt, e.reason))
        if holder[0].on_start:
            await holder[0].on_start(e)

    async def stop(e: tether.protocol.HookEvent) -> None:
        holder[0].hooks.append(("stop", e.attempt, e.outcome))
        if holder[0].on_stop:
            await holder[0].on_stop(e)

    async def redispatch(e: tether.protocol.HookEvent) -> None:
        holder[0].hooks.append(("redispatch", e.attempt, None))

    async with tether.Supervisor(
            journal_url, clock=clock, keys=tether.KeyRing.ephemeral(),
            redispatch=tether.RedispatchPolicy(retry_safe=RETRY_SAFE),
            hooks=Hooks(start, stop, redispatch), tracer_provider=tracer,
            meter_provider=MeterProvider(metric_readers=[reader])) as sup:
        holder.append(World(sup, clock, spans, reader))
        yield holder[0]


def scripted(first: Callable[[tether.Context], Awaitable[Any]],
             later: Callable[[tether.Context], Awaitable[Any]] | None = None
             ) -> Callable[..., Awaitable[Any]]:
    """A child whose model is scripted per attempt."""

    async def child(ctx: tether.Context) -> Any:
        if ctx.attempt == 1 or later is None:
            return await first(ctx)
        return await later(ctx)

    return child


async def research_then_cut(ctx: tether.Context) -> None:
    await ctx.call(read_file, path="README")
    await (await ctx.delegate(git_investigator, "who wrote the fence?")).result()
    raise tether.StreamCut(CUT)  # zero output: no text, no completed tool result salvaged


async def findings(ctx: tether.Context) -> str:
    await ctx.call(web_fetch, url="https://example.test/")
    return "findings"


async def settle(w: World) -> None:
    """Let the settle delay pass on the virtual clock."""
    await w.clock.sleeping(1, at_least=w.sup.redispatch.settle_delay)
    w.clock.advance(w.sup.redispatch.settle_delay)


async def test_research_child_is_redispatched_once_as_a_fresh_child(world: World) -> None:
    handle = await world.sup.delegate(scripted(research_then_cut, findings), tools=RESEARCH,
                                      model="sonnet")
    await settle(world)
    assert await handle.result() == "findings"
    first, second = handle.attempts
    assert first != second and handle.id == second and handle.attempt == 2
    rows = {d.id: d for d in await world.sup.journal.delegations()}
    assert rows[first].state is tether.DelegationState.FAILED  # the failed record stays
    assert rows[first].failure == "stream_cut:stream_incomplete"
    assert rows[second].state is tether.DelegationState.SUCCEEDED
    assert (rows[second].task_id, rows[second].attempt) == (rows[first].task_id, 2)
    assert await world.decisions(handle) == [(1, "attempt_ended", "redispatch")]
    kinds = [e.kind for e in await world.sup.journal.events([second])]
    assert kinds.index("redispatch") < kinds.index("trace")  # fired before dispatch


@pytest.mark.parametrize(("surface", "code"), [
    ([read_file, bash], Code.SHELL_TOOL),
    ([read_file, write_file], Code.TOOL_NOT_RETRY_SAFE),
    ([read_file, tether.protocol.UNRESTRICTED], Code.UNRESTRICTED_SURFACE),
    ([read_file, git_investigator, scribe], Code.TOOL_NOT_RETRY_SAFE),
    ([read_file, tether.agent(name="lead", tools=[scribe])(git_investigator.fn)],
     Code.DELEGATE_REACHES_UNSAFE),
    ([read_file, "web_search"], Code.UNKNOWN_TOOL),
    ([read_file, "agent:ghost"], Code.DELEGATE_UNRESOLVED),
])
async def test_unsafe_surfaces_are_not_redispatched(world: World, surface: list[Any],
                                                    code: Code) -> None:
    async def cut_after_reading(ctx: tether.Context) -> None:
        await ctx.call(read_file, path="x")
        raise tether.StreamCut(CUT)

    if code is Code.TOOL_NOT_RETRY_SAFE and scribe in surface:
        surface = [read_file, tether.agent(name="lead", tools=[write_file])(scribe.fn)]
        code = Code.DELEGATE_REACHES_UNSAFE
    handle = await world.sup.delegate(scripted(cut_after_reading), tools=surface)
    with pytest.raises(tether.DelegationError) as info:
        await handle.result()
    assert isinstance(info.value.__cause__, tether.StreamCut)
    assert len(handle.attempts) == 1
    assert await world.decisions(handle) == [(1, "attempt_ended", code.value)]
    assert ("redispatch", 2, None) not in world.hooks


async def test_a_delegate_cycle_fails_closed() -> None:
    a = tether.agent(name="a", tools=["agent:b"])(git_investigator.fn)
    b = tether.agent(name="b", tools=[a])(git_investigator.fn)
    verdict = tether.protocol.decide_redispatch(tether.protocol.AttemptFacts(
        tether.protocol.Ending.STREAM_CUT, False, 1, 0, 1, ("agent:a",),
        {"a": ("agent:b",), "b": ("agent:a",)}, frozenset(), 0, 0), tether.RedispatchPolicy())
    assert verdict.code is Code.DELEGATE_CYCLE
    assert b.tools == (a,)


async def test_safe_looking_surface_with_a_journaled_side_effect_is_not_redispatched(
        world: World) -> None:
    policy = tether.RedispatchPolicy(retry_safe=RETRY_SAFE | {"bump_counter"})

    async def bumps_then_cut(ctx: tether.Context) -> None:
        await ctx.call(bump_counter, name="visits")
        raise tether.StreamCut(CUT)

    handle = await world.sup.delegate(scripted(bumps_then_cut), tools=[read_file, bump_counter],
                                      redispatch=policy)
    with pytest.raises(tether.DelegationError):
        await handle.result()
    assert await world.decisions(handle) == [(1, "attempt_ended", "side_effect_started")]


async def test_when_no_tool_ran_the_surface_does_not_matter(world: World) -> None:
    async def cut_at_once(ctx: tether.Context) -> None:
        raise tether.StreamCut(tether.protocol.CutReason.CONNECT_TIMEOUT)

    async def write(ctx: tether.Context) -> str:
        return "done"

    handle = await world.sup.delegate(scripted(cut_at_once, write), tools=[write_file, bash])
    await settle(world)
    assert await handle.result() == "done"
    assert await world.decisions(handle) == [(1, "attempt_ended", "redispatch_no_tool_ran")]


async def test_cancel_before_the_settle_delay(world: World) -> None:
    handles: list[tether.Handle] = []

    async def cancel_on_first_stop(e: tether.protocol.HookEvent) -> None:
        if e.delegation_id == handles[0].attempts[0]:  # hooks fire for nested children too
            await handles[0].cancel("user pressed escape")

    world.on_stop = cancel_on_first_stop
    handles.append(await world.sup.delegate(scripted(research_then_cut, findings),
                                            tools=RESEARCH))
    with pytest.raises(tether.DelegationError):
        await handles[0].result()
    assert await world.decisions(handles[0]) == [(1, "attempt_ended", "cancelled_before_delay")]
    assert len(handles[0].attempts) == 1


async def test_cancel_during_the_settle_delay_cuts_it_short(world: World) -> None:
    handle = await world.sup.delegate(scripted(research_then_cut, findings), tools=RESEARCH)
    await world.clock.sleeping(1, at_least=world.sup.redispatch.settle_delay)
    await handle.cancel("changed my mind")  # the clock is never advanced: the cancel ends it
    with pytest.raises(tether.DelegationError):
        await handle.result()
    assert await world.decisions(handle) == [(1, "attempt_ended", "redispatch"),
                                             (1, "after_delay", "cancelled_during_delay")]
    assert len(handle.attempts) == 1


async def test_cancel_during_the_fork_tears_the_new_child_down(world: World) -> None:
    handles: list[tether.Handle] = []

    async def cancel_while_forking(e: tether.protocol.HookEvent) -> None:
        if e.task_id == handles[0].task_id and e.attempt == 2:
            await handles[0].cancel("too late")

    world.on_start = cancel_while_forking
    handles.append(await world.sup.delegate(scripted(research_then_cut, findings),
                                            tools=RESEARCH))
    await settle(world)
    with pytest.raises(tether.DelegationError):
        await handles[0].result()
    rows = [d for d in await world.sup.journal.delegations() if d.task_id == handles[0].task_id
            and d.parent_id is None]
    assert [(r.attempt, r.state) for r in rows] == [
        (1, tether.DelegationState.FAILED), (2, tether.DelegationState.CANCELLED)]
    assert await world.decisions(handles[0]) == [(1, "attempt_ended", "redispatch"),
                                                 (2, "after_fork", "cancelled_during_fork")]
    assert ("stop", 2, "CANCELLED") in world.hooks  # a terminal record, never a silent drop
    assert not any(h[0] == "redispatch" for h in world.hooks)


@pytest.mark.parametrize(("budget", "attempts", "last"), [
    (0, 1, "retry_disabled"), (1, 2, "budget_spent"), (3, 4, "budget_spent")])
async def test_budget(world: World, budget: int, attempts: int, last: str) -> None:
    async def always_cut(ctx: tether.Context) -> None:
        await ctx.call(read_file, path="x")
        raise tether.StreamCut(CUT)

    handle = await world.sup.delegate(
        always_cut, tools=RESEARCH,
        redispatch=tether.RedispatchPolicy(retry_safe=RETRY_SAFE, budget=budget))
    for _ in range(attempts - 1):
        await settle(world)
    with pytest.raises(tether.DelegationError):
        await handle.result()
    assert len(handle.attempts) == attempts
    assert (await world.decisions(handle))[-1][2] == last


async def test_a_requested_ceiling_is_never_redispatched(world: World) -> None:
    async def capped(ctx: tether.Context) -> None:
        raise tether.errors.CeilingReached("tool_loop_cap", "50 tool calls")

    handle = await world.sup.delegate(capped, tools=RESEARCH)
    with pytest.raises(tether.DelegationError):
        await handle.result()
    assert await world.decisions(handle) == [(1, "attempt_ended", "ceiling")]
    assert (await world.sup.journal.get(handle.id)).failure == "ceiling:tool_loop_cap"


async def test_a_salvaged_partial_is_the_result(world: World) -> None:
    async def cut_with_text(ctx: tether.Context) -> None:
        await ctx.call(read_file, path="x")
        raise tether.StreamCut(CUT, tether.protocol.Partial(text="half the answer"))

    handle = await world.sup.delegate(cut_with_text, tools=RESEARCH)
    partial = await handle.result()
    assert isinstance(partial, tether.protocol.Partial) and partial.text == "half the answer"
    row = await world.sup.journal.get(handle.id)
    assert row.state is tether.DelegationState.SUCCEEDED_PARTIAL
    assert row.result == {"partial": True, "text": "half the answer", "tool_results": []}
    assert await world.decisions(handle) == [(1, "attempt_ended", "partial_salvaged")]


async def test_an_ordinary_error_is_not_redispatched(world: World) -> None:
    async def broken(ctx: tether.Context) -> None:
        raise KeyError("oops")

    handle = await world.sup.delegate(broken, tools=RESEARCH)
    with pytest.raises(tether.DelegationError):
        await handle.result()
    assert await world.decisions(handle) == [(1, "attempt_ended", "not_a_cut")]


async def test_attempt_numbers_reach_hooks_spans_and_metrics(world: World) -> None:
    handle = await world.sup.delegate(scripted(research_then_cut, findings), tools=RESEARCH)
    await settle(world)
    await handle.result()
    root = [h for h in world.hooks if h[0] in ("start", "stop", "redispatch")]
    assert ("start", 1, None) in root and ("stop", 1, "FAILED") in root
    assert ("redispatch", 2, None) in root and ("stop", 2, "SUCCEEDED") in root
    assert root.index(("redispatch", 2, None)) > root.index(("start", 2, None))
    attempts = [s for s in world.spans.get_finished_spans()
                if s.name.startswith("invoke_agent ") and s.attributes
                and "tether.attempt" in s.attributes
                and s.attributes["tether.task"] == handle.task_id]
    by_attempt = {s.attributes["tether.attempt"]: s for s in attempts if s.attributes}
    assert set(by_attempt) == {1, 2}
    assert by_attempt[1].context.trace_id != by_attempt[2].context.trace_id  # fresh trace
    assert by_attempt[1].attributes is not None
    assert by_attempt[1].attributes["tether.outcome"] == "FAILED"
    actions = [s for s in world.spans.get_finished_spans()
               if s.name.startswith("execute_tool ")]
    assert actions
    assert all(s.attributes and "tether.attempt" in s.attributes for s in actions)
    data = world.metrics.get_metrics_data()
    assert data is not None
    points = {(m.name, tuple(sorted(p.attributes.items())), getattr(p, "value", None))
              for rm in data.resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points
              if p.attributes}
    assert ("tether.children.failed",
            (("attempt", 1), ("reason", "stream_cut:stream_incomplete")), 1) in points
    assert ("tether.redispatch.decisions", (("check", "attempt_ended"), ("code", "redispatch")),
            1) in points


def test_policy_is_checked() -> None:
    with pytest.raises(tether.errors.UserError):
        tether.RedispatchPolicy(budget=-1)
    with pytest.raises(tether.errors.UserError):
        tether.RedispatchPolicy(settle_delay=float("nan"))


def test_the_retry_safe_set_is_literal_and_never_admits_a_shell() -> None:
    policy = tether.RedispatchPolicy(retry_safe=frozenset({"bash", "read_file"}))
    verdict = tether.protocol.decide_redispatch(tether.protocol.AttemptFacts(
        tether.protocol.Ending.STREAM_CUT, False, 1, 0, 1, ("read_file", "bash"), {},
        frozenset({"read_file", "bash"}), 0, 0), policy)
    assert verdict.code is Code.SHELL_TOOL


def test_research_registry_entry_is_eligible_by_the_pure_decision() -> None:
    """Anti-drift: the research surface as the supervisor describes it, not a hand-made set."""
    from tether._runtime.attempts import surface_facts
    from tether._runtime.state import ChildRuntime
    from tether._runtime.tools import check_surface

    rt = ChildRuntime.__new__(ChildRuntime)
    rt.surface = check_surface(RESEARCH, "test")
    surface, agents, known = surface_facts(rt)
    assert surface == ("read_file", "web_fetch", "agent:git_investigator")
    assert agents == {"git_investigator": ("read_file", "grep")}
    verdict = tether.protocol.decide_redispatch(tether.protocol.AttemptFacts(
        tether.protocol.Ending.STREAM_CUT, False, 1, 0, 3, surface, agents, known, 0, 0),
        tether.RedispatchPolicy(retry_safe=RETRY_SAFE))
    assert verdict.code is Code.REDISPATCH
