"""Run an OpenAI Agents SDK agent graph as tether children.

Every function tool reachable from the agent, through handoffs and ``Agent.as_tool``
sub-agents at any depth, passes tether's gateway with the effect the operator declares
(EXTERNAL when not declared: fail closed); a sub-agent is a nested delegation with its own id,
keys and fence, so recalling the root stops it too (I10). A recall stops new tool calls and
lets in-flight ones finish within the grace window, a terminate cancels them and reconciles
them with their probes, and a model stream cut in transit raises ``StreamCut`` so the
re-dispatch rules decide. Only the SDK's public API runs the agents (see
openai_agents_graph.py for the two links it reads to find them).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from agents import Agent as SdkAgent
from agents import (
    AgentOutputSchema,
    AgentOutputSchemaBase,
    FunctionTool,
    Handoff,
    MaxTurnsExceeded,
    RunConfig,
    RunHooks,
    Runner,
    RunResultStreaming,
    Session,
    StreamEvent,
    default_tool_error_function,
)
from agents.agent_tool_input import resolve_agent_tool_input
from agents.tool import maybe_invoke_function_tool_failure_error_function
from agents.tool_context import ToolContext

from tether._core.errors import ControlSignal, DelegationError, UserError
from tether._core.model import Effect
from tether._core.redispatch import CeilingReached, Partial, StreamCut
from tether._integrations.cuts import cut_reason
from tether._integrations.openai_agents_graph import (
    TOOL_CONTEXT,
    AgentToolOptions,
    Plan,
    Planner,
    current_key,
)
from tether._integrations.outputs import output_codec
from tether._runtime.gateway import Context, model_call
from tether._runtime.tools import Agent, OutputCodec, ProbeFn, Tool

EventFn = Callable[[StreamEvent], Any]


def idempotency_key() -> str | None:
    """Inside a function tool run through tether: the key to send to the outside world. None
    elsewhere, including in the tools of an agent run inside the tool, and in tasks the tool
    spawns (read the key first, then hand it to them)."""
    return current_key()


@dataclass(frozen=True)
class RunOptions:
    """The SDK's run options, passed to ``Runner.run_streamed`` unchanged. A nested
    sub-agent's run gets the same context, hooks and run config, and no session."""

    max_turns: int
    context: Any
    hooks: RunHooks[Any] | None
    run_config: RunConfig | None
    session: Session | None
    on_event: EventFn | None


@dataclass
class _Stopping:
    """The stop (a recall or terminate) a tool of this run met. A tool never raises it into the
    SDK: the SDK runs one model turn's tool calls as sibling tasks, and a stop raised by one
    of them (a BaseException) while the run is being torn down, by a sibling's stop or by the
    drain cancelling it, is logged by the SDK as a fatal background failure with its
    traceback. The tool returns a line saying it did not run, and the run raises the stop at
    its next event, or as it ends."""

    signal: ControlSignal | None = None

    def check(self, ctx: Context) -> None:
        if self.signal is not None:
            raise self.signal
        ctx.check()

    def met(self, signal: ControlSignal) -> str:
        self.signal = self.signal or signal
        return f"not run: the delegation was stopped ({signal})"


@dataclass(eq=False)
class _AgentToolCall:
    """One call of an ``as_tool`` tool: its options, for the nested run (which reads them from
    AS_TOOL, set where the nested delegation starts, so every attempt of it sees them), and
    the result of the nested run's last attempt, for ``custom_output_extractor``."""

    options: AgentToolOptions
    result: RunResultStreaming | None = None


AS_TOOL: ContextVar[_AgentToolCall | None] = ContextVar("tether_as_tool", default=None)


def _mediated(ctx: Context, tool: Tool, sdk: FunctionTool, stopping: _Stopping) -> FunctionTool:
    async def on_invoke(context: ToolContext[Any], raw: str) -> Any:
        try:
            arguments = json.loads(raw) if raw else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # let the SDK's own invoker report it
            return await sdk.on_invoke_tool(context, raw)
        token = TOOL_CONTEXT.set(context)  # copied into the action's task
        try:
            with model_call(context.tool_call_id):
                return await ctx.call(tool, **arguments)
        except ControlSignal as signal:
            return stopping.met(signal)
        except Exception as exc:  # recorded by the gateway; the model hears of it as usual
            return default_tool_error_function(context, exc)
        finally:
            TOOL_CONTEXT.reset(token)

    return dataclasses.replace(sdk, on_invoke_tool=on_invoke)


