"""Run an OpenAI Agents SDK ``Agent`` as a tether child.

Its function tools pass tether's gateway with the effect the operator declares (EXTERNAL when
not declared: fail closed), so a recall stops new tool calls and lets in-flight ones finish
within the grace window, a terminate cancels them and reconciles them with their probes, and
a model stream cut in transit raises ``StreamCut`` so the re-dispatch rules decide. Tools the
gateway cannot mediate (hosted tools, say) are granted by name only, which makes the surface
unsafe to replay: a cut attempt is then never re-dispatched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

import httpx2
import openai
from agents import Agent as SdkAgent
from agents import FunctionTool, MaxTurnsExceeded, Runner
from agents.tool import (
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext

from tether._core.errors import UserError
from tether._core.model import Effect
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE
from tether._core.redispatch import CeilingReached, CutReason, Partial, StreamCut
from tether._runtime.gateway import Context
from tether._runtime.tools import Agent, ProbeFn, Tool

_KEY: ContextVar[str | None] = ContextVar("tether_idempotency_key", default=None)
_TOOL_CONTEXT: ContextVar[ToolContext[Any] | None] = ContextVar("tether_tool_context",
                                                                 default=None)


def idempotency_key() -> str | None:
    """Inside a function tool run through tether: the key to send to the outside world."""
    return _KEY.get()


def cut_reason(exc: BaseException) -> CutReason | None:
    """Whether a model call failed in transit (and how), or for another reason (None)."""
    if isinstance(exc, httpx2.ConnectTimeout | openai.APITimeoutError):
        return CutReason.CONNECT_TIMEOUT
    if isinstance(exc, httpx2.ConnectError | openai.APIConnectionError | ConnectionRefusedError):
        return CutReason.CONNECT_ERROR
    if isinstance(exc, httpx2.TransportError | ConnectionError):
        return CutReason.STREAM_INCOMPLETE  # the stream started, then broke
    return None


def _gateway_tool(sdk: FunctionTool, effect: Effect, probe: ProbeFn | None,
                  deadline: float) -> Tool:
    # A copy whose exceptions are not turned into a message for the model, so that they reach
    # the gateway: a tool that raised may have applied (IN_DOUBT, probed), unless it raised
    # tether.ToolRejected (FAILED). The model still gets the SDK's message (see _through).
    raising = dataclasses.replace(sdk)  # the SDK rebinds the copy's invoker to the copy
    set_function_tool_failure_error_function(raising, None)

    async def run(idempotency_key: str | None = None, **arguments: Any) -> Any:
        context = _TOOL_CONTEXT.get()
        if context is None:
            raise UserError(f"{sdk.name} runs only inside its Agents SDK run")
        token = _KEY.set(idempotency_key)
        try:
            return await raising.on_invoke_tool(context, json.dumps(arguments))
        finally:
            _KEY.reset(token)

    run.__name__ = sdk.name
    return Tool(sdk.name, effect, run, probe=probe, dispatch_deadline=deadline)


def _through(ctx: Context, tool: Tool, sdk: FunctionTool) -> FunctionTool:
    async def on_invoke(context: ToolContext[Any], raw: str) -> Any:
        try:
            arguments = json.loads(raw) if raw else {}
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # let the SDK's own invoker report it
            return await sdk.on_invoke_tool(context, raw)
        token = _TOOL_CONTEXT.set(context)  # copied into the action's task
        try:
            return await ctx.call(tool, **arguments)
        except Exception as exc:  # recorded by the gateway; the model hears of it as usual
            message = await maybe_invoke_function_tool_failure_error_function(
                function_tool=sdk, context=context, error=exc)
            if message is None:
                raise
            return message
        finally:
            _TOOL_CONTEXT.reset(token)

    return dataclasses.replace(sdk, on_invoke_tool=on_invoke)


def as_tether_agent(sdk_agent: SdkAgent[Any], *, effects: Mapping[str, Effect] | None = None,
                    probes: Mapping[str, ProbeFn] | None = None, max_turns: int = 10,
                    name: str | None = None,
                    deadlines: Mapping[str, float] | None = None) -> Agent:
    """A tether agent that runs ``sdk_agent`` on its input, streaming, through the gateway.
    ``effects`` and ``probes`` are keyed by function tool name; a name the agent does not have
    is refused (a typo would leave a payment tool at the default). ``deadlines``: per tool,
    seconds after a call's intent past which it can no longer apply (tether's default)."""
    effects, probes = dict(effects or {}), dict(probes or {})
    deadlines = dict(deadlines or {})
    functions = {t.name: t for t in sdk_agent.tools if isinstance(t, FunctionTool)}
    unknown = sorted((set(effects) | set(probes) | set(deadlines)) - set(functions))
    if unknown:
        raise UserError(f"agent {sdk_agent.name} has no function tool named "
                        f"{', '.join(unknown)}")
    for tool_name, effect in effects.items():
        if not isinstance(effect, Effect) or effect is Effect.DELEGATE:
            raise UserError(f"effect of {tool_name!r} must be a tether.Effect other than DELEGATE")
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise UserError("max_turns must be a positive integer")
    gateway = {n: _gateway_tool(t, effects.get(n, Effect.EXTERNAL), probes.get(n),
                                deadlines.get(n, DEFAULT_DISPATCH_DEADLINE))
               for n, t in functions.items()}
    # Anything else is granted by name: tether cannot mediate it, and says so in the surface.
    others = [getattr(t, "name", type(t).__name__) for t in sdk_agent.tools
              if not isinstance(t, FunctionTool)]

    async def run(ctx: Context, input: str) -> Any:
        tools = [_through(ctx, gateway[t.name], t) if isinstance(t, FunctionTool) else t
                 for t in sdk_agent.tools]
        result = Runner.run_streamed(sdk_agent.clone(tools=tools), input, max_turns=max_turns)
        text: list[str] = []
        outputs: list[Any] = []
        try:
            async for event in result.stream_events():
                if event.type == "raw_response_event" and \
                        event.data.type == "response.output_text.delta":
                    text.append(event.data.delta)
                elif event.type == "run_item_stream_event" and event.name == "tool_output":
                    outputs.append(getattr(event.item, "output", None))
        except MaxTurnsExceeded as exc:
            raise CeilingReached("max_turns", str(exc)) from None
        except Exception as exc:
            reason = cut_reason(exc)
            if reason is None:
                raise
            raise StreamCut(reason, Partial("".join(text), tuple(outputs)), repr(exc)) from None
        finally:
            if not result.is_complete:
                result.cancel()
        return result.final_output

    return Agent(name or sdk_agent.name, run, (*gateway.values(), *others))
