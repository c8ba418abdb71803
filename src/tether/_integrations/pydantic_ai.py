"""Run a pydantic-ai ``Agent`` as a tether child.

The run's assembled toolset (the agent's own tools included) is wrapped, through a
capability's ``get_wrapper_toolset``, in a ``WrapperToolset`` whose ``call_tool`` passes
tether's gateway with the effect the operator declares (EXTERNAL when not declared), under the
name the model calls: a prefixed or renamed toolset's tools are keyed, declared and journaled
by their visible names, and a dynamic toolset's (``@agent.toolset``), known only once the run
builds them, likewise (its surface then admits any tool: not retry-safe once a tool ran). A
structured output is stored as its JSON and rebuilt with the output type (outputs.py). A tool
that asks the model to retry (``ModelRetry``), defers or awaits approval did not apply: FAILED.
A tool listed in ``delegates`` runs a sub-agent with ``delegate(sub_agent, prompt)``: a nested
delegation with its own keys and fence, itself not journaled as an action (that planned tool
only: another under its name passes the gateway). Output functions are refused when the agent
is built (``_refuse_output_functions`` says why). The run's own
stops line up with tether's: a recall or terminate ends the run at its next tool call or step,
and ``RunCancelled`` (the application cancelled or timed out its own run) or a usage limit is a
ceiling, never re-dispatched. A model call that fails in transit raises ``StreamCut``. A call's
span carries the model's ``tool_call_id``; with pydantic-ai's instrumentation on, its spans nest
under tether's and its agent-run and tool spans give way to tether's (``_Spans``).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NewType, get_origin

from pydantic_ai import Agent as PaiAgent
from pydantic_ai._output import types_from_output_spec
from pydantic_ai.agent import _run_instrumentation_settings
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.capabilities.instrumentation import Instrumentation
from pydantic_ai.exceptions import (
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    RunCancelled,
    UsageLimitExceeded,
)
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.instrumented import InstrumentationSettings, InstrumentedModel
from pydantic_ai.output import NativeOutput, PromptedOutput, TextOutput, ToolOutput, _ChoicesActions
from pydantic_ai.tools import RunContext
from pydantic_ai.toolsets import (
    AbstractToolset,
    CombinedToolset,
    DynamicToolset,
    FunctionToolset,
    PrefixedToolset,
    RenamedToolset,
    WrapperToolset,
)
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_ai.toolsets.function import FunctionToolsetTool
from pydantic_core import to_jsonable_python

from tether._core.errors import ControlSignal, ToolRejected, UserError
from tether._core.model import Effect
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE
from tether._core.redispatch import UNRESTRICTED, CeilingReached, Partial, StreamCut
from tether._integrations.cuts import cut_reason
from tether._integrations.outputs import output_codec
from tether._runtime.gateway import Context, model_call
from tether._runtime.tools import Agent, OutputCodec, ProbeFn, Tool

EventFn = Callable[[Any], Any]
_Call = tuple[AbstractToolset[Any], str, dict[str, Any], RunContext[Any], ToolsetTool[Any]]

_KEY: ContextVar[_KeyFrame | None] = ContextVar("tether_pydantic_ai_key", default=None)
_BINDING: ContextVar[_Binding | None] = ContextVar("tether_pydantic_ai_binding", default=None)
_CALL: ContextVar[_Call | None] = ContextVar("tether_pydantic_ai_call", default=None)


def idempotency_key() -> str | None:
    """Inside a tool run through tether: the key to send to the outside world. None elsewhere,
    including in the tools of an agent run inside the tool, and in tasks or threads the tool
    spawns (read the key first, then hand it to them)."""
    frame = _KEY.get()
    if frame is None:
        return None
    try:
        task: object = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread: a sync tool in pydantic-ai's worker
        if frame.sync and frame.thread is None:
            frame.thread = threading.get_ident()  # the first thread to ask is the tool's own
        return frame.key if frame.thread == threading.get_ident() else None
    return frame.key if task is frame.task else None


@dataclass(eq=False)
class _KeyFrame:
    """One tether call's key, and where its tool function runs: pydantic-ai awaits an async
    tool in the task that calls the toolset (ours), and runs a sync one in a worker thread
    (or, threads disabled, in that task). An agent run started inside the tool runs its own
    tools in tasks (and threads) of its own, which inherit the variable but are not tether
    calls: they must not reuse this call's key."""

    key: str
    task: object
    sync: bool
    thread: int | None = None