async def _failed(sdk: FunctionTool, context: ToolContext[Any], exc: Exception) -> Any:
    """What the tool's own failure function (``as_tool(failure_error_function=...)``) tells the
    model; with none, the error propagates, as in the SDK."""
    said = await maybe_invoke_function_tool_failure_error_function(
        function_tool=sdk, context=context, error=exc)
    if said is None:
        raise exc
    return said


def _nested(ctx: Context, agent: Agent, sdk: FunctionTool, options: AgentToolOptions,
            stopping: _Stopping) -> FunctionTool:
    """An ``as_tool`` sub-agent run as a nested delegation of this one, its input built from
    the tool's parameters as the SDK builds it, its output the extractor's when there is one."""

    async def on_invoke(context: ToolContext[Any], raw: str) -> Any:
        try:
            parsed = options.params.validate_python(json.loads(raw) if raw else {})
            request = await resolve_agent_tool_input(
                params=options.params.dump_python(parsed, mode="json"),
                schema_info=options.schema_info, input_builder=options.input_builder)
        except Exception as exc:  # the model's arguments do not fit: the model hears of it
            return await _failed(sdk, context, exc)
        call = _AgentToolCall(options)
        token = AS_TOOL.set(call)
        try:
            handle = await ctx.delegate(agent, request)
        except ControlSignal as signal:
            return stopping.met(signal)
        finally:
            AS_TOOL.reset(token)
        try:
            result = await handle.result()
        except DelegationError as exc:
            try:
                ctx.check()  # stopped because this delegation was: stop here too
            except ControlSignal as signal:
                return stopping.met(signal)
            return await _failed(sdk, context, exc)
        if isinstance(result, Partial):
            return result.text
        if options.extractor is not None and call.result is not None:
            try:
                return await options.extractor(call.result)
            except Exception as exc:
                return await _failed(sdk, context, exc)
        return result

    return dataclasses.replace(sdk, on_invoke_tool=on_invoke)


def _bind(plan: Plan, ctx: Context, stopping: _Stopping) -> SdkAgent[Any]:
    """Clones of the plan's agents whose tools call the gateway of ``ctx`` and whose handoffs
    lead to each other's clones, never to the unmediated originals."""
    clones = {id(m): m.clone() for m in plan.members}

    def tool(item: Any, member: SdkAgent[Any]) -> Any:
        if id(item) in plan.tools:
            return _mediated(ctx, plan.tools[id(item)], item, stopping)
        if id(item) in plan.nested:
            return _nested(ctx, plan.nested[id(item)], item, plan.options[id(item)], stopping)
        name = getattr(item, "name", None)
        if isinstance(item, FunctionTool) or name not in plan.surface:
            # Added to the agent after tether planned it: it would run unseen (fail closed).
            raise UserError(f"tool {name or item!r} was added to agent {member.name} after "
                            "tether planned it; build the tether agent again")
        return item  # a hosted tool granted by name

    def handoff(item: Any, member: SdkAgent[Any]) -> Any:
        if isinstance(item, SdkAgent):
            if id(item) not in clones:  # a handoff added after planning: fail closed
                raise UserError(f"handoff to agent {item.name} was added to agent "
                                f"{member.name} after tether planned it")
            return clones[id(item)]
        original = item.on_invoke_handoff

        async def invoke(context: Any, raw: str) -> Any:
            target = await original(context, raw)
            if id(target) not in clones:  # fail closed: its tools would run unmediated
                raise UserError(f"handoff {item.tool_name} led to agent {target.name}, "
                                "which tether did not plan")
            return clones[id(target)]

        assert isinstance(item, Handoff)
        return dataclasses.replace(item, on_invoke_handoff=invoke)

    for member in plan.members:
        clone = clones[id(member)]
        clone.tools = [tool(t, member) for t in member.tools]
        clone.handoffs = [handoff(h, member) for h in member.handoffs]
    return clones[id(plan.root)]


