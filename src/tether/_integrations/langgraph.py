"""Run a compiled LangGraph graph as a tether child.

Tool calls pass tether's gateway through ToolNode's public ``awrap_tool_call`` hook: build each
ToolNode with ``tool_node(tools)`` (or ``ToolNode(tools, awrap_tool_call=awrap_tool_call)``).
Each tool has the effect the operator declares (EXTERNAL when not declared). A callback on
every run refuses any tool that starts without passing the gateway (a ToolNode built without
the hook, a tool calling another tool), so nothing runs unseen. A tool that ran and answered
an error message is in doubt and probed; a model call that fails in transit raises
``StreamCut``; a graph with a checkpointer runs on the thread named after the tether task, so
re-delegating the task resumes it and replays completed actions instead of repeating them: its
calls are keyed by their place in the thread (the checkpoint step and the model's tool call
id), the same in every attempt. A checkpointed graph stopped at ``interrupt()`` ends as
``tether.Interrupted`` (INTERRUPTED) and runs on with ``Command(resume=...)`` when the
task is re-delegated with ``resume=``. A node built with ``subgraph(graph, name=...)`` runs that
subgraph as a nested delegation, in a checkpointed graph named by its step's place in the
thread (``Context.delegate_at``).
"""

from __future__ import annotations

import hashlib
import inspect
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast
from uuid import UUID

from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import (
    ToolMessage,
    convert_to_messages,
    messages_from_dict,
    messages_to_dict,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command
from pydantic import BaseModel, ValidationError

from tether._core.errors import UserError
from tether._core.model import Effect
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE
from tether._core.redispatch import Partial, StreamCut
from tether._core.waiting import Interrupted
from tether._integrations.cuts import cut_reason
from tether._runtime.gateway import Context, model_call
from tether._runtime.tools import Agent, ProbeFn, Tool

Execute = Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]]
EventFn = Callable[[Any], Any]

_KEY: ContextVar[str | None] = ContextVar("tether_langgraph_key", default=None)
_BINDING: ContextVar[_Binding | None] = ContextVar("tether_langgraph_binding", default=None)
_CALL: ContextVar[tuple[ToolCallRequest, Execute] | None] = ContextVar(
    "tether_langgraph_call", default=None)
# One-shot passes, bound by the guard to the tool run they admit: a list, so that the guard's
# copy of the context sees the same object.
_PASS: ContextVar[list[Any] | None] = ContextVar("tether_langgraph_pass", default=None)
_OURS: weakref.WeakSet[ToolNode] = weakref.WeakSet()


def idempotency_key() -> str | None:
    """Inside a tool run through tether: the key to send to the outside world."""
    return _KEY.get()


@dataclass(frozen=True)
class _Binding:
    ctx: Context
    tools: Mapping[str, Tool]
    checkpointed: bool


class _RanAndFailed(Exception):
    """The tool ran and ToolNode turned its failure into a message: it may have applied."""

    def __init__(self, message: ToolMessage) -> None:
        super().__init__(str(message.content)[:500])
        self.message = message


async def awrap_tool_call(request: ToolCallRequest, execute: Execute) -> ToolMessage | Command[Any]:
    """ToolNode's ``awrap_tool_call`` hook: inside a tether child, the call goes through the
    gateway; outside one, the graph runs as usual."""
    binding = _BINDING.get()
    if binding is None:
        return await execute(request)
    call = request.tool_call
    tool = binding.tools.get(call["name"])
    if tool is None:
        raise UserError(f"tool {call['name']} is not in a ToolNode of this graph")
    schema = getattr(request.tool, "tool_call_schema", None)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            schema.model_validate(call["args"])
        except ValidationError as exc:  # the tool would refuse it unrun: nothing to journal
            return ToolMessage(content=f"Error: invalid arguments for {call['name']}: {exc}",
                               name=call["name"], tool_call_id=call["id"], status="error")
    key = _thread_key(binding.ctx, request) if binding.checkpointed else None
    token = _CALL.set((request, execute))
    try:
        with model_call(call.get("id")):
            result = await binding.ctx.call(tool, idempotency_key=key, **call["args"])
    except _RanAndFailed as exc:  # journaled IN_DOUBT; the model hears of it as usual
        return exc.message
    finally:
        _CALL.reset(token)
    if isinstance(result, ToolMessage | Command):
        return result
    return ToolMessage(content=result, name=call["name"], tool_call_id=call["id"])


