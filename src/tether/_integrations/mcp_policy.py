"""The operator's word on MCP servers, and the ``--upstream`` option, read without the MCP
SDK: ``tether mcp-proxy`` checks its options and starts its upstream processes before that
import (about 0.7 s), so that they boot meanwhile."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tether._core.errors import UserError
from tether._core.model import Effect
from tether._runtime.tools import ProbeFn

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ServerPolicy:
    """The operator's word on one MCP server: its name in tether (tools are named
    ``server.tool``), whether its annotations are believed, and per-tool effects and probes
    that override anything the server says, and dispatch deadlines (seconds after a call's
    intent past which the server can no longer apply it; tether's default otherwise)."""

    name: str
    trusted: bool = False
    effects: Mapping[str, Effect] = field(default_factory=dict)
    probes: Mapping[str, ProbeFn] = field(default_factory=dict)
    deadlines: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise UserError(f"MCP server name {self.name!r} must be 1-64 letters, digits, "
                            "'_', '-' or '.'")
        if not isinstance(self.trusted, bool):
            raise UserError(f"MCP server {self.name}: trusted must be true or false")
        for tool, effect in self.effects.items():
            if not isinstance(effect, Effect):
                raise UserError(f"MCP server {self.name}: effect of {tool!r} must be one of "
                                f"{', '.join(e.value for e in Effect if e is not Effect.DELEGATE)}")
            if effect is Effect.DELEGATE:
                raise UserError(f"MCP server {self.name}: {tool!r} cannot be DELEGATE")


def parse_upstream(spec: str) -> tuple[str, list[str]]:
    """``name=command arg ...`` (shell quoting) into the name and the command line."""
    name, sep, command = spec.partition("=")
    try:
        argv = shlex.split(command) if sep else []
    except ValueError as exc:  # an unbalanced quote, say
        raise UserError(f"--upstream {spec!r}: {exc}") from None
    if not sep or not name or not argv:
        raise UserError(f"--upstream {spec!r} must be NAME=COMMAND, e.g. "
                        "git='mcp-server-git --repository .'")
    ServerPolicy(name)  # validates the name
    return name, argv


def load_policies(path: Path) -> dict[str, ServerPolicy]:
    """``{"git": {"trusted": true, "effects": {"git_commit": "EXTERNAL"}}, ...}`` from a JSON
    file (probes are code: pass them to ``ServerPolicy`` in Python)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read the MCP policy {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(f"MCP policy {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"MCP policy {path} must map server names to settings")
    policies = {}
    for name, settings in data.items():
        if not isinstance(settings, dict) or set(settings) - {"trusted", "effects"}:
            raise UserError(f"MCP policy {path}: {name!r} takes only 'trusted' and 'effects'")
        raw = settings.get("effects", {})
        if not isinstance(raw, dict):
            raise UserError(f"MCP policy {path}: effects of {name!r} must be an object")
        try:
            effects = {tool: Effect(str(value).upper()) for tool, value in raw.items()}
        except ValueError as exc:
            raise UserError(f"MCP policy {path}: {exc}") from None
        policies[name] = ServerPolicy(name, settings.get("trusted", False), effects)
    return policies


def default_journal() -> str:
    """Per user, never relative to wherever the MCP host starts the proxy: the XDG state
    directory (``$XDG_STATE_HOME``, else ``~/.local/state``), ``tether/journal.db``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".local", "state")
    return f"sqlite:///{os.path.abspath(os.path.join(state, 'tether', 'journal.db'))}"
