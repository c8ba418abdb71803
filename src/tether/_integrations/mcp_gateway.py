"""The MCP gateway: every ``tools/call`` of an MCP client session passes tether's gateway.

An MCP server describes its tools with annotations (readOnlyHint, idempotentHint, ...). They
are hints from the server about itself, so tether takes a tool's effect from the operator's
policy first, from the annotations only for a server the operator trusts, and otherwise treats
the tool as EXTERNAL: journaled, fenced and probed like a payment (fail closed).

Each call carries its idempotency key in the request's ``_meta`` (``io.tether/idempotency-key``)
for servers that can deduplicate. When a child is terminated, its in-flight call is cancelled
and the MCP client sends ``notifications/cancelled`` for it (the SDK's default for an abandoned
request since mcp 2.3); the action is then in doubt and probed like any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.shared.exceptions import MCPError

from tether._core.errors import ToolRejected, UserError
from tether._core.model import Effect
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE
from tether._integrations.mcp_policy import ServerPolicy
from tether._runtime.tools import Tool, ToolFn

KEY_META = "io.tether/idempotency-key"
# JSON-RPC errors by which a server refuses a request before running anything: the call did
# not apply, with certainty (FAILED, never a false alarm in doubt).
REJECTED_BEFORE_RUNNING = frozenset({mcp_types.INVALID_PARAMS, mcp_types.METHOD_NOT_FOUND})


class McpToolError(Exception):
    """The MCP tool answered with ``isError``: it ran and reported a failure. Whether it
    changed anything first is unknown, so the action is in doubt (probed), never FAILED."""


def effect_of(tool: mcp_types.Tool, policy: ServerPolicy) -> Effect:
    """The operator's word, else a trusted server's annotations, else EXTERNAL."""
    if tool.name in policy.effects:
        return policy.effects[tool.name]
    hints = tool.annotations if policy.trusted else None
    if hints is not None and hints.read_only_hint:
        return Effect.READ_ONLY
    if hints is not None and hints.idempotent_hint:
        return Effect.IDEMPOTENT
    return Effect.EXTERNAL


async def list_all(session: ClientSession) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


@lru_cache(maxsize=256)
def _validator(schema: str) -> Any:
    """A validator for one tool's ``inputSchema`` (its JSON text), or None when the schema
    itself is not valid JSON Schema: the server then judges its arguments alone."""
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError

    loaded = json.loads(schema)
    try:
        cls = validators.validator_for(loaded)
        cls.check_schema(loaded)
    except (SchemaError, TypeError, ValueError):
        return None
    return cls(loaded)


def argument_error(spec: mcp_types.Tool, arguments: Mapping[str, Any]) -> str | None:
    """What ``spec``'s own ``inputSchema`` finds wrong with ``arguments``, or None. Checked
    before a call is journaled: a call its server would refuse unrun is refused here, not
    journaled, sent and left in doubt by the server's answer."""
    from jsonschema.exceptions import best_match

    try:
        validator = _validator(json.dumps(spec.input_schema, sort_keys=True))
    except (TypeError, ValueError):  # a schema that is not JSON: nothing to check with
        return None
    if validator is None:
        return None
    try:
        error = best_match(validator.iter_errors(dict(arguments)))
    except Exception:  # a $ref it cannot resolve (never fetched), say: the server judges
        return None
    if error is None:
        return None
    where = error.json_path if error.json_path != "$" else "the arguments"
    return f"{spec.name}: at {where}: {error.message}"


def result_of(name: str, res: mcp_types.CallToolResult) -> Any:
    """A call's result as JSON: the structured content when there is one, else its text."""
    texts = [c.text for c in res.content if isinstance(c, mcp_types.TextContent)]
    if res.is_error:
        raise McpToolError(f"{name}: {' '.join(texts) or 'the tool reported an error'}")
    if res.structured_content is not None:
        return res.structured_content
    if len(texts) == len(res.content):
        return "\n".join(texts)
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in res.content]


def _caller(session: ClientSession, spec: mcp_types.Tool) -> ToolFn:
    name = spec.name

    async def call(idempotency_key: str | None = None, **arguments: Any) -> Any:
        meta: dict[str, Any] = {KEY_META: idempotency_key} if idempotency_key else {}
        try:
            res = await session.call_tool(name, arguments,
                                          meta=meta or None)  # type: ignore[arg-type]
        except MCPError as exc:
            if exc.code in REJECTED_BEFORE_RUNNING:
                raise ToolRejected(f"{name}: {exc.error.message}") from exc
            raise
        return result_of(name, res)  # raises for an error result

    call.__name__ = name
    return call


async def mcp_tools(session: ClientSession, policy: ServerPolicy | str) -> list[Tool]:
    """The session's tools as tether tools, each effect decided as the module says. A policy
    that names a tool the server does not offer is refused: it is probably a typo, and a typo
    in a policy would silently leave a payment tool at the server's word."""
    return [tool for tool, _ in await wrap_tools(session, policy)]


async def wrap_tools(session: ClientSession, policy: ServerPolicy | str, *,
                     make: Callable[[ClientSession, mcp_types.Tool], ToolFn] = _caller,
                     ) -> list[tuple[Tool, mcp_types.Tool]]:
    """Each tether tool with the server's own description of it; ``make`` builds the function
    that calls the tool (the proxy's forwards its client's request whole)."""
    if isinstance(policy, str):
        policy = ServerPolicy(policy)
    offered = await list_all(session)
    names = {t.name for t in offered}
    unknown = sorted((set(policy.effects) | set(policy.probes) | set(policy.deadlines)) - names)
    if unknown:
        raise UserError(f"MCP server {policy.name}: the policy names tools it does not offer: "
                        f"{', '.join(unknown)} (it offers {', '.join(sorted(names))})")
    tools = []
    for spec in offered:
        tools.append((Tool(f"{policy.name}.{spec.name}", effect_of(spec, policy),
                           make(session, spec),
                           probe=policy.probes.get(spec.name),
                           dispatch_deadline=policy.deadlines.get(
                               spec.name, DEFAULT_DISPATCH_DEADLINE)), spec))
    return tools
