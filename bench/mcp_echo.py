"""An MCP server with one ``echo`` tool, for the proxy overhead figures (mcp_overhead.py)."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("echo")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def echo(text: str) -> str:
    return text


if __name__ == "__main__":
    server.run()