@dataclass(frozen=True)
class _Binding:
    ctx: Context
    tools: Mapping[str, Tool]
    delegates: Mapping[str, object]  # visible name -> the planned tool's function schema
    nested: Mapping[int, Agent]  # pydantic-ai agent id -> its tether agent
    dynamic: Callable[[str], Tool] | None  # the tool for a name a dynamic toolset shows


class _NotApplied(ToolRejected):
    """The tool asked for a retry, deferred or awaits approval: it did not apply."""

    def __init__(self, original: Exception) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


@dataclass
class TetherToolset(WrapperToolset[Any]):
    """Calls the wrapped toolset's tools through tether's gateway inside a tether child, and
    directly outside one."""

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        binding = _BINDING.get()
        # Only the planned delegate tool itself runs outside the gateway (its sub-agent runs
        # as a nested delegation): another tool under its name (a dynamic toolset's, a
        # step's filtered or renamed one) passes the gateway like any other.
        if binding is None or _schema_of(tool) is binding.delegates.get(name, _NONE):
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        found = binding.tools.get(name)
        if found is None and binding.dynamic is not None:
            found = binding.dynamic(name)
        if found is None:
            raise UserError(f"tool {name} is not in this agent's surface")
        token = _CALL.set((self.wrapped, name, tool_args, ctx, tool))
        try:
            with model_call(ctx.tool_call_id):
                return await binding.ctx.call(found, **to_jsonable_python(tool_args))
        except _NotApplied as exc:  # journaled FAILED; pydantic-ai handles the original
            raise exc.original from None
        finally:
            _CALL.reset(token)


    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        listed = await self.wrapped.get_tools(ctx)
        binding = _BINDING.get()
        if binding is not None and binding.dynamic is None:
            # A toolset that renames in a way tether did not foresee: refused before the
            # model can call it, not when it does.
            unknown = sorted(set(listed) - set(binding.tools) - set(binding.delegates))
            if unknown:
                raise UserError(f"tool {', '.join(unknown)} is offered to the model under a "
                                "name tether did not plan (a toolset that renames tools?)")
        return listed


@dataclass(init=False)
class _Gateway(AbstractCapability[Any]):
    """Wraps the run's assembled toolset (the agent's own tools included) in TetherToolset."""

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        return TetherToolset(toolset)


@dataclass
class _Spans(Instrumentation):
    """pydantic-ai's own instrumentation, when it is on, for a run under tether: its model
    request spans (and the rest) nest under tether's attempt span, but it makes no agent-run
    span and no span for a call tether's gateway runs. tether's ``invoke_agent`` and
    ``execute_tool`` spans are those operations' spans, and only they can say how they ended:
    a recalled call runs on, shielded, after the run was cancelled, and its outcome is the one
    the journal settles, not the run's cancellation. A planned delegate tool, which tether runs
    as a nested delegation rather than a call, keeps pydantic-ai's span."""

    async def wrap_run(self, ctx: RunContext[Any], *, handler: Any) -> Any:
        return await handler()

    async def wrap_tool_execute(self, ctx: RunContext[Any], *, call: ToolCallPart,
                                tool_def: Any, args: Any, handler: Any) -> Any:
        binding = _BINDING.get()
        if binding is not None and call.tool_name in binding.delegates:
            return await super().wrap_tool_execute(ctx, call=call, tool_def=tool_def, args=args,
                                                   handler=handler)
        return await handler(args)


def _instrumentation(agent: PaiAgent[Any, Any]) -> tuple[InstrumentationSettings | None, Any]:
    """The settings pydantic-ai would instrument a run of ``agent`` with when they come from
    ``agent.instrument``, ``Agent.instrument_all`` or an ``InstrumentedModel`` (its own
    resolution, private, within the pinned range), and the model the run is to use (the one
    inside an ``InstrumentedModel``, which would make its model spans a second time beside a
    run's own ``Instrumentation``; None: the agent's). None if off, or if the agent has an
    ``Instrumentation`` capability of its own: a run may not hold another class under its id,
    so that one's spans are kept (they nest under tether's, and repeat its two operations)."""
    if _run_instrumentation_settings([agent._effective_root_capability()]) is not None:
        return None, None
    model = agent.model
    if isinstance(model, InstrumentedModel):
        return model.instrumentation_settings, model.wrapped
    return agent._resolve_instrumentation_settings(), None


