"""MCP integration (``pip install 'tether[mcp]'``): tether tools from an MCP client session.

``tools = await tether.mcp.mcp_tools(session, ServerPolicy("git", trusted=True))``, then grant
them to a child like any tether tool. ``tether mcp-proxy`` serves the same over stdio to any
MCP client.
"""

from __future__ import annotations

try:
    from tether._integrations.mcp_gateway import (
        KEY_META,
        McpToolError,
        effect_of,
        mcp_tools,
    )
    from tether._integrations.mcp_policy import ServerPolicy, load_policies
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without the extra
    if exc.name is None or not exc.name.startswith("mcp"):
        raise
    raise ModuleNotFoundError(
        "tether.mcp needs the MCP SDK: pip install 'tether[mcp]'", name=exc.name) from None

__all__ = ["KEY_META", "McpToolError", "ServerPolicy", "effect_of", "load_policies",
           "mcp_tools"]
