"""What ``tether mcp-proxy`` adds to a tool call: the same ``echo`` server called directly and
through the proxy (journaled as EXTERNAL, and as READ_ONLY from a trusted server), by the
official SDK client over stdio, one call after another; per-call latency percentiles, and the
proxy process's CPU time per call (all its threads; Linux), which a loaded machine disturbs
less than latency."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

ECHO = str(Path(__file__).resolve().with_name("mcp_echo.py"))


def _cpu(pid: int | None) -> float | None:
    """User and system seconds of a process so far (None off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _proxy_pid(journal: str | None) -> int | None:
    if journal is None:
        return None
    import tether

    async with tether.Journal(journal, create=False) as j:
        pids = [o.pid for o in await j.owners()]
    return pids[0] if len(pids) == 1 else None


async def _timed(params: StdioServerParameters, n: int,
                 journal: str | None = None) -> tuple[list[float], float | None]:
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for i in range(20):  # warm up both processes
            await session.call_tool("echo", {"text": f"warm {i}"})
        pid = await _proxy_pid(journal)
        before = _cpu(pid)
        times = []
        for i in range(n):
            start = time.perf_counter()
            result = await session.call_tool("echo", {"text": f"call {i}"})
            times.append(time.perf_counter() - start)
            assert not result.is_error
        after = _cpu(pid)
        cpu = (after - before) / n if after is not None and before is not None else None
        return sorted(times), cpu


def _pct(times: list[float], p: float) -> float:
    return times[min(len(times) - 1, int(len(times) * p))]


async def proxy_overhead(directory: Path, n: int) -> dict[str, Any]:
    """p50 and p95 seconds per call: direct, journaled through the proxy, read-only through it."""
    found: dict[str, Any] = {
        "direct": await _timed(StdioServerParameters(command=sys.executable, args=[ECHO]), n)}
    for kind, trusted in (("journaled", False), ("read_only", True)):
        config = directory / f"mcp-{kind}.json"
        config.write_text(json.dumps({"mcpServers": {"echo": {
            "command": sys.executable, "args": [ECHO], "trusted": trusted}}}))
        journal = f"sqlite:///{directory / f'mcp-{kind}-{time.monotonic_ns()}.db'}"
        found[kind] = await _timed(StdioServerParameters(
            command=sys.executable,
            args=["-m", "tether", "mcp-proxy", "--config", str(config), "--journal", journal]),
            n, journal)
    return {k: {"p50": _pct(v, 0.5), "p95": _pct(v, 0.95), "n": len(v),
                **({"proxy_cpu": cpu} if cpu is not None else {})}
            for k, (v, cpu) in found.items()}


if __name__ == "__main__":
    import asyncio
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(proxy_overhead(Path(tmp), 200)), indent=2))