def _thread_key(ctx: Context, request: ToolCallRequest) -> str:
    """A checkpointed call's key: its task's, its tool's, and its place in the thread. LangGraph
    derives a step's task id (in ``checkpoint_ns``) from the checkpoint the step runs from, so
    a resumed step has the one it had and a later step another; the model's tool call id tells
    the calls of one step apart. An attempt-local count would give a resumed run's first new
    call the key of the thread's first call."""
    call = request.tool_call
    # Two calls of one step under one id would share a key: the second "replayed" from the
    # first (never made) or refused midway. Refused before either runs: the check is
    # synchronous, so every call of the step sees it before any reaches the gateway.
    if _step_ids(request.state).count(call.get("id")) > 1:
        raise UserError(f"the model gave tool call id {call.get('id')!r} to two calls of one "
                        "step: a checkpointed graph's calls are keyed by it")
    runtime = request.runtime
    config = getattr(runtime, "config", None) or {}
    namespace = config.get("configurable", {}).get("checkpoint_ns")
    if not namespace or not call.get("id"):
        raise UserError(f"tool call {call['name']} has no checkpoint step or tool call id: a "
                        "checkpointed graph's calls are keyed by both")
    place = hashlib.sha256(f"{namespace}\n{call['id']}".encode()).hexdigest()[:32]
    return f"{ctx.task_id}:{call['name']}:{place}"


def _step_ids(state: Any) -> list[Any]:
    """The tool call ids of the step's model message (the last one that called tools)."""
    messages = state.get("messages") if isinstance(state, dict) else state
    for message in reversed(messages if isinstance(messages, list) else []):
        calls = getattr(message, "tool_calls", None)
        if calls:
            return [c.get("id") for c in calls]
    return []


def tool_node(tools: Sequence[BaseTool | Callable[..., Any]], **kwargs: Any) -> ToolNode:
    """A ToolNode whose calls go through tether; ``kwargs`` as for ToolNode."""
    node = ToolNode(tools, awrap_tool_call=awrap_tool_call, **kwargs)
    _OURS.add(node)
    return node


def _gateway_fn(name: str) -> Callable[..., Awaitable[Any]]:
    async def run(idempotency_key: str | None = None, **_arguments: Any) -> Any:
        current = _CALL.get()
        if current is None:
            raise UserError(f"{name} runs only inside its graph's ToolNode")
        request, execute = current
        key, ticket = _KEY.set(idempotency_key), _PASS.set([name, None])  # [tool, its run]
        try:
            out = await execute(request)
        finally:
            _KEY.reset(key)
            _PASS.reset(ticket)
        if isinstance(out, ToolMessage):
            if out.status == "error":
                raise _RanAndFailed(out)
            if out.artifact is None:
                return out.content  # JSON, so that a replay can answer it
        return out

    run.__name__ = name
    return run


class _Guard(AsyncCallbackHandler):
    """Refuses a tool that starts without a pass from the gateway. A pass admits one tool run
    (a nested graph's run may carry its parent's guard too: both see the same run)."""

    raise_error = True

    async def on_tool_start(self, serialized: dict[str, Any], input_str: str, *,
                            run_id: UUID, **kwargs: Any) -> None:
        name = (serialized or {}).get("name", "?")
        ticket = _PASS.get()
        if ticket is None or ticket[0] != name or ticket[1] not in (None, run_id):
            raise UserError(f"tool {name} started without passing tether's gateway: build its "
                            "ToolNode with tether.langgraph.tool_node(...)")
        ticket[1] = run_id


def _to_json(state: Any) -> Any:
    """A messages state in JSON, to be a delegation's journaled argument or result."""
    if isinstance(state, dict) and isinstance(state.get("messages"), list):
        return {**state, "messages": messages_to_dict(convert_to_messages(state["messages"]))}
    return state


def _from_json(data: Any) -> Any:
    if isinstance(data, dict) and isinstance(data.get("messages"), list):
        return {**data, "messages": messages_from_dict(data["messages"])}
    return data


