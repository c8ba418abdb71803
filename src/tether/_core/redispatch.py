"""When may a child whose model stream was cut be run again? (I6)

Pure: the supervisor gathers the facts (how the attempt ended, what the journal says it started,
its tool surface, the task's cancel generation, the budget) and this module answers, with a
reason code for every answer. "Zero output is not zero side effects": a cut child with no text
may have run dozens of tools, so the journal, not the output, decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tether._core.errors import TetherError, UserError


class CutReason(StrEnum):
    STREAM_INCOMPLETE = "stream_incomplete"
    CONNECT_ERROR = "connect_error"
    CONNECT_TIMEOUT = "connect_timeout"


@dataclass(frozen=True)
class Partial:
    """Output salvaged from a cut stream: text and the results of tool calls that completed."""

    text: str = ""
    tool_results: tuple[Any, ...] = ()

    @property
    def usable(self) -> bool:
        return bool(self.text.strip()) or bool(self.tool_results)

    def to_json(self) -> dict[str, Any]:
        return {"partial": True, "text": self.text, "tool_results": list(self.tool_results)}


class StreamCut(TetherError):
    """Raised by a child (or its model adapter) when the model's stream was cut in transit."""

    def __init__(self, reason: CutReason, partial: Partial | None = None, detail: str = "") -> None:
        super().__init__(f"model stream cut ({reason.value}){': ' + detail if detail else ''}")
        self.reason = reason
        self.partial = partial or Partial()


