"""``tether mcp-proxy``: registered on the CLI app by ``register``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tether._core.errors import UserError
from tether._runtime.logs import configure as configure_logs

if TYPE_CHECKING:
    from tether._integrations.mcp_config import ProxyConfig


def mcp_proxy(
    upstream: Annotated[list[str] | None, typer.Option(
        "--upstream", help="NAME=COMMAND of an upstream stdio MCP server (repeatable); it "
        "inherits the proxy's environment.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "--policy", help="JSON: the mcpServers file MCP hosts use, with tether's "
        "keys beside the standard ones (trusted, effects, probes, deadlines, prefix, session).")
    ] = None,
    session: Annotated[str | None, typer.Option(
        "--session", help="The agent name of this session's delegation (default: the "
        "config's, else mcp-proxy).")] = None,
    http: Annotated[str | None, typer.Option(
        "--http", help="HOST:PORT: serve MCP over Streamable HTTP at /mcp (loopback only), "
        "one delegation per MCP session, instead of stdio.")] = None,
    idle_timeout: Annotated[float, typer.Option(
        "--idle-timeout", help="Seconds an --http session may go with no request in flight "
        "before it is closed, its delegation ended and its upstreams stopped.")] = 300.0,
    journal: Annotated[str | None, typer.Option(
        "--journal", "-j", envvar="TETHER_JOURNAL", help="Journal URL (default: per user, "
        "$XDG_STATE_HOME/tether/journal.db or ~/.local/state/tether/journal.db).")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error "
                                           "(logs go to stderr).")] = "info",
    log_format: Annotated[str, typer.Option("--log-format", help="text, or json (JSON lines).")]
    = "text",
) -> None:
    """Serve the upstream servers over stdio (or --http), each tool call journaled and fenced;
    stop a session with `tether recall` / `tether terminate` (its delegation id is on
    stderr)."""
    import importlib.util

    # Checked before anything starts: the SDK itself is imported once the upstreams boot.
    if importlib.util.find_spec("mcp") is None:
        raise UserError("tether mcp-proxy needs the MCP SDK: pip install 'tether[mcp]'")
    from tether._integrations.mcp_config import ProxyConfig, combine, load_config
    from tether._integrations.mcp_policy import default_journal, parse_upstream
    configure_logs(log_level, log_format)
    specs = upstream or []
    servers = dict(parse_upstream(spec) for spec in specs)
    if len(servers) != len(specs):
        raise UserError("two --upstream options share a name")
    listen = None
    if http is not None:
        from tether._integrations.mcp_http import parse_listen, serve_http

        listen = parse_listen(http)
    if not 0 < idle_timeout < float("inf"):
        raise UserError(f"--idle-timeout {idle_timeout}: must be a positive number of seconds")
    settings = combine(servers, load_config(config) if config else ProxyConfig(), session)
    import asyncio

    url = journal or default_journal()
    try:
        if listen is None:
            from tether._integrations.mcp_children import run_stdio

            asyncio.run(run_stdio(url, settings))
        else:
            asyncio.run(serve_http(url, settings, *listen, idle_timeout=idle_timeout))
    finally:
        quick_exit(settings)


def quick_exit(settings: ProxyConfig) -> None:
    """Let the interpreter's exit skip tearing down the MCP SDK's objects (about 0.3 s that a
    client waits for: the Inspector, like most, waits for the server to exit), by freezing the
    collector. Frozen objects are never finalized, so only where no user code was imported:
    a probe's module, a ``sitecustomize``, anything from outside the installed packages (a
    checkout on ``PYTHONPATH``) may hold an open file whose last writes only its finalizer
    flushes. The proxy closes its journal and its upstreams itself, and atexit handlers
    (logging, an OpenTelemetry SDK) run as ever."""
    if any(policy.probes for policy in settings.policies.values()) or not _only_installed():
        return
    import gc

    gc.freeze()


def _only_installed() -> bool:
    """Whether every module loaded is tether's, the standard library's or an installed
    package's (and none is a site or user customization)."""
    import os
    import sys
    import sysconfig

    paths = sysconfig.get_paths()
    import tether

    places = (*(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib", "scripts")),
              os.path.dirname(tether.__file__))
    # As written first (a string test), then resolved (a venv's links): one realpath a module
    # rather than a thousand.
    roots = tuple({os.path.join(q, "") for p in places for q in (p, os.path.realpath(p))})
    for name, module in list(sys.modules.items()):
        if name in ("sitecustomize", "usercustomize"):
            return False
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and not file.startswith(roots) and \
                not os.path.realpath(file).startswith(roots):
            return False
    return True
