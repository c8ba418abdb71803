"""An MCP server that outlives its stdin: when its client closes it, the server goes on (as one
busy with work of its own would), and so does a child process it started. Only a signal to
its process group stops them both."""

from __future__ import annotations

import subprocess
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("lingering")


@server.tool()
def hello() -> str:
    return "hello"


if __name__ == "__main__":
    # Inherits the environment (a test's mark) and stderr, as a server's helper would.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server.run()
    time.sleep(600)
