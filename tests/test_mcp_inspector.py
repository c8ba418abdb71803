"""The MCP Inspector's CLI (npm) lists and calls tools, resources and prompts through
`tether mcp-proxy`, as a user would check a server; the tool call is journaled."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import tether
from tests.mcp_helpers import PYTHONPATH, ROOT
from tests.test_mcp_proxy_registry import node_server


async def inspect(tmp_path: Path, journal: str, *method: str) -> Any:
    proxy = [sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
             "--upstream", f"library={sys.executable} -m tests.mcp_library"]
    proc = await asyncio.create_subprocess_exec(
        node_server("mcp-inspector"), "--cli", "-e", f"PYTHONPATH={PYTHONPATH}", *proxy, *method,
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                       "MCP_CATALOG_PATH": str(tmp_path / "catalog.json")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def test_the_inspector_cli_through_the_proxy(tmp_path: Path) -> None:
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    tools = await inspect(tmp_path, journal, "--method", "tools/list")
    called = await inspect(tmp_path, journal, "--method", "tools/call", "--tool-name", "shout",
                           "--tool-arg", "words=hi")
    resources = await inspect(tmp_path, journal, "--method", "resources/list")
    prompt = await inspect(tmp_path, journal, "--method", "prompts/get", "--prompt-name",
                           "review", "--prompt-args", "slug=dune")
    assert {"ask", "shout", "whereami"} <= {t["name"] for t in tools["tools"]}
    assert called["content"] == [{"type": "text", "text": "HI"}] and not called["isError"]
    assert [r["uri"] for r in resources["resources"]] == ["library://catalog"]
    assert prompt["messages"][0]["content"]["text"] == "Write a kind review of dune."
    async with tether.Journal(journal, create=False) as j:
        sessions = await j.delegations()
        actions = await j.actions([d.id for d in sessions])
    assert len(sessions) == 4  # each inspector run was one client session
    assert [(a.tool, a.state.value) for a in actions] == [("library.shout", "COMPLETED")]