async def delegate(agent: PaiAgent[Any, Any], prompt: str) -> Any:
    """Inside a tool listed in ``delegates``: run ``agent`` as a nested tether delegation and
    return its output (outside tether, run it directly)."""
    binding = _BINDING.get()
    if binding is None:
        return (await agent.run(prompt)).output
    nested = binding.nested.get(id(agent))
    if nested is None:
        raise UserError(f"agent {agent.name} is not a declared sub-agent: pass it in "
                        "as_tether_agent(..., delegates={tool: agent})")
    handle = await binding.ctx.delegate(nested, prompt)
    return await handle.result()


def _gateway_fn(name: str) -> Callable[..., Any]:
    async def run(idempotency_key: str | None = None, **_arguments: Any) -> Any:
        current = _CALL.get()
        if current is None:
            raise UserError(f"{name} runs only inside its pydantic-ai run")
        wrapped, tool_name, args, run_ctx, tool = current
        frame = None if idempotency_key is None else _KeyFrame(
            idempotency_key, asyncio.current_task(), sync=not _is_async(tool))
        token = _KEY.set(frame)
        try:
            return await wrapped.call_tool(tool_name, args, run_ctx, tool)
        except (ModelRetry, CallDeferred, ApprovalRequired) as exc:
            raise _NotApplied(exc) from None
        finally:
            _KEY.reset(token)

    run.__name__ = name
    return run


_NONE = object()  # matches no tool's schema


def _function_tool(tool: ToolsetTool[Any]) -> FunctionToolsetTool[Any] | None:
    """The function toolset's tool behind ``tool``: a prefixing or renaming wrapper copies
    it, a combined toolset's holds it as ``source_tool``; None for a tool of another kind."""
    while not isinstance(tool, FunctionToolsetTool):
        source = getattr(tool, "source_tool", None)
        if not isinstance(source, ToolsetTool):
            return None
        tool = source
    return tool


def _schema_of(tool: ToolsetTool[Any]) -> object | None:
    """The function schema a function tool calls: one per tool a FunctionToolset holds, so it
    tells the planned tool from another of the same name."""
    found = _function_tool(tool)
    return None if found is None else getattr(found.call_func, "__self__", None)


def _is_async(tool: ToolsetTool[Any]) -> bool:
    """Whether pydantic-ai awaits the tool's function (else runs it in a worker thread);
    async when unknown."""
    found = _function_tool(tool)
    return True if found is None else found.is_async


def _visible(toolset: AbstractToolset[Any],
             refused: list[str]) -> tuple[dict[str, object], bool]:
    """The tool names the model sees from ``toolset`` (those its calls carry), each with the
    function schema its calls run (to know a planned delegate tool by), and whether a
    dynamic toolset adds names known only once the run builds it. A wrapper that filters or
    prepares tools keeps their names (pydantic-ai refuses a prepare that renames); one of
    another kind that renames is caught when the run lists its tools (TetherToolset)."""
    if isinstance(toolset, FunctionToolset):
        return {n: t.function_schema for n, t in toolset.tools.items()}, False
    if isinstance(toolset, DynamicToolset):
        return {}, True
    if isinstance(toolset, CombinedToolset):
        names: dict[str, object] = {}
        dynamic = False
        for inner in toolset.toolsets:
            more, more_dynamic = _visible(inner, refused)
            names.update(more)
            dynamic = dynamic or more_dynamic
        return names, dynamic
    if isinstance(toolset, WrapperToolset):
        names, dynamic = _visible(toolset.wrapped, refused)
        if isinstance(toolset, PrefixedToolset):
            names = {f"{toolset.prefix}_{n}": t for n, t in names.items()}
        elif isinstance(toolset, RenamedToolset):
            shown = {old: new for new, old in toolset.name_map.items()}
            names = {shown.get(n, n): t for n, t in names.items()}
        return names, dynamic
    kind = type(toolset).__name__
    refused.append(toolset.label if toolset.label == kind else f"{toolset.label} ({kind})")
    return {}, False