async def _run(plan: Plan, options: RunOptions, ctx: Context, input: Any,
               top: bool) -> Any:
    # A sub-agent's run takes what its as_tool tool was given, else what the root's run has.
    call = None if top else AS_TOOL.get()
    given = call.options if call is not None else None
    stopping = _Stopping()
    result = Runner.run_streamed(
        _bind(plan, ctx, stopping), input, context=options.context,
        max_turns=given.max_turns if given and given.max_turns is not None
        else options.max_turns,
        hooks=given.hooks if given and given.hooks is not None else options.hooks,
        run_config=given.run_config if given and given.run_config is not None
        else options.run_config,
        session=options.session if top else None)
    text: list[str] = []
    outputs: list[Any] = []
    try:
        async for event in result.stream_events():
            if event.type == "raw_response_event" and \
                    event.data.type == "response.output_text.delta":
                text.append(event.data.delta)
            elif event.type == "run_item_stream_event" and event.name == "tool_output":
                outputs.append(getattr(event.item, "output", None))
            if options.on_event is not None:
                forwarded = options.on_event(event)
                if inspect.isawaitable(forwarded):
                    await forwarded
            stopping.check(ctx)  # a recalled child stops between events, not only at a tool
    except MaxTurnsExceeded as exc:
        stopping.check(ctx)
        raise CeilingReached("max_turns", str(exc)) from None
    except Exception as exc:
        stopping.check(ctx)
        reason = cut_reason(exc)
        if reason is None:
            raise
        raise StreamCut(reason, Partial("".join(text), tuple(outputs)), repr(exc)) from None
    finally:
        if not result.is_complete:
            result.cancel()
    if stopping.signal is not None:  # a tool met the stop as the run ended
        raise stopping.signal
    if call is not None:
        call.result = result  # the last attempt's, for the tool's output extractor
    return result.final_output


def _output(plan: Plan) -> OutputCodec | None:
    """How the run's final output is stored: it comes from whichever agent of the plan the
    run ended in (handoffs keep the run), so it is of one of their declared output types. An
    output schema of the user's own declares no Python type: its output is kept as JSON. An
    agent whose ``tool_use_behavior`` stops at a tool ends the run with that tool's output,
    of no declared type: kept as its JSON too, tagged apart from the declared types."""
    types: list[Any] = []
    at_tool = any(m.tool_use_behavior != "run_llm_again" for m in plan.members)
    for member in plan.members:
        declared = member.output_type
        if isinstance(declared, AgentOutputSchema):
            declared = declared.output_type
        elif isinstance(declared, AgentOutputSchemaBase):
            return output_codec(None)
        types.append(str if declared is None else declared)
    return output_codec(types, plain=at_tool)


def as_tether_agent(sdk_agent: SdkAgent[Any], *, effects: Mapping[str, Effect] | None = None,
                    probes: Mapping[str, ProbeFn] | None = None, max_turns: int = 10,
                    name: str | None = None, deadlines: Mapping[str, float] | None = None,
                    unmediated: Iterable[str] = (), context: Any = None,
                    hooks: RunHooks[Any] | None = None, run_config: RunConfig | None = None,
                    session: Session | None = None,
                    on_event: EventFn | None = None) -> Agent:
    """A tether agent that runs ``sdk_agent`` on its input (a string or a list of input
    items), streaming, through the gateway.

    ``effects``, ``probes`` and ``deadlines`` (seconds after a call's intent past which it can
    no longer apply) are keyed by function tool name, anywhere in the graph; a name the graph
    lacks is refused (a typo would leave a payment tool at the default). ``unmediated`` grants
    hosted tools by name: they run unseen, so the agent is never re-dispatched after a cut.
    ``context``, ``hooks``, ``run_config`` and ``session`` go to the SDK's runner; ``on_event``
    (sync or async) receives every stream event."""
    effects, probes = dict(effects or {}), dict(probes or {})
    deadlines = dict(deadlines or {})
    for tool_name, effect in effects.items():
        if not isinstance(effect, Effect) or effect is Effect.DELEGATE:
            raise UserError(f"effect of {tool_name!r} must be a tether.Effect other than DELEGATE")
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise UserError("max_turns must be a positive integer")
    if isinstance(unmediated, str):
        raise UserError("unmediated is a list of tool names, not one string")
    if on_event is not None and not callable(on_event):
        raise UserError("on_event must be a function taking a stream event")
    options = RunOptions(max_turns, context, hooks, run_config, session, on_event)
    root_id = id(sdk_agent)

    def make_agent(plan: Plan, agent_name: str) -> Agent:
        top = id(plan.root) == root_id

        async def run(ctx: Context, input: Any) -> Any:
            return await _run(plan, options, ctx, input, top)

        return Agent(agent_name, run, tuple(plan.surface), output=_output(plan))

    planner = Planner(effects, probes, deadlines, frozenset(unmediated), make_agent)
    agent = planner.plan(sdk_agent, (sdk_agent.name,), name or sdk_agent.name)
    unknown = sorted((set(effects) | set(probes) | set(deadlines)) - planner.function_names)
    if unknown:
        raise UserError(f"agent {sdk_agent.name} has no function tool named "
                        f"{', '.join(unknown)}")
    extra = sorted(set(unmediated) - planner.hosted_names)
    if extra:
        raise UserError(f"agent {sdk_agent.name} has no hosted tool named {', '.join(extra)}")
    return agent


__all__ = ["RunOptions", "as_tether_agent", "cut_reason", "idempotency_key"]
