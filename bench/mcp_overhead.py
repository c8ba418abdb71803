"""What ``tether mcp-proxy`` adds to a tool call: the same ``echo`` server called directly and
through the proxy (journaled as EXTERNAL, and as READ_ONLY from a trusted server), by the
official SDK client over stdio, one call after another; per-call latency percentiles."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

ECHO = str(Path(__file__).resolve().with_name("mcp_echo.py"))


async def _timed(params: StdioServerParameters, n: int) -> list[float]:
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for i in range(20):  # warm up both processes
            await session.call_tool("echo", {"text": f"warm {i}"})
        times = []
        for i in range(n):
            start = time.perf_counter()
            result = await session.call_tool("echo", {"text": f"call {i}"})
            times.append(time.perf_counter() - start)
            assert not result.is_error
        return sorted(times)


def _pct(times: list[float], p: float) -> float:
    return times[min(len(times) - 1, int(len(times) * p))]


async def proxy_overhead(directory: Path, n: int) -> dict[str, Any]:
    """p50 and p95 seconds per call: direct, journaled through the proxy, read-only through it."""
    direct = await _timed(StdioServerParameters(command=sys.executable, args=[ECHO]), n)
    found: dict[str, Any] = {"direct": direct}
    for kind, trusted in (("journaled", False), ("read_only", True)):
        config = directory / f"mcp-{kind}.json"
        config.write_text(json.dumps({"mcpServers": {"echo": {
            "command": sys.executable, "args": [ECHO], "trusted": trusted}}}))
        journal = f"sqlite:///{directory / f'mcp-{kind}-{time.monotonic_ns()}.db'}"
        found[kind] = await _timed(StdioServerParameters(
            command=sys.executable,
            args=["-m", "tether", "mcp-proxy", "--config", str(config), "--journal", journal]), n)
    return {k: {"p50": _pct(v, 0.5), "p95": _pct(v, 0.95), "n": len(v)} for k, v in found.items()}


if __name__ == "__main__":
    import asyncio
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(proxy_overhead(Path(tmp), 200)), indent=2))