def _function_tools(agent: PaiAgent[Any, Any]) -> tuple[dict[str, object], bool]:
    names: dict[str, object] = {}
    dynamic = False
    refused: list[str] = []
    for toolset in agent.toolsets:
        more, more_dynamic = _visible(toolset, refused)
        names.update(more)
        dynamic = dynamic or more_dynamic
    if refused:
        raise UserError(
            f"agent {agent.name}: tether cannot mediate toolset {', '.join(refused)}: it "
            "mediates function tools (@agent.tool, FunctionToolset, prefixed, renamed, "
            "filtered or prepared) and @agent.toolset dynamic toolsets; MCP servers go "
            "through tether.mcp")
    return dict(sorted(names.items())), dynamic


def _output_functions(spec: Any) -> list[str]:
    """The functions an output spec has pydantic-ai call to make the run's output (an output
    function, bare or in ToolOutput, NativeOutput, PromptedOutput or TextOutput, and the
    callable values of a Choices set): walked as ``types_from_output_spec`` walks it."""
    found: list[str] = []
    for item in spec if isinstance(spec, Sequence) and not isinstance(spec, str) else (spec,):
        if isinstance(item, NativeOutput | PromptedOutput):
            found += _output_functions(item.outputs)
        elif isinstance(item, ToolOutput):
            found += _output_functions(item.output)
        elif isinstance(item, TextOutput):
            found.append(getattr(item.output_function, "__name__", repr(item.output_function)))
        elif _ChoicesActions.of(item) is not None:
            found.append(f"the callable values of {getattr(item, '__name__', item)!s}")
        elif isinstance(item, type | NewType) or get_origin(item) is not None:
            continue  # a type (list[int] and NewType are callable, and types all the same)
        elif callable(item):  # fail closed: a partial or a callable object is a function too
            found.append(getattr(item, "__name__", None) or repr(item))
    return found


def _refuse_output_functions(agent: PaiAgent[Any, Any], label: str) -> None:
    """An output function runs when the model calls it (as ``final_result``, or on its text),
    from pydantic-ai's output handling, which no toolset wraps: tether could neither journal,
    key, fence nor probe it, and a lost reply from it would read as a cut with no tool run,
    re-dispatched to run it again. Refused (mediating it would mean rewriting the output spec
    with wrappers that mimic pydantic-ai's own signature and context handling)."""
    functions = _output_functions(agent.output_type)
    if functions:
        raise UserError(
            f"agent {label}: output function {', '.join(functions)} would run outside "
            "tether's gateway (not journaled, keyed, fenced or probed): do the work in a tool "
            "(@agent.tool, mediated) and declare a plain output type (a model, dataclass, "
            "TypedDict, a union of them, or str)")


