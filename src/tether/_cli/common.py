"""What every command shares: the terminal, JSON output, the event loop, and the options that
mean the same in every command (declared once, so that ``--journal`` reads alike)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

out = Console()
T = TypeVar("T")

JournalOpt = Annotated[str, typer.Option("--journal", "-j", envvar="TETHER_JOURNAL",
                                         help="Journal URL.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
KeysOpt = Annotated[Path | None, typer.Option("--keys", help="Key directory (default: keys/ "
                                              "beside the journal).")]
ByOpt = Annotated[str | None, typer.Option(
    "--by", help="Who asks, signed into the intent (default: $TETHER_OPERATOR, else the login "
    "name).")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error "
                                          "(logs go to stderr).")]
LogFormatOpt = Annotated[str, typer.Option("--log-format", help="text, or json (JSON lines).")]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
