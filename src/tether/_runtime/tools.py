"""Tools with declared effects, probes and compensations; agents with tool surfaces."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, overload

from tether._core.errors import UserError
from tether._core.model import Effect, ProbeOutcome, check_positive
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE


@dataclass(frozen=True)
class ProbeResult:
    """A probe's answer about one action, with the evidence it is based on."""

    outcome: ProbeOutcome
    evidence: dict[str, Any] = field(default_factory=dict)
    result: Any = None  # the action's result, when the outside world can tell it
    # NOT_APPLIED only: the probe made sure the key can never apply (cancelled or voided it at
    # the provider), so the answer is final before the tool's dispatch deadline.
    voided: bool = False


ToolFn: TypeAlias = Callable[..., Awaitable[Any]]
ProbeFn: TypeAlias = Callable[..., Awaitable[ProbeResult]]
AgentFn: TypeAlias = Callable[..., Awaitable[Any]]


def _takes_key(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters
    return "idempotency_key" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


@dataclass(frozen=True, eq=False)
class Tool:
    """A callable the gateway mediates. Its probe and compensation take the tool's own keyword
    arguments plus ``idempotency_key``."""

    name: str
    effect: Effect
    fn: ToolFn
    probe: ProbeFn | None = None
    compensate: ToolFn | None = None
    # Seconds after its intent within which a call may still apply at the provider (a request
    # in the network, a provider's queue): the tool's promise that nothing applies later.
    # Until then a probe's "not applied" is "not applied yet".
    dispatch_deadline: float = DEFAULT_DISPATCH_DEADLINE

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise UserError("a tool needs a non-empty name")
        check_positive(self.dispatch_deadline, f"tool {self.name}: dispatch_deadline")
        if not isinstance(self.effect, Effect):
            raise UserError(
                f"tool {self.name}: effect must be a tether.Effect, got {self.effect!r}"
            )
        if self.effect is Effect.DELEGATE:
            raise UserError(f"tool {self.name}: DELEGATE is declared with tether.agent, not tool")
        for role, fn in (("tool", self.fn), ("probe", self.probe), ("compensate", self.compensate)):
            if fn is not None and not inspect.iscoroutinefunction(fn):
                raise UserError(f"tool {self.name}: the {role} must be an async function")
        if self.effect.journaled and not _takes_key(self.fn):
            raise UserError(
                f"tool {self.name} has effect {self.effect.value} and must accept an "
                "'idempotency_key' keyword argument (I7)"
            )
        for role, fn in (("probe", self.probe), ("compensate", self.compensate)):
            if fn is not None and not _takes_key(fn):
                raise UserError(f"tool {self.name}: the {role} must accept 'idempotency_key'")


@overload
def tool(fn: ToolFn, /) -> Tool: ...
@overload
def tool(*, effect: Effect = ..., name: str | None = ..., probe: ProbeFn | None = ...,
         compensate: ToolFn | None = ...,
         dispatch_deadline: float = ...) -> Callable[[ToolFn], Tool]: ...


def tool(fn: ToolFn | None = None, /, *, effect: Effect = Effect.EXTERNAL,
         name: str | None = None, probe: ProbeFn | None = None,
         compensate: ToolFn | None = None,
         dispatch_deadline: float = DEFAULT_DISPATCH_DEADLINE) -> Tool | Callable[[ToolFn], Tool]:
    """Declare a tool. Undeclared effect means EXTERNAL: fail closed. ``dispatch_deadline``:
    seconds after the intent past which the provider can no longer apply a call."""

    def wrap(f: ToolFn) -> Tool:
        return Tool(name or f.__name__, effect, f, probe, compensate, dispatch_deadline)

    return wrap(fn) if fn is not None else wrap


class OutputCodec(Protocol):
    """How an adapter stores a framework's structured output (a pydantic model, say): the
    journal keeps ``dump(value)``, plain JSON, and ``Handle.result`` gives ``load`` of it, in
    this process and in any other that reads the journal."""

    def dump(self, value: Any) -> Any:
        """The value's JSON; UserError if that JSON does not give the value back."""
        ...

    def load(self, stored: Any) -> Any:
        """The value that ``stored`` (what ``dump`` gave) stands for."""
        ...


@dataclass(frozen=True, eq=False)
class Agent:
    """An async callable ``fn(ctx, *args, **kwargs)`` with the tools it may use. Naming an Agent
    in a surface grants DELEGATE to it. ``output``: how its result is stored, when it is not
    plain JSON (set by framework adapters)."""

    name: str
    fn: Callable[..., Awaitable[Any]]
    tools: tuple[Tool | Agent | str, ...] = ()
    output: OutputCodec | None = None

    def __post_init__(self) -> None:
        if not inspect.iscoroutinefunction(self.fn):
            raise UserError(f"agent {self.name}: must be an async function")
        check_surface(self.tools, f"agent {self.name}")

    @property
    def grant(self) -> str:
        return f"agent:{self.name}"


@overload
def agent(fn: AgentFn, /) -> Agent: ...
@overload
def agent(*, name: str | None = ...,
          tools: Iterable[Tool | Agent | str] = ...) -> Callable[[AgentFn], Agent]: ...


def agent(fn: AgentFn | None = None, /, *, name: str | None = None,
          tools: Iterable[Tool | Agent | str] = ()) -> Agent | Callable[[AgentFn], Agent]:
    surface = tuple(tools)

    def wrap(f: AgentFn) -> Agent:
        return Agent(name or f.__name__, f, surface)

    return wrap(fn) if fn is not None else wrap


def surface_name(item: Tool | Agent) -> str:
    return item.grant if isinstance(item, Agent) else item.name


def check_surface(items: Iterable[object], owner: str) -> dict[str, Tool | Agent | str]:
    """Map names to tools. A plain string grants a tool tether does not mediate (a provider's
    hosted tool, say) and ``UNRESTRICTED`` grants any tool: both are allowed, and both
    make a surface unsafe to replay. Anything else that is not a Tool or Agent is refused."""
    found: dict[str, Tool | Agent | str] = {}
    for item in items:
        if isinstance(item, str):
            if not item:
                raise UserError(f"{owner}: a tool name cannot be empty")
            found[item] = item
            continue
        if not isinstance(item, Tool | Agent):
            raise UserError(
                f"{owner}: {item!r} is not a tether tool or agent; wrap it with @tether.tool"
            )
        key = surface_name(item)
        if key in found and found[key] is not item:
            raise UserError(f"{owner}: two different tools are named {key!r}")
        found[key] = item
    return found


def as_agent(target: Agent | AgentFn, tools: Iterable[Tool | Agent | str] | None) -> Agent:
    if isinstance(target, Agent):
        return target if tools is None else dataclasses.replace(target, tools=tuple(tools))
    if not callable(target):
        raise UserError(f"{target!r} is not an agent: pass an async function or a tether.agent")
    name = getattr(target, "__name__", None) or type(target).__name__
    return Agent(name, target, tuple(tools or ()))