class CeilingReached(TetherError):
    """A ceiling the caller asked for (a tool-loop cap, a budget): never re-dispatched."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"ceiling reached: {kind}{': ' + detail if detail else ''}")
        self.kind = kind


class Ending(StrEnum):
    STREAM_CUT = "stream_cut"
    CEILING = "ceiling"
    ERROR = "error"


class Code(StrEnum):
    REDISPATCH = "redispatch"  # cut, no output, no side effect, surface retry-safe
    REDISPATCH_NO_TOOL_RAN = "redispatch_no_tool_ran"  # cut before any tool ran
    PARTIAL_SALVAGED = "partial_salvaged"  # cut with output: return it, never retry
    NOT_A_CUT = "not_a_cut"  # an ordinary error
    CEILING = "ceiling"  # a requested ceiling
    RETRY_DISABLED = "retry_disabled"  # budget 0
    BUDGET_SPENT = "budget_spent"
    SIDE_EFFECT_STARTED = "side_effect_started"  # the journal shows one
    UNRESTRICTED_SURFACE = "unrestricted_surface"
    UNKNOWN_TOOL = "unknown_tool"
    SHELL_TOOL = "shell_tool"
    TOOL_NOT_RETRY_SAFE = "tool_not_retry_safe"
    DELEGATE_REACHES_UNSAFE = "delegate_reaches_unsafe"
    DELEGATE_UNRESOLVED = "delegate_unresolved"
    DELEGATE_CYCLE = "delegate_cycle"
    CANCELLED_BEFORE_DELAY = "cancelled_before_delay"
    CANCELLED_DURING_DELAY = "cancelled_during_delay"
    CANCELLED_DURING_FORK = "cancelled_during_fork"
    RECORDS_TAMPERED = "records_tampered"  # the journal's facts fail their chain

    @property
    def redispatch(self) -> bool:
        return self in (Code.REDISPATCH, Code.REDISPATCH_NO_TOOL_RAN)


UNRESTRICTED = "*"
AGENT_PREFIX = "agent:"
DEFAULT_SHELL_TOOLS = frozenset({
    "bash", "sh", "shell", "zsh", "exec", "run_shell", "run_command", "terminal", "powershell",
    "cmd", "subprocess",
})


@dataclass(frozen=True)
class RedispatchPolicy:
    """``retry_safe`` is its own set, by literal tool name, separate from any other policy:
    a tool is replay-safe only because an operator listed it here. Shell tools are never safe,
    listed or not. Budget 0 disables re-dispatch; ``settle_delay`` is waited on the clock."""

    retry_safe: frozenset[str] = frozenset()
    budget: int = 1
    settle_delay: float = 1.0
    shell_tools: frozenset[str] = field(default=DEFAULT_SHELL_TOOLS)

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise UserError(f"re-dispatch budget must be an integer >= 0, got {self.budget!r}")
        delay = self.settle_delay
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not delay >= 0 \
                or delay == float("inf"):
            raise UserError(f"settle_delay must be a finite number >= 0, got {delay!r}")
        object.__setattr__(self, "retry_safe", frozenset(self.retry_safe))
        object.__setattr__(self, "shell_tools", frozenset(self.shell_tools))


@dataclass(frozen=True)
class AttemptFacts:
    """What is known about one failed attempt."""

    ending: Ending
    partial_usable: bool  # a cut that salvaged output
    attempt: int  # 1 for the first attempt
    side_effects_started: int  # IDEMPOTENT or EXTERNAL actions in the attempt's subtree
    tools_ran: int  # any tool call at all, READ_ONLY ones and delegations included
    surface: tuple[str, ...]  # tool names, "agent:<name>" grants, "*" for unrestricted
    agents: Mapping[str, tuple[str, ...]]  # agent name -> its surface, for DELEGATE grants
    known_tools: frozenset[str]  # names that resolve to a declared tool
    generation_at_start: int  # the task's cancel generation when the attempt started
    generation_now: int
    # Records of the attempt's subtree that fail verification against their chain: the
    # journal's "no side effect" cannot be believed (an action row deleted by hand).
    tampered: tuple[str, ...] = ()


@dataclass(frozen=True)
class RedispatchDecision:
    code: Code
    detail: str = ""

    @property
    def redispatch(self) -> bool:
        return self.code.redispatch


def surface_verdict(surface: tuple[str, ...], agents: Mapping[str, tuple[str, ...]],
                    known: frozenset[str], policy: RedispatchPolicy) -> RedispatchDecision:
    """Fail closed: the surface is replay-safe only if every tool reachable from it, through
    DELEGATE grants resolved transitively, is literally in the retry-safe set."""

    def walk(items: tuple[str, ...], path: tuple[str, ...]) -> RedispatchDecision | None:
        for name in items:
            via = f" (via {' -> '.join(path)})" if path else ""
            if name == UNRESTRICTED:
                return RedispatchDecision(Code.UNRESTRICTED_SURFACE, f"unrestricted{via}")
            if name.startswith(AGENT_PREFIX):
                agent = name[len(AGENT_PREFIX):]
                if agent in path:
                    return RedispatchDecision(Code.DELEGATE_CYCLE, " -> ".join((*path, agent)))
                if agent not in agents:
                    return RedispatchDecision(Code.DELEGATE_UNRESOLVED, f"agent {agent}{via}")
                inner = walk(agents[agent], (*path, agent))
                if inner is not None:
                    code = inner.code
                    if code in (Code.TOOL_NOT_RETRY_SAFE, Code.SHELL_TOOL, Code.UNKNOWN_TOOL):
                        code = Code.DELEGATE_REACHES_UNSAFE
                    return RedispatchDecision(code, inner.detail)
                continue
            if name in policy.shell_tools:
                return RedispatchDecision(Code.SHELL_TOOL, f"{name}{via}")
            if name not in known:
                return RedispatchDecision(Code.UNKNOWN_TOOL, f"{name}{via}")
            if name not in policy.retry_safe:
                return RedispatchDecision(Code.TOOL_NOT_RETRY_SAFE, f"{name}{via}")
        return None

    return walk(surface, ()) or RedispatchDecision(Code.REDISPATCH, "surface is retry-safe")


def unmediated(surface: tuple[str, ...], agents: Mapping[str, tuple[str, ...]],
               known: frozenset[str]) -> str | None:
    """A tool granted by name only (a hosted tool, say), reachable from the surface: it runs
    where the journal cannot see it, so "no tool ran" cannot be proven."""
    seen: set[str] = set()
    todo = list(surface)
    while todo:
        name = todo.pop()
        if name.startswith(AGENT_PREFIX):
            agent = name[len(AGENT_PREFIX):]
            if agent not in seen:
                seen.add(agent)
                todo.extend(agents.get(agent, ()))
        elif name != UNRESTRICTED and name not in known:
            return name
    return None


def decide_redispatch(facts: AttemptFacts, policy: RedispatchPolicy) -> RedispatchDecision:
    """The first check, made when the attempt ends (before the settle delay)."""
    if facts.ending is Ending.CEILING:
        return RedispatchDecision(Code.CEILING)
    if facts.ending is not Ending.STREAM_CUT:
        return RedispatchDecision(Code.NOT_A_CUT)
    if facts.partial_usable:
        return RedispatchDecision(Code.PARTIAL_SALVAGED, "retrying would destroy the output")
    if policy.budget == 0:
        return RedispatchDecision(Code.RETRY_DISABLED)
    if facts.attempt > policy.budget:
        return RedispatchDecision(Code.BUDGET_SPENT, f"{facts.attempt - 1} of {policy.budget}")
    moved = cancelled(facts.generation_at_start, facts.generation_now,
                      Code.CANCELLED_BEFORE_DELAY)
    if moved is not None:
        return moved
    if facts.tampered:
        return RedispatchDecision(Code.RECORDS_TAMPERED, (
            f"the journal's records fail verification ({', '.join(facts.tampered)}): its "
            "count of side effects cannot be believed"))
    if facts.side_effects_started:
        return RedispatchDecision(Code.SIDE_EFFECT_STARTED,
                                  f"{facts.side_effects_started} side-effecting action(s)")
    if facts.tools_ran == 0 and not unmediated(facts.surface, facts.agents, facts.known_tools):
        return RedispatchDecision(Code.REDISPATCH_NO_TOOL_RAN)
    return surface_verdict(facts.surface, facts.agents, facts.known_tools, policy)


def cancelled(at_start: int, now: int, code: Code) -> RedispatchDecision | None:
    """The re-check made before the delay, after it, and after the new child is forked."""
    if now != at_start:
        return RedispatchDecision(code, f"cancel generation moved {at_start} -> {now}")
    return None
