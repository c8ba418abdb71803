"""The ``tether mcp-proxy`` configuration file: the ``mcpServers`` JSON that MCP hosts already
use (command, args, env, cwd, url), with tether's keys beside the standard ones (trusted,
effects, probes as ``module:attr``, deadlines, a tool-name prefix, tasks) and the session's name.
``mcp_proxy.schema.json`` beside this module is its JSON Schema; every mistake is one line.

The older form, ``{"git": {"trusted": true, "effects": {...}}}`` (policies only, the servers
given with ``--upstream``), is still read.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tether._core.errors import UserError
from tether._core.model import Effect
from tether._integrations.mcp_policy import ServerPolicy, load_policies
from tether._runtime.tools import ProbeFn

SCHEMA = Path(__file__).with_name("mcp_proxy.schema.json")
DEFAULT_SESSION = "mcp-proxy"


@dataclass(frozen=True)
class UpstreamSpec:
    """How to reach one upstream server: a command (stdio) or a URL (Streamable HTTP)."""

    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    # None: the proxy's own environment (an --upstream on the command line, like a shell
    # command); from a config file, the SDK's safe default environment plus these.
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    prefix: str = ""
    tasks: bool = False  # use its tasks extension (``mcp_tasks``), on the 2026-07-28 wire


@dataclass(frozen=True)
class ProxyConfig:
    upstreams: dict[str, UpstreamSpec] = field(default_factory=dict)
    policies: dict[str, ServerPolicy] = field(default_factory=dict)
    session: str = DEFAULT_SESSION


@cache
def _validator() -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads(SCHEMA.read_text()))


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read the MCP config {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UserError(f"MCP config {path} is not JSON: {exc}") from None


def _check(path: Path, data: Any) -> None:
    from jsonschema.exceptions import best_match

    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if isinstance(servers, dict):  # the mistake a schema reports least clearly
        for name, entry in servers.items():
            if isinstance(entry, dict) and ("command" in entry) == ("url" in entry):
                raise UserError(f"MCP config {path}: server {name!r} needs either 'command' "
                                "(a local server) or 'url' (Streamable HTTP), not both")
    error = best_match(_validator().iter_errors(data))
    if error is not None:
        where = error.json_path if error.json_path != "$" else "the top level"
        raise UserError(f"MCP config {path}: at {where}: {error.message}")


def import_probe(spec: str, base: Path, where: str) -> ProbeFn:
    """``module:attr``, imported with the config file's folder first on the import path for
    the import only: left there, it would shadow every module the proxy imports later."""
    module, _, attr = spec.partition(":")
    added = str(base) not in sys.path
    if added:
        sys.path.insert(0, str(base))
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{where}: cannot import probe {spec!r}: {exc}") from None
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(str(base))
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"{where}: probe {spec!r} must be an async function")
    probe: ProbeFn = fn
    return probe


def load_config(path: Path) -> ProxyConfig:
    data = _read(path)
    if isinstance(data, dict) and "mcpServers" not in data and "session" not in data:
        return ProxyConfig(policies=load_policies(path))  # the older, policies-only form
    _check(path, data)
    base = path.resolve().parent
    upstreams: dict[str, UpstreamSpec] = {}
    policies: dict[str, ServerPolicy] = {}
    for name, entry in data["mcpServers"].items():
        where = f"MCP config {path}: server {name!r}"
        command = (entry["command"], *entry.get("args", [])) if "command" in entry else ()
        cwd = entry.get("cwd")
        upstreams[name] = UpstreamSpec(
            name, command, entry.get("url"), dict(entry.get("env", {})),
            str((base / cwd).resolve()) if cwd else None, dict(entry.get("headers", {})),
            entry.get("prefix", ""), entry.get("tasks", False))
        policies[name] = ServerPolicy(
            name, entry.get("trusted", False),
            {tool: Effect(value.upper()) for tool, value in entry.get("effects", {}).items()},
            {tool: import_probe(spec, base, where)
             for tool, spec in entry.get("probes", {}).items()},
            dict(entry.get("deadlines", {})))
    return ProxyConfig(upstreams, policies, data.get("session", DEFAULT_SESSION))


def combine(command_line: Mapping[str, list[str]], config: ProxyConfig,
            session: str | None = None) -> ProxyConfig:
    """The file's servers and the ``--upstream`` ones (which inherit the proxy's environment)."""
    both = sorted(set(command_line) & set(config.upstreams))
    if both:
        raise UserError(f"--upstream {both[0]} is also in the MCP config file: name it once")
    upstreams = {**config.upstreams,
                 **{n: UpstreamSpec(n, tuple(argv)) for n, argv in command_line.items()}}
    unknown = sorted(set(config.policies) - set(upstreams))
    if unknown:
        raise UserError(f"the MCP policy names servers with no --upstream: {', '.join(unknown)}")
    if not upstreams:
        raise UserError("give at least one --upstream NAME=COMMAND, or a config file with "
                        "mcpServers")
    name = session if session is not None else config.session
    if not name or len(name) > 64 or not name.isprintable():
        raise UserError(f"session name {name!r} must be 1-64 printable characters")
    return ProxyConfig(upstreams, config.policies, name)
