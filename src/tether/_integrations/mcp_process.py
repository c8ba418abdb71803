"""The proxy's stdio upstreams as child processes, each the leader of a process group of its
own, stopped with the proxy however the proxy ends: its client's EOF, or a signal.

A client that is done closes the proxy's stdin, waits a moment, then sends SIGTERM (the
TypeScript SDK's stdio client after 2 s; its version probe at once, then SIGKILL 1 s later).
A proxy killed by that signal would leave its upstreams running, holding the stderr it gave
them, which is the client's: a client waiting for that pipe to close then hangs. So, on EOF,
each upstream's stdin is closed (the MCP shutdown sequence), and a group still there after
``GRACE`` gets SIGTERM, then SIGKILL after ``FORCE``; on SIGTERM, SIGHUP or SIGINT every group
gets SIGTERM at once (a second signal: SIGKILL), what the proxy was serving is cancelled, and
the proxy exits with ``128 + signal`` once its session's delegation is settled. Whatever is
left of a group after its leader exits (a server's own children) is stopped too. SIGKILL of
the proxy itself cannot be caught: its upstreams then see their stdin close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp_types
from mcp.client._transport import TransportStreams
from mcp.shared.message import SessionMessage

from tether._integrations.mcp_stdio import LINE_LIMIT

GRACE = 2.0  # seconds an upstream has to exit after its stdin closes (the SDKs' own)
FORCE = 2.0  # seconds after SIGTERM before SIGKILL
HURRIED = 0.5  # the same, once a signal stops the proxy: its client may SIGKILL it soon
FLUSH = 0.5  # seconds for messages already accepted to reach an upstream before its EOF
POLL = 0.01
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Children:
    """The proxy's upstream process groups; ``stop_now`` signals every one of them."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.hurried = asyncio.Event()
        self._kills = 0

    def stop_now(self) -> None:
        """SIGTERM every group at once; called again, SIGKILL."""
        self._kills += 1
        self.hurried.set()
        for group in list(self.groups):
            _signal_group(group, signal.SIGTERM if self._kills == 1 else signal.SIGKILL)


def _signal_group(group: int, sig: signal.Signals) -> bool:
    """Whether any process of the group was there to be signalled."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours: the group is still there
        return True
    return True


async def _until(done: Any, within: float, hurry: asyncio.Event | None = None) -> bool:
    """Polls ``done()`` for up to ``within`` seconds (cut short by ``hurry``)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within
    while not done():
        if loop.time() >= give_up or (hurry is not None and hurry.is_set()):
            return False
        await asyncio.sleep(POLL)
    return True


async def _stop(proc: asyncio.subprocess.Process, children: Children) -> None:
    """Stdin closed, the grace to exit, then SIGTERM to the group, and SIGKILL for whatever
    of it outlived its leader or the time to stop. Every wait is bounded, and is for the
    leader: the returncode is polled (``wait()`` also waits for the pipes, which a surviving
    child of the server may hold), and members of the group that exited may stay as zombies
    of an init that does not reap them, so the group's own presence proves nothing."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    exited = await _until(lambda: proc.returncode is not None, GRACE, children.hurried)
    group = proc.pid
    if _signal_group(group, signal.SIGTERM) and not exited:
        force = HURRIED if children.hurried.is_set() else FORCE
        await _until(lambda: proc.returncode is not None, force)
    if _signal_group(group, signal.SIGKILL) and proc.returncode is None:
        await _until(lambda: proc.returncode is not None, FORCE)


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(
            line, by_name=False))
    except ValueError as exc:  # the session sees it, as from the SDK's own transport
        return exc


@asynccontextmanager
async def stdio_upstream(command: str, args: list[str], env: Mapping[str, str],
                         cwd: str | None, children: Children) -> AsyncIterator[TransportStreams]:
    """The SDK's stdio transport, with the server's process group known to ``children``."""
    proc = await asyncio.create_subprocess_exec(
        command, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env=dict(env), cwd=cwd, start_new_session=True, limit=LINE_LIMIT)
    children.groups.add(proc.pid)
    if children.hurried.is_set():  # the proxy is already stopping
        _signal_group(proc.pid, signal.SIGTERM)
    incoming, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, outgoing = anyio.create_memory_object_stream[SessionMessage](0)

    async def read() -> None:
        assert proc.stdout is not None
        async with incoming:
            with contextlib.suppress(OSError, ValueError):  # ValueError: a line over the limit
                while line := await proc.stdout.readline():
                    if line.strip():
                        try:
                            await incoming.send(_parse(line))
                        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                            return

    async def write() -> None:
        assert proc.stdin is not None
        try:
            async with outgoing:
                async for message in outgoing:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    proc.stdin.write(data.encode() + b"\n")
                    await proc.stdin.drain()
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await incoming.aclose()  # the session sees the connection end

    reader, writer = asyncio.ensure_future(read()), asyncio.ensure_future(write())
    try:
        yield read_stream, write_stream
    finally:
        write_stream.close()
        await asyncio.wait({writer}, timeout=FLUSH)
        await _stop(proc, children)
        children.groups.discard(proc.pid)
        for task in (reader, writer):
            task.cancel()
        await asyncio.gather(reader, writer, return_exceptions=True)
        read_stream.close()


class Stopper:
    """SIGTERM, SIGHUP and SIGINT for the proxy: its upstream groups signalled at once, and
    the task serving its client cancelled while it serves (a session that already ended is
    left to settle, hurried). ``exit_code`` is then ``128 + signal``."""

    def __init__(self, children: Children) -> None:
        self.children = children
        self.signal: int | None = None
        self._serving: asyncio.Task[Any] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Stopper]:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)
        try:
            yield self
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """A signal while inside cancels the current task."""
        self._serving = asyncio.current_task()
        if self.signal is not None:
            self._serving.cancel()  # type: ignore[union-attr]
        try:
            yield
        finally:
            self._serving = None

    def _received(self, signum: int) -> None:
        self.children.stop_now()
        if self.signal is None:
            self.signal = signum
            if self._serving is not None and not self._serving.done():
                self._serving.cancel(f"tether mcp-proxy: signal {signum}")

    @property
    def exit_code(self) -> int | None:
        return None if self.signal is None else 128 + self.signal
