"""Logging: one standard-library logger per component, quiet unless the application (or a
service command of the CLI) configures it.

Components: ``tether.supervisor`` (intents, verdicts, recovery, refused calls),
``tether.journal`` (intents refused by the journal), ``tether.worker`` (leases, claims),
``tether.proxy`` (MCP sessions) and ``tether.console``. Fields ride as ``extra`` so that the
JSON format keeps them as keys: ``delegation``, ``action``, ``kind``, ``seq``, ``owner``...
"""

from __future__ import annotations

import logging
import sys
import unicodedata
from typing import Any

from tether._core.errors import UserError

ROOT = "tether"
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")


def logger(component: str) -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{component}")


# A library stays silent unless its application asks (no "No handlers" fallback to stderr).
logging.getLogger(ROOT).addHandler(logging.NullHandler())


class _Fields(logging.Formatter):
    """Text lines with the record's extra fields appended as ``key=value``."""

    _PLAIN = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
        "message", "asctime", "taskName"}

    def format(self, record: logging.LogRecord) -> str:
        # The message and the fields carry journal text (reasons, names, a tool's errors) to
        # a terminal: control characters are shown, not sent (no escape sequence, no forged
        # line). A traceback keeps its lines.
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = _visible(record.getMessage()), None
        line = super().format(copy)
        extra = {k: v for k, v in record.__dict__.items() if k not in self._PLAIN}
        return line + "".join(f" {_visible(k)}={_visible(v)}" for k, v in extra.items())


def _visible(value: object) -> str:
    """``value`` as text with control and format characters as escape codes."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(
        (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        if unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in text)


_OURS = "_tether_configured"
_JSON = "_tether_json"  # a handler of ours that writes JSON lines


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not to the stream it was
    when configured (a test runner or an embedding application may swap and close it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def configure(level: str = "info", fmt: str = "text", stream: Any = None) -> logging.Handler:
    """What the service commands (worker, mcp-proxy, console) call: tether's loggers to
    ``stream`` (stderr: stdout may be a protocol) at ``level``, as text or JSON lines."""
    if level.lower() not in LEVELS:
        raise UserError(f"--log-level {level!r}: expected one of {', '.join(LEVELS)}")
    if fmt.lower() not in FORMATS:
        raise UserError(f"--log-format {fmt!r}: expected text or json")
    handler: logging.StreamHandler[Any] = (
        logging.StreamHandler(stream) if stream is not None else _Stderr())
    if fmt.lower() == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "{asctime}{levelname}{name}{message}", style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(_Fields("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger(ROOT)
    for previous in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(previous)  # configured again: replace, never log each line twice
    setattr(handler, _OURS, True)
    setattr(handler, _JSON, fmt.lower() == "json")
    root.addHandler(handler)
    root.setLevel(level.upper())
    # psycopg's pool warns on each reconnection attempt while a server is away, and with no
    # handler of its own Python printed each raw on stderr, outside the log format: tether
    # says itself when the journal is lost and back, so only its errors are kept, as ours.
    lib = logging.getLogger("psycopg")
    for previous in [h for h in lib.handlers if getattr(h, _OURS, False)]:
        lib.removeHandler(previous)
    lib.addHandler(handler)
    lib.setLevel(max(logging.ERROR, root.level))
    lib.propagate = False
    return handler


def announce(component: str, text: str, **fields: Any) -> None:
    """A line a service command always says on stderr (where to reach it, how to stop it):
    plain text, or with JSON logging a record (``fields`` as its keys), whatever the level,
    so that JSON logging leaves no line a log reader cannot parse."""
    ours = [h for h in logging.getLogger(ROOT).handlers if getattr(h, _OURS, False)]
    if not ours or not getattr(ours[0], _JSON, False):
        print(_visible(text), file=sys.stderr, flush=True)
        return
    record = logger(component).makeRecord(
        f"{ROOT}.{component}", logging.INFO, "", 0, text, (), None, extra=fields)
    ours[0].handle(record)
