"""``tether console``: serve the web console (``tether._console``) until Ctrl-C."""

from __future__ import annotations

import ipaddress
import secrets
import socket
from typing import Annotated, Any

import typer

from tether._cli.common import JournalOpt, KeysOpt
from tether._core.errors import UserError
from tether._journal.journal import DEFAULT_URL

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def console_cmd(
    journal: JournalOpt = DEFAULT_URL, keys: KeysOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by "
                                      "default; anything else exposes the console).")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535,
                                      help="Port (0: any free one).")] = 8765,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="TETHER_CONSOLE_TOKEN",
        help="Access token (default: a fresh random one, printed at start).")] = None,
    by: Annotated[str | None, typer.Option(
        "--by", help="Who the console's recalls, terminates and decisions name, signed "
        "(default: $TETHER_OPERATOR, else the login name).")] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: Annotated[str, typer.Option("--log-format", help="text or json")] = "text",
) -> None:
    """A live triage tool for the journal in the browser: what needs a person first, a page
    per delegation, and every delegation and call filtered and paged, each call with its
    arguments, result, key and evidence; recall and terminate with your reason, and resolve,
    signed with your key as the CLI signs (docs/console.md)."""
    try:
        import uvicorn

        from tether._console.server import Console, build
    except ModuleNotFoundError as exc:
        raise UserError("tether console needs its web stack: pip install 'tether[console]'") \
            from exc
    from tether._journal.journal import Journal
    from tether._runtime.logs import configure
    from tether._runtime.resolve import operator_of

    configure(log_level, log_format)
    operator = operator_of(by)  # a name nobody can read is refused now, not at the first click
    if token is not None and len(token) < 16:
        raise UserError("--token must be at least 16 characters")
    secret = token or secrets.token_urlsafe(24)
    directory = keys if keys is not None else Journal(journal, create=False).keys_dir
    if not (directory / "signing.json").exists():
        raise UserError(f"no signing key in {directory}; run 'tether keys init'")
    sock = _bind(host, port)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/?token={secret}"
    print(f"tether console: {url}", flush=True)
    loopback = host in LOOPBACK or _loopback(host)
    if not loopback:
        from tether._runtime.logs import announce

        announce("console", f"warning: the console listens on {host}, beyond this host, over "
                 "plain HTTP: anyone on the network who sees the token can recall, terminate "
                 "and resolve; prefer loopback and an SSH tunnel", host=host)
    app = build(Console(journal, keys, secret, operator=operator), loopback=loopback,
                host=host)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                           lifespan="on"))
    server.run(sockets=[sock])


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except (TypeError, ValueError) as exc:  # a name the resolver cannot even encode
        sock.close()
        raise UserError(f"cannot listen on {host!r}: {exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def register(app: typer.Typer, errors: Any) -> None:
    app.command("console")(errors(console_cmd))


__all__ = ["console_cmd", "register"]
