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
        line = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in self._PLAIN}
        return line + "".join(f" {k}={v}" for k, v in extra.items())


def configure(level: str = "info", fmt: str = "text", stream: Any = None) -> logging.Handler:
    """What the service commands (worker, mcp-proxy, console) call: tether's loggers to
    ``stream`` (stderr: stdout may be a protocol) at ``level``, as text or JSON lines."""
    if level.lower() not in LEVELS:
        raise UserError(f"--log-level {level!r}: expected one of {', '.join(LEVELS)}")
    if fmt.lower() not in FORMATS:
        raise UserError(f"--log-format {fmt!r}: expected text or json")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt.lower() == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "{asctime}{levelname}{name}{message}", style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(_Fields("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger(ROOT)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
