"""Published MCP servers through `tether mcp-proxy`, as a new user would try them:
mcp-server-git from PyPI (its tools exactly as served directly, a commit journaled) and the
reference filesystem server from npm (which asks its client for roots: the proxy relays the
request to the real client, so the server works in the directories the client grants)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import mcp_types as t
import pytest

import tether
from tests.mcp_helpers import ROOT, connect, text
from tests.test_mcp import git, git_server
from tests.test_mcp_proxy import session_delegation

A = tether.ActionState
NODE_BIN = ROOT / ".ci" / "node" / "node_modules" / ".bin"


@pytest.fixture
def git_repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    for args in (("init", "-q"), ("config", "user.email", "agent@example.com"),
                 ("config", "user.name", "agent")):
        git(path, *args)
    (path / "notes.txt").write_text("hello\n")
    return path


def node_server(name: str) -> str:
    path = NODE_BIN / name
    assert path.exists(), f"{name} is installed by scripts/test (npm ci in .ci/node)"
    return str(path)


async def test_mcp_server_git_through_the_proxy(git_repo: Path, journal_url: str) -> None:
    repo = git_repo
    git_bin = str(Path(sys.executable).parent / "mcp-server-git")
    async with git_server(repo) as direct:
        tools = (await direct.list_tools()).tools
        status = await direct.call_tool("git_status", {"repo_path": str(repo)})
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal_url,
                       "--upstream", f"git={git_bin} --repository {repo}") as session:
        served = (await session.list_tools()).tools
        status_proxied = await session.call_tool("git_status", {"repo_path": str(repo)})
        await session.call_tool("git_add", {"repo_path": str(repo), "files": ["notes.txt"]})
        commit = await session.call_tool("git_commit", {"repo_path": str(repo),
                                                        "message": "through the proxy"})
        report = await session_delegation(journal_url)
    assert served == tools  # names, schemas, annotations: identical
    assert status_proxied.content == status.content
    assert not commit.is_error and git(repo, "log", "--format=%s") == "through the proxy\n"
    assert [(a.tool, a.state) for a in report.actions] == [
        ("git.git_status", A.COMPLETED), ("git.git_add", A.COMPLETED),
        ("git.git_commit", A.COMPLETED)]  # untrusted: every tool journaled as EXTERNAL


async def test_the_filesystem_server_gets_its_roots_from_the_real_client(
        tmp_path: Path) -> None:
    shelf = tmp_path / "shelf"
    shelf.mkdir()

    async def roots(context: Any) -> t.ListRootsResult:
        return t.ListRootsResult(roots=[t.Root.model_validate({"uri": shelf.as_uri()})])

    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    server = node_server("mcp-server-filesystem")
    async with connect(sys.executable, "-m", "tether", "mcp-proxy", "--journal", journal,
                       "--upstream", f"fs={server}", list_roots_callback=roots) as session:
        # The server takes the roots the proxy relayed in its own time: ask until it has.
        give_up = time.monotonic() + 30
        while True:
            allowed = await session.call_tool("list_allowed_directories", {})
            if str(shelf) in text(allowed) or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.05)
        wrote = await session.call_tool("write_file", {"path": str(shelf / "note.txt"),
                                                       "content": "kept"})
        outside = await session.call_tool("write_file", {"path": str(tmp_path / "x.txt"),
                                                         "content": "no"})
    assert str(shelf) in text(allowed)
    assert not wrote.is_error and (shelf / "note.txt").read_text() == "kept"
    assert outside.is_error and not (tmp_path / "x.txt").exists()
