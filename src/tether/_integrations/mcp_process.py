"""The transport of the proxy's stdio upstreams: the SDK's streams over the pipes of the
processes ``mcp_children`` starts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import mcp_types
from mcp.client._transport import TransportStreams
from mcp.shared.message import SessionMessage

from tether._integrations.mcp_children import Children, stop_surely

FLUSH = 0.5  # seconds for messages already accepted to reach an upstream before its EOF


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(
            line, by_name=False))
    except ValueError as exc:  # the session sees it, as from the SDK's own transport
        return exc


@asynccontextmanager
async def stdio_upstream(proc: asyncio.subprocess.Process,
                         children: Children) -> AsyncIterator[TransportStreams]:
    """The SDK's stdio transport over an upstream process ``spawn`` started (its group known
    to ``children``), stopped as the module says when the transport closes."""
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
        await stop_surely(proc, children)
        children.groups.discard(proc.pid)
        for task in (reader, writer):
            task.cancel()
        await asyncio.gather(reader, writer, return_exceptions=True)
        read_stream.close()
