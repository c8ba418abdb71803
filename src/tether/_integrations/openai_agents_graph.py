"""The static plan of an OpenAI Agents SDK agent graph, made before anything runs.

One tether delegation runs an SDK agent and every agent it can hand off to (a handoff keeps the
same run); each ``Agent.as_tool`` sub-agent is a delegation of its own, nested. Every function
tool becomes a tether tool with its declared effect. Anything tether cannot mediate (a hosted
tool, an MCP server, a handoff whose target it cannot see) is refused here, naming it and the
path to it, unless the operator grants a hosted tool by name: it then runs unseen, which makes
"no tool ran" unprovable, so the delegation is never re-dispatched (see _core/redispatch.py).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from agents import Agent as SdkAgent
from agents import FunctionTool, function_tool
from agents.tool_context import ToolContext

from tether._core.errors import UserError
from tether._core.model import Effect
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE
from tether._runtime.tools import Agent, ProbeFn, Tool, ToolFn


def handoff_target(item: object) -> SdkAgent[Any] | None:
    """The agent a handoff leads to. The SDK keeps no public link from a ``Handoff`` (or an
    ``as_tool`` tool, below) to its agent; these private attributes are read for discovery
    only, within the SDK range pinned in pyproject.toml, and a miss is refused, never run."""
    if isinstance(item, SdkAgent):
        return item
    ref = getattr(item, "_agent_ref", None)
    target = ref() if callable(ref) else None
    return target if isinstance(target, SdkAgent) else None


def sub_agent(tool: FunctionTool) -> SdkAgent[Any] | None:
    """The agent behind an ``Agent.as_tool`` tool, or None for an ordinary function tool."""
    if not getattr(tool, "_is_agent_tool", False):
        return None
    inner = getattr(tool, "_agent_instance", None)
    if not isinstance(inner, SdkAgent):
        raise UserError(f"tool {tool.name} runs an agent tether cannot see")
    return inner


@dataclass(frozen=True)
class AgentToolOptions:
    """What ``Agent.as_tool`` was given besides the tool's name, description and the
    FunctionTool's own fields (``is_enabled``, ``failure_error_function``, which the SDK reads
    from the tool). The SDK keeps them in its invoker's closure; they are read there, within
    the SDK range pinned in pyproject.toml, and a miss is refused, never run."""

    extractor: Callable[[Any], Awaitable[Any]] | None  # custom_output_extractor
    run_config: Any
    max_turns: int | None
    hooks: Any
    params: Any  # the TypeAdapter of its parameters (AgentAsToolInput by default)
    schema_info: Any  # what the input builder is given about them (None: not built)
    input_builder: Any


# Options a sub-agent run as a nested delegation cannot honour, and what to do instead.
_REFUSED = {
    "on_stream": "pass on_event= to as_tether_agent, which receives the sub-agents' stream "
                 "events too",
    "session": "a sub-agent runs from its input alone (every attempt the same); give it what "
               "it needs in its input",
    "previous_response_id": "a sub-agent runs from its input alone (every attempt the same); "
                            "give it what it needs in its input",
    "conversation_id": "a sub-agent runs from its input alone (every attempt the same); give "
                       "it what it needs in its input",
}


def agent_tool_options(tool: FunctionTool, where: str) -> AgentToolOptions:
    """The options of an ``as_tool`` tool, or a UserError naming one tether cannot honour."""
    impl = getattr(tool.on_invoke_tool, "_invoke_tool_impl", None)
    try:
        given = inspect.getclosurevars(impl).nonlocals if callable(impl) else {}
    except TypeError:
        given = {}
    if not {"custom_output_extractor", "params_adapter", "schema_info"} <= set(given):
        raise UserError(f"tool {tool.name} of agent {where}: tether cannot read the options "
                        "Agent.as_tool was given in this version of the SDK")
    for name, instead in _REFUSED.items():
        if given.get(name) is not None:
            raise UserError(f"tool {tool.name} of agent {where}: Agent.as_tool({name}=...) is "
                            f"not supported under tether: {instead}")
    if tool.needs_approval is not False:
        raise UserError(f"tool {tool.name} of agent {where}: Agent.as_tool(needs_approval=...) "
                        "is not supported under tether (a run paused for approval would end "
                        "the delegation); recall or terminate the child instead")
    return AgentToolOptions(
        given["custom_output_extractor"], given.get("run_config"), given.get("max_turns"),
        given.get("hooks"), given["params_adapter"],
        given["schema_info"] if given.get("should_capture_tool_input") else None,
        given.get("input_builder"))


def raising_copy(sdk: FunctionTool) -> FunctionTool:
    """The same function as a tool whose exceptions propagate (to the gateway, which records
    an IN_DOUBT action) instead of becoming a message. A hand-built FunctionTool's invoker is
    used as it is: whatever it raises already propagates."""
    try:
        fn = sdk.__wrapped__  # the function given to @function_tool
    except AttributeError:
        return sdk
    return function_tool(owned(fn), name_override=sdk.name,
                         description_override=sdk.description, failure_error_function=None,
                         strict_mode=sdk.strict_json_schema)


@dataclass(eq=False)
class KeyFrame:
    """One tether call's key, and where its function runs (its task, or for a sync function
    the SDK's worker thread): an agent run started inside the function runs its own tools
    elsewhere, in contexts that inherit the variable but are not tether calls."""

    key: str
    where: object = None


def here() -> object:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop in this thread: a sync tool in the SDK's worker
        return ("thread", threading.get_ident())


def owned(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, recording where it runs in its call's KeyFrame (signature and hints kept)."""

    def claim() -> None:
        frame = KEY.get()
        if frame is not None and frame.where is None:
            frame.where = here()

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            claim()
            return await fn(*args, **kwargs)

        return run_async

    @functools.wraps(fn)
    def run_sync(*args: Any, **kwargs: Any) -> Any:
        claim()
        return fn(*args, **kwargs)

    return run_sync