class Subgraph:
    """A graph node that runs a compiled subgraph as a nested tether delegation (its own id,
    keys and fence), or directly outside tether. Its state goes through the journal as JSON:
    a messages state, with JSON values besides."""

    def __init__(self, graph: Any, agent: Agent) -> None:
        self.graph = graph
        self.agent = agent

    async def __call__(self, state: Any, config: RunnableConfig) -> Any:
        binding = _BINDING.get()
        if binding is None:
            return await self.graph.ainvoke(state)
        # In a checkpointed parent the nested task is named by its step's place in the
        # thread: a resumed run counts its subgraphs from 0 again, so a count would hand a
        # later step's subgraph the task and keys of an earlier step's, whose calls it would
        # "replay" instead of making.
        place = None
        if binding.checkpointed:
            namespace = (config.get("configurable") or {}).get("checkpoint_ns")
            if not namespace:
                raise UserError(f"subgraph {self.agent.name} runs with no checkpoint step")
            place = hashlib.sha256(str(namespace).encode()).hexdigest()[:16]
        handle = await binding.ctx.delegate_at(place, self.agent, _to_json(state))
        result = await handle.result()
        if isinstance(result, Interrupted):  # its answer would have to pass the parent's run
            raise UserError(f"subgraph {self.agent.name} stopped at interrupt(): a subgraph "
                            "run as a nested delegation cannot wait for input")
        return _from_json(result)


def subgraph(graph: Any, *, name: str, effects: Mapping[str, Effect] | None = None,
             probes: Mapping[str, ProbeFn] | None = None,
             deadlines: Mapping[str, float] | None = None) -> Subgraph:
    """``parent.add_node("billing", subgraph(billing_graph, name="billing", ...))``: the
    subgraph runs as a nested delegation of the parent graph's child."""
    agent = as_tether_agent(graph, effects=effects, probes=probes, deadlines=deadlines,
                            name=name)
    return Subgraph(graph, Agent(agent.name, _nested_run(agent), agent.tools))


def _nested_run(agent: Agent) -> Callable[..., Awaitable[Any]]:
    async def run(ctx: Context, state: Any) -> Any:
        return _to_json(await agent.fn(ctx, _from_json(state), whole_state=True))

    return run


def _subgraphs(graph: Any) -> list[Agent]:
    found = []
    for node in graph.nodes.values():
        bound = getattr(node, "bound", None)
        target = getattr(bound, "afunc", None) or getattr(bound, "func", None)
        if isinstance(target, Subgraph):
            found.append(target.agent)
    return found


def _tool_nodes(graph: Any) -> list[tuple[str, ToolNode]]:
    graphs = [graph, *(sub for _, sub in graph.get_subgraphs(recurse=True))]
    return [(name, node.bound) for g in graphs for name, node in g.nodes.items()
            if isinstance(getattr(node, "bound", None), ToolNode)]


def _refuse_breakpoints(graph: Any) -> None:
    """A static breakpoint stops the run with no interrupt to report: the stream just ends,
    so the run would look finished, its next steps (a refund, say) never run."""
    for g in (graph, *(sub for _, sub in graph.get_subgraphs(recurse=True))):
        for kind in ("interrupt_before", "interrupt_after"):
            nodes = getattr(g, f"{kind}_nodes", None) or ()
            if nodes:
                at = repr(nodes) if isinstance(nodes, str) else ", ".join(map(repr, nodes))
                raise UserError(f"graph has a static breakpoint ({kind}) at {at}: use "
                                "interrupt() in a node to wait for input")


def _partial(state: Any, before: int) -> Partial:
    messages = state.get("messages", []) if isinstance(state, dict) else []
    new = messages[before:]
    results = tuple(m.content for m in new if isinstance(m, ToolMessage))
    text = "".join(str(m.content) for m in new[-1:] if not isinstance(m, ToolMessage)
                   and not getattr(m, "tool_calls", None) and getattr(m, "type", "") == "ai")
    return Partial(text, results)


def _output(state: Any) -> Any:
    messages = state.get("messages") if isinstance(state, dict) else None
    if messages:
        return messages[-1].content
    return state


