"""The proxy's own stdin and stdout for the SDK's ``stdio_server``, read and written on the event
loop. The SDK's default wraps them as files whose every read, write and flush is a hop to a
worker thread and back (three per message the proxy answers); a pipe needs none of them. Like
the SDK, while serving, fd 0 reads the null device and fd 1 writes to stderr, so nothing else
the process or a child prints reaches the wire; both are restored after. Where stdin or stdout
is not a pipe, socket or terminal (a file, ``/dev/null``), ``None``: the SDK's own streams
serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

LINE_LIMIT = 1 << 30  # bytes in one JSON-RPC message (the SDK's own reader has no bound)


class _Lines:
    """What ``stdio_server`` reads: the lines of stdin, as text."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.ended = asyncio.Event()  # the client closed stdin

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            self.ended.set()
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class _Writer:
    """What ``stdio_server`` writes: text to stdout, flushed when the pipe takes it."""

    def __init__(self, transport: asyncio.WriteTransport, protocol: Any) -> None:
        self._writer = asyncio.StreamWriter(transport, protocol, None,
                                            asyncio.get_running_loop())

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


def _pollable(fd: int) -> bool:
    """Whether the loop's selector can watch ``fd``: a pipe, a socket or a terminal can be, a
    file or ``/dev/null`` cannot (epoll refuses them, which the loop would only report as a
    traceback in a callback)."""
    with selectors.DefaultSelector() as probe:
        try:
            probe.register(fd, selectors.EVENT_READ)
        except (OSError, ValueError):
            return False
    return True


def _divert(fd: int, to: int) -> int:
    """A private copy of ``fd`` for the wire; ``fd`` itself now points at ``to``."""
    private = os.dup(fd)
    os.dup2(to, fd)
    return private


@asynccontextmanager
async def loop_stdio() -> AsyncIterator[tuple[_Lines, _Writer] | None]:
    loop = asyncio.get_running_loop()
    null = os.open(os.devnull, os.O_RDONLY)
    stdin_fd, stdout_fd = _divert(0, null), _divert(1, 2)
    os.close(null)
    transports: list[asyncio.BaseTransport] = []
    try:
        try:
            if not (_pollable(stdin_fd) and _pollable(stdout_fd)):
                raise ValueError("not a pipe, socket or terminal")
            reader = asyncio.StreamReader(limit=LINE_LIMIT)
            read_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader),
                os.fdopen(stdin_fd, "rb", buffering=0, closefd=False))
            transports.append(read_transport)
            write_transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin,
                os.fdopen(stdout_fd, "wb", buffering=0, closefd=False))
            transports.append(write_transport)
        except ValueError:  # not a pipe, socket or terminal
            for transport in transports:
                transport.close()
            transports.clear()
            os.dup2(stdin_fd, 0)
            os.dup2(stdout_fd, 1)
            yield None
            return
        yield _Lines(reader), _Writer(write_transport, protocol)
    finally:
        for transport in transports:
            with contextlib.suppress(Exception):
                transport.close()
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.close(stdin_fd)
        os.close(stdout_fd)
