"""A client of `tether mcp-proxy` that speaks the stdio wire itself (JSON lines), so that a test
controls the moment stdin closes and a signal comes, and the processes an upstream command
started, found by a mark in their environment."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from tests.mcp_helpers import PYTHONPATH, ROOT

NODE_BIN = ROOT / ".ci" / "node" / "node_modules" / ".bin"
MARK = "TETHER_TEST_MARK"


def node_bin(name: str) -> str:
    path = NODE_BIN / name
    assert path.exists(), f"{name} is installed by scripts/test (npm ci in .ci/node)"
    return str(path)


def marked(mark: str) -> list[int]:
    """The live processes whose environment carries ``MARK=mark`` (zombies are not live)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def mark_upstream(name: str, *command: str) -> tuple[str, str]:
    """An ``--upstream`` whose processes carry a fresh mark: the spec and the mark."""
    mark = uuid.uuid4().hex
    return f"{name}=env {MARK}={mark} {' '.join(command)}", mark


class WireClient:
    """The proxy as a subprocess, spoken to line by line. Server requests are not answered
    (the upstream then has one outstanding, as a client that is leaving would leave it)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.notifications: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self._results: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next = 0
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, journal: str, *upstreams: str, extra: tuple[str, ...] = ()
                    ) -> WireClient:
        args = [a for spec in upstreams for a in ("--upstream", spec)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal, *args, *extra,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": PYTHONPATH},
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            message = json.loads(line)
            if "method" not in message:
                self._results.pop(message["id"]).set_result(message)
            elif "id" in message:
                self.requests.append(message)
            else:
                self.notifications.append(message)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())

    async def request(self, method: str, params: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
        self._next += 1
        answer = self._results[self._next] = asyncio.get_running_loop().create_future()
        self.send({"id": self._next, "method": method, **({"params": params} if params else {})})
        return await asyncio.wait_for(answer, 120)

    async def initialize(self, capabilities: dict[str, Any] | None = None) -> dict[str, Any]:
        answer = await self.request("initialize", {
            "protocolVersion": "2025-11-25", "capabilities": capabilities or {},
            "clientInfo": {"name": "wire", "version": "1"}})
        self.send({"method": "notifications/initialized"})
        return answer["result"]  # type: ignore[no-any-return]

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    async def aclose(self, mark: str | None = None) -> None:
        """The proxy killed if it still runs, and (a failed test's) marked processes too."""
        if self.proc.returncode is None:
            self.proc.kill()
        for pid in marked(mark) if mark else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await self.proc.wait()
        self._reader.cancel()