def _signal(exc: BaseException) -> BaseException:
    """A tether stop raised inside pydantic-ai's task group reaches us in an exception group:
    the stop itself is what the supervisor must see."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _signal(inner)
            if isinstance(found, ControlSignal | StreamCut):
                return found
    return exc


def _partial(messages: list[Any]) -> Partial:
    results = tuple(to_jsonable_python(p.content) for m in messages for p in m.parts
                    if isinstance(p, ToolReturnPart))
    text = "".join(p.content for m in messages[-1:] if isinstance(m, ModelResponse)
                   for p in m.parts if isinstance(p, TextPart))
    return Partial(text, results)


def as_tether_agent(agent: PaiAgent[Any, Any], *, effects: Mapping[str, Effect] | None = None,
                    probes: Mapping[str, ProbeFn] | None = None,
                    deadlines: Mapping[str, float] | None = None, name: str | None = None,
                    delegates: Mapping[str, PaiAgent[Any, Any]] | None = None,
                    deps: Any = None, on_event: EventFn | None = None) -> Agent:
    """A tether agent that runs ``agent`` on its input prompt through the gateway.
    ``effects``, ``probes`` and ``deadlines`` are keyed by tool name (sub-agents' tools
    included); ``delegates`` maps a tool name to the sub-agent it runs with ``delegate``;
    ``deps`` are the run's dependencies; ``on_event`` (sync or async) receives each node."""
    effects, probes, deadlines = dict(effects or {}), dict(probes or {}), dict(deadlines or {})
    for tool_name, effect in effects.items():
        if not isinstance(effect, Effect) or effect is Effect.DELEGATE:
            raise UserError(f"effect of {tool_name!r} must be a tether.Effect other than DELEGATE")
    for pai in (agent, *(delegates or {}).values()):
        _refuse_output_functions(pai, (name if pai is agent else None) or pai.name or "agent")
    made: dict[int, Agent] = {}
    tools: dict[str, Tool] = {}
    subs = dict(delegates or {})
    planned = {id(pai): _function_tools(pai) for pai in (agent, *subs.values())}
    static = {n for names, _ in planned.values() for n in names} - set(subs)
    # Names declared but not among the static tools can only be tools a dynamic toolset
    # builds during the run: they cannot be checked before it, so only then are they kept.
    later = sorted((set(effects) | set(probes) | set(deadlines)) - static)
    if later and not any(dynamic for _, dynamic in planned.values()):
        raise UserError(f"agent {name or agent.name or 'agent'} has no tool named "
                        f"{', '.join(later)}")

    def make(n: str) -> Tool:
        return tools.setdefault(n, Tool(
            n, effects.get(n, Effect.EXTERNAL), _gateway_fn(n), probe=probes.get(n),
            dispatch_deadline=deadlines.get(n, DEFAULT_DISPATCH_DEADLINE)))

    def plan(pai: PaiAgent[Any, Any], subs: Mapping[str, PaiAgent[Any, Any]],
             label: str) -> Agent:
        if id(pai) in made:
            return made[id(pai)]
        names, dynamic = planned.get(id(pai)) or _function_tools(pai)
        missing = sorted(set(subs) - set(names))
        if missing:
            raise UserError(f"agent {label} has no tool named {', '.join(missing)}")
        nested = {id(sub): plan(sub, {}, sub.name or "sub_agent") for sub in subs.values()}
        own = {n: make(n) for n in (*names, *(later if dynamic else ())) if n not in subs}
        planned_subs = {n: names[n] for n in subs}
        # A dynamic toolset's tools are known only as the run builds them: the surface admits
        # any tool (so it is never retry-safe once a tool ran; the journal still proves when
        # none did) and each one passes the gateway under the name the model calls.
        binding_of = (own, planned_subs, nested, make if dynamic else None)
        grants: tuple[str, ...] = (UNRESTRICTED,) if dynamic else ()

        async def run(ctx: Context, prompt: Any) -> Any:
            token = _BINDING.set(_Binding(ctx, *binding_of))
            messages: list[Any] = []
            settings, model = _instrumentation(pai)
            # A run's own Instrumentation replaces the agent's (pydantic-ai's precedence).
            caps: list[AbstractCapability[Any]] = [_Gateway()] if settings is None else [
                _Spans(settings=settings), _Gateway()]
            try:
                async with pai.iter(prompt, deps=deps, capabilities=caps,
                                    model=model) as agent_run:
                    async for node in agent_run:
                        messages = agent_run.all_messages()
                        if on_event is not None:
                            forwarded = on_event(node)
                            if inspect.isawaitable(forwarded):
                                await forwarded
                        ctx.check()
                    assert agent_run.result is not None
                    return agent_run.result.output
            except (RunCancelled, UsageLimitExceeded) as exc:
                raise CeilingReached(type(exc).__name__, str(exc)) from None
            except BaseException as exc:
                found = _signal(exc)
                reason = cut_reason(found) if isinstance(found, Exception) else None
                if reason is not None:
                    raise StreamCut(reason, _partial(messages), repr(found)) from None
                if found is not exc:
                    raise found from None
                raise
            finally:
                _BINDING.reset(token)

        made[id(pai)] = Agent(label, run, (*own.values(), *nested.values(), *grants),
                              output=_output(pai))
        return made[id(pai)]

    return plan(agent, subs, name or agent.name or "agent")


def _output(agent: PaiAgent[Any, Any]) -> OutputCodec | None:
    """How the run's output is stored: the types pydantic-ai itself reads from the agent's
    output spec (its ``output_json_schema`` uses the same function; private, within the
    pydantic-ai range pinned in pyproject.toml)."""
    return output_codec(types_from_output_spec(agent.output_type))


__all__ = ["TetherToolset", "as_tether_agent", "cut_reason", "delegate", "idempotency_key"]