def as_tether_agent(graph: Any, *, effects: Mapping[str, Effect] | None = None,
                    probes: Mapping[str, ProbeFn] | None = None,
                    deadlines: Mapping[str, float] | None = None, name: str | None = None,
                    config: RunnableConfig | None = None,
                    on_event: EventFn | None = None) -> Agent:
    """A tether agent that runs the compiled ``graph`` on its input (a string, taken as the
    user's message, or the graph's input state). ``effects``, ``probes`` and ``deadlines`` are
    keyed by tool name; ``config`` is the graph's run config; ``on_event`` (sync or async)
    receives each streamed state."""
    effects, probes, deadlines = dict(effects or {}), dict(probes or {}), dict(deadlines or {})
    _refuse_breakpoints(graph)
    found: dict[str, BaseTool] = {}
    for node_name, node in _tool_nodes(graph):
        if node not in _OURS:
            raise UserError(f"ToolNode {node_name!r} does not route through tether: build it "
                            "with tether.langgraph.tool_node(tools)")
        for tool_name, base in node.tools_by_name.items():
            if found.setdefault(tool_name, base) is not base:
                raise UserError(f"two different tools are named {tool_name!r}")
    unknown = sorted((set(effects) | set(probes) | set(deadlines)) - set(found))
    if unknown:
        raise UserError(f"graph has no tool named {', '.join(unknown)}")
    for tool_name, effect in effects.items():
        if not isinstance(effect, Effect) or effect is Effect.DELEGATE:
            raise UserError(f"effect of {tool_name!r} must be a tether.Effect other than DELEGATE")
    tools = {n: Tool(n, effects.get(n, Effect.EXTERNAL), _gateway_fn(n), probe=probes.get(n),
                     dispatch_deadline=deadlines.get(n, DEFAULT_DISPATCH_DEADLINE))
             for n in found}
    checkpointed = getattr(graph, "checkpointer", None) not in (None, False)

    async def run(ctx: Context, input: Any, whole_state: bool = False,
                  resume: Mapping[str, Any] | None = None) -> Any:
        state = {"messages": [{"role": "user", "content": input}]} \
            if isinstance(input, str) else input
        before = len(state.get("messages", ())) if isinstance(state, dict) else 0
        cfg: dict[str, Any] = dict(config or {})
        callbacks = cfg.get("callbacks")
        cfg["callbacks"] = [*(callbacks or []), _Guard()]
        if checkpointed:  # one checkpoint thread per tether task: a re-delegation resumes it
            cfg["configurable"] = {"thread_id": ctx.task_id, **cfg.get("configurable", {})}
            snapshot = await graph.aget_state(cast(RunnableConfig, cfg))
            if snapshot.created_at is None and (ctx.epoch or ctx.attempt > 1 or resume):
                # Every run saves a checkpoint before its first step: an empty thread was
                # lost. Starting over, the model would ask for done calls again under new
                # tool call ids, so new keys, and they would run twice.
                thread = cfg["configurable"]["thread_id"]
                raise UserError(f"checkpoint thread {thread!r} is empty, yet the task ran "
                                "before: its checkpointer lost the thread (another process's "
                                "in-memory saver?), and starting over would repeat its calls")
            waiting = {i.id: i.value for i in snapshot.interrupts}
            # Answers go by interrupt id, so an answer journaled with an earlier attempt's
            # arguments never answers a later question.
            answers = {k: v for k, v in (resume or {}).items() if k in waiting}
            if answers:  # stopped at interrupt(): run on from there with the answers
                state = Command(resume=answers)
            elif waiting:  # nothing answers what it asks: it still waits, nothing runs
                return Interrupted(waiting)
            elif snapshot.next:  # stopped mid-run: resume where it was (input None)
                state = None
        token = _BINDING.set(_Binding(ctx, tools, checkpointed))
        last: Any = state
        # A call's key names the checkpoint its step ran from: that checkpoint is saved
        # before the step runs ("sync"), or a resume could redo the step from an earlier one
        # under new keys and pay again for a call that applied.
        durability = "sync" if checkpointed else None
        try:
            async for chunk in graph.astream(state, cast(RunnableConfig, cfg),
                                             stream_mode="values", durability=durability):
                last = chunk
                if on_event is not None:
                    forwarded = on_event(chunk)
                    if inspect.isawaitable(forwarded):
                        await forwarded
                ctx.check()
        except Exception as exc:
            reason = cut_reason(exc)
            if reason is None:
                raise
            raise StreamCut(reason, _partial(last, before), repr(exc)) from None
        finally:
            _BINDING.reset(token)
        asked = last.get("__interrupt__") if isinstance(last, dict) else None
        if checkpointed:
            # The thread's checkpoint, not the stream's last chunk, says what it waits for:
            # nodes that ran at once may each have asked, and a run answering some of them
            # still waits for the others (the last chunk names one, or none).
            after = await graph.aget_state(cast(RunnableConfig, cfg))
            if after.interrupts:
                return Interrupted({i.id: i.value for i in after.interrupts})
        elif asked:
            raise UserError("the graph stopped at interrupt() and has no checkpointer to "
                            "resume from: compile it with one")
        return last if whole_state else _output(last)

    return Agent(name or getattr(graph, "name", None) or "graph", run,
                 (*tools.values(), *_subgraphs(graph)))


__all__ = ["Subgraph", "as_tether_agent", "awrap_tool_call", "cut_reason", "idempotency_key",
           "subgraph", "tool_node"]