def current_key() -> str | None:
    """The key of the tether call whose own function is running here, else None."""
    frame = KEY.get()
    if frame is None or (frame.where is not None and frame.where != here()):
        return None
    return frame.key


@dataclass(eq=False)
class Plan:
    """One delegation: its SDK agents (the root, then those reached by handoffs), a tether tool
    per function tool and a nested tether agent per ``as_tool`` sub-agent, keyed by the SDK
    tool's id."""

    root: SdkAgent[Any]
    path: tuple[str, ...]
    members: list[SdkAgent[Any]] = field(default_factory=list)
    tools: dict[int, Tool] = field(default_factory=dict)
    nested: dict[int, Agent] = field(default_factory=dict)
    options: dict[int, AgentToolOptions] = field(default_factory=dict)  # per as_tool tool
    surface: list[Tool | Agent | str] = field(default_factory=list)
    routes: dict[int, tuple[str, ...]] = field(default_factory=dict)  # member -> agent names


MakeAgent = Callable[[Plan, str], Agent]


class Planner:
    def __init__(self, effects: Mapping[str, Effect], probes: Mapping[str, ProbeFn],
                 deadlines: Mapping[str, float], unmediated: frozenset[str],
                 make_agent: MakeAgent) -> None:
        self.effects, self.probes, self.deadlines = effects, probes, deadlines
        self.unmediated = unmediated
        self.make_agent = make_agent
        self.function_names: set[str] = set()
        self.hosted_names: set[str] = set()
        self._tools: dict[int, Tool] = {}
        self._agents: dict[int, Agent] = {}
        self._agent_names: dict[str, int] = {}
        self._planning: set[int] = set()

    def plan(self, root: SdkAgent[Any], path: tuple[str, ...], name: str) -> Agent:
        if id(root) in self._agents:
            return self._agents[id(root)]
        if id(root) in self._planning:
            raise UserError(f"agents call each other as tools in a cycle: {' -> '.join(path)}")
        if self._agent_names.setdefault(name, id(root)) != id(root):
            raise UserError(f"two different agents are named {name!r}; tether names each "
                            "delegation after its agent")
        self._planning.add(id(root))
        plan = Plan(root, path)
        self._members(plan)
        by_name: dict[str, object] = {}
        for member in plan.members:
            where = " -> ".join((*path[:-1], *plan.routes[id(member)]))
            for item in member.tools:
                self._add(plan, item, where, by_name)
        agent = self.make_agent(plan, name)
        self._planning.discard(id(root))
        self._agents[id(root)] = agent
        return agent

    def _members(self, plan: Plan) -> None:
        routes = plan.routes
        routes[id(plan.root)] = (plan.path[-1],)
        todo = [plan.root]
        while todo:
            agent = todo.pop(0)
            plan.members.append(agent)
            route = routes[id(agent)]
            if getattr(agent, "mcp_servers", None):
                names = ", ".join(getattr(s, "name", type(s).__name__) for s in agent.mcp_servers)
                raise UserError(
                    f"agent {' -> '.join(route)} uses MCP server {names}: tether cannot mediate "
                    "its tools here; wrap the session with tether.mcp.mcp_tools or run it "
                    "behind tether mcp-proxy")
            for item in agent.handoffs:
                target = handoff_target(item)
                if target is None:
                    label = getattr(item, "tool_name", repr(item))
                    raise UserError(f"handoff {label} of agent {' -> '.join(route)}: tether "
                                    "cannot see which agent it leads to; hand off to the Agent "
                                    "itself or build it with agents.handoff(agent)")
                if id(target) not in routes:
                    routes[id(target)] = (*route, target.name)
                    todo.append(target)

    def _add(self, plan: Plan, item: object, where: str, by_name: dict[str, object]) -> None:
        if isinstance(item, FunctionTool):
            inner = sub_agent(item)
            if inner is not None:
                if id(item) not in plan.nested:
                    plan.options[id(item)] = agent_tool_options(item, where)
                    nested = self.plan(inner, (*plan.path, inner.name), inner.name)
                    plan.nested[id(item)] = nested
                    plan.surface.append(nested)
                return
            name = item.name
            self.function_names.add(name)
            known = by_name.setdefault(name, item)
            if known is not item:
                raise UserError(f"two different tools are named {name!r} in {where}")
            if id(item) not in plan.tools:
                plan.tools[id(item)] = self._tool(item)
                plan.surface.append(plan.tools[id(item)])
            return
        name = getattr(item, "name", type(item).__name__)
        self.hosted_names.add(name)
        if name not in self.unmediated:
            raise UserError(
                f"tool {name} of agent {where} runs where tether cannot mediate it (a hosted "
                f"tool); list it in unmediated=[...] to grant it by name anyway (the agent is "
                "then never re-dispatched after a cut stream)")
        if name not in plan.surface:
            plan.surface.append(name)

    def _tool(self, sdk: FunctionTool) -> Tool:
        if id(sdk) in self._tools:
            return self._tools[id(sdk)]
        name = sdk.name
        tool = Tool(name, self.effects.get(name, Effect.EXTERNAL), gateway_fn(sdk),
                    probe=self.probes.get(name),
                    dispatch_deadline=self.deadlines.get(name, DEFAULT_DISPATCH_DEADLINE))
        self._tools[id(sdk)] = tool
        return tool


KEY: ContextVar[KeyFrame | None] = ContextVar("tether_idempotency_key", default=None)
TOOL_CONTEXT: ContextVar[ToolContext[Any] | None] = ContextVar("tether_tool_context",
                                                                default=None)


def gateway_fn(sdk: FunctionTool) -> ToolFn:
    """What the gateway calls: the SDK's own invoker (argument parsing and validation, context
    injection), with the idempotency key where ``idempotency_key()`` finds it."""
    raising = raising_copy(sdk)

    async def run(idempotency_key: str | None = None, **arguments: Any) -> Any:
        context = TOOL_CONTEXT.get()
        if context is None:
            raise UserError(f"{sdk.name} runs only inside its Agents SDK run")
        token = KEY.set(KeyFrame(idempotency_key) if idempotency_key is not None else None)
        try:
            return await raising.on_invoke_tool(context, json.dumps(arguments))
        finally:
            KEY.reset(token)

    run.__name__ = sdk.name
    return run
