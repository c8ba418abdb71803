"""Sessionless (2026-07-28) clients share one client session of `tether mcp-proxy --http`:
what an upstream sends during one client's call (a log, a sampling request) must never reach
another client whose request happens to be in flight at the same time."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as t

from tests.mcp_helpers import text
from tests.remote_agents import listen_gate, make_gates, open_gate
from tests.test_mcp_proxy_http import serving


@asynccontextmanager
async def chatty_proxy(journal: str) -> AsyncIterator[str]:
    async with serving(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--http", "127.0.0.1:0", "--upstream",
                       f"chatty={sys.executable} -m tests.mcp_chatty",
                       ready="serving MCP at") as lines:
        said = next(line for line in lines if "serving MCP at" in line)
        yield said.split("serving MCP at ")[1].split()[0]


class Seen:
    """What one client was sent: log lines and sampling prompts."""

    def __init__(self) -> None:
        self.logs: list[Any] = []
        self.prompts: list[str] = []

    async def logging(self, params: t.LoggingMessageNotificationParams) -> None:
        self.logs.append(params.data)

    async def sampling(self, context: Any, params: t.CreateMessageRequestParams) -> Any:
        for message in params.messages:
            content = message.content
            if isinstance(content, t.TextContent):
                self.prompts.append(content.text)
        return t.CreateMessageResult(role="assistant", model="m",
                                     content=t.TextContent(type="text", text="hi"))


async def test_an_upstreams_messages_during_one_clients_call_never_reach_another(
        bank_env: Path, tmp_path: Path) -> None:
    from mcp import Client

    make_gates(bank_env.parent / "gates", "started-A", "release-A", "started-B", "release-B",
               "started-solo", "release-solo")
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    a, b = Seen(), Seen()
    async with chatty_proxy(journal) as url, \
            Client(url, logging_callback=a.logging, sampling_callback=a.sampling) as one, \
            Client(url, logging_callback=b.logging, sampling_callback=b.sampling) as two:
        # Alone on the upstream, a call's messages reach its client.
        started = await listen_gate("started-solo")
        solo = asyncio.ensure_future(one.call_tool("tagged", {"tag": "solo"}))
        await started
        open_gate("release-solo")
        await asyncio.wait_for(solo, 30)
        assert a.logs == ["log for solo"] and b.logs == []
        # Two clients' calls wait on it: whose a message is cannot be told, so nobody gets it.
        started_a, started_b = await listen_gate("started-A"), await listen_gate("started-B")
        call_a = asyncio.ensure_future(one.call_tool("tagged", {"tag": "A"}))
        await started_a
        call_b = asyncio.ensure_future(two.call_tool("tagged", {"tag": "B"}))
        await started_b  # B's request is now the latest in flight
        open_gate("release-A")  # A's call logs and asks for sampling now
        answer_a = await asyncio.wait_for(call_a, 30)
        open_gate("release-B")
        answer_b = await asyncio.wait_for(call_b, 30)
    # B's call, alone again after A's ended, has its own.
    assert b.logs == ["log for B"], b.logs
    assert "for A" not in " ".join(map(str, b.logs)) + " ".join(b.prompts), (b.logs, b.prompts)
    assert "for B" not in " ".join(map(str, a.logs)) + " ".join(a.prompts), (a.logs, a.prompts)
    assert text(answer_a).startswith("A:") and text(answer_b).startswith("B:")


async def test_a_cancelled_call_the_upstream_goes_on_with_never_reaches_another_client(
        bank_env: Path, tmp_path: Path) -> None:
    """Cancellation is advisory: an upstream may go on with a call its client cancelled, and
    log and ask for sampling for it later. Another client's request, alone in waiting on that
    upstream by then, must not be sent what belongs to the cancelled call."""
    from mcp import Client

    make_gates(bank_env.parent / "gates", "started-A", "release-A", "cancelled-A", "done-A",
               "started-B", "release-B")
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    a, b = Seen(), Seen()
    async with chatty_proxy(journal) as url, \
            Client(url, logging_callback=a.logging, sampling_callback=a.sampling) as one, \
            Client(url, logging_callback=b.logging, sampling_callback=b.sampling) as two:
        started_a, cancelled_a = await listen_gate("started-A"), await listen_gate("cancelled-A")
        call_a = asyncio.ensure_future(one.call_tool("stubborn", {"tag": "A"}))
        await started_a
        call_a.cancel()
        assert await asyncio.wait_for(cancelled_a, 30) == "A"  # told; its work goes on
        started_b = await listen_gate("started-B")
        call_b = asyncio.ensure_future(two.call_tool("tagged", {"tag": "B"}))
        await started_b  # B's request alone waits on the upstream
        done_a = await listen_gate("done-A")
        open_gate("release-A")  # the cancelled call logs and asks for sampling now
        assert await asyncio.wait_for(done_a, 30) == "A"
        open_gate("release-B")
        answer_b = await asyncio.wait_for(call_b, 30)
    assert b.logs == ["log for B"], b.logs
    assert "for A" not in " ".join(map(str, b.logs)) + " ".join(b.prompts), (b.logs, b.prompts)
    assert text(answer_b).startswith("B:")
