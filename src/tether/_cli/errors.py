"""How the CLI answers a mistake, and how its help reads.

Every user mistake, ours (a ``TetherError``) or click's (a missing or unknown option, a bad
value), is one ``error:`` line on stderr and exit 2: a script reads one line, a person sees
what to fix, and nobody meets a boxed panel or a traceback.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from typer import _click as click  # typer's own copy of click: its exceptions are these
from typer.core import TyperGroup

from tether._cli.safe import safe
from tether._core.errors import TetherError

err = Console(stderr=True)
T = TypeVar("T")


def fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"[red]error:[/red] {safe(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def cli_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """A user mistake prints one line and exits 2; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except TetherError as exc:
            fail(str(exc))

    return wrapper


def usage_line(exc: click.ClickException) -> str:
    """click's message, then where help is (its own three lines said the same)."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return message
    return f"{ctx.command_path}: {message} (see '{ctx.command_path} --help')"


# Sentences in docstrings are written across lines; typer keeps those breaks in its help.
_PARAGRAPHS = re.compile(r"\n\s*\n")
_LITERAL = re.compile(r"``(.+?)``|`(.+?)`")


def reflow(text: str | None) -> str | None:
    """Help text as sentences: each paragraph on one logical line (the help formatter wraps
    it to the terminal), inline literals in plain quotes."""
    if text is None:
        return None
    text = _LITERAL.sub(lambda m: f"'{m.group(1) or m.group(2)}'", text)
    paragraphs = (" ".join(p.split()) for p in _PARAGRAPHS.split(text.strip()))
    return "\n\n".join(p for p in paragraphs if p)


def _prepare(command: click.Command) -> None:
    """Help reflowed; a parse error that click raises without its context (an option missing
    its value) given the command's, so its line can name the command."""
    parse = command.parse_args

    def parse_args(ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return parse(ctx, args)
        except click.exceptions.UsageError as exc:
            if exc.ctx is None:
                exc.ctx = ctx
            raise

    command.parse_args = parse_args  # type: ignore[method-assign]
    command.help = reflow(command.help)
    command.short_help = reflow(command.short_help)
    for param in command.params:
        if hasattr(param, "help"):  # options, and typer's arguments
            param.help = reflow(param.help)
    if isinstance(command, TyperGroup):
        for sub in command.commands.values():
            _prepare(sub)


class Group(TyperGroup):
    """The ``tether`` group: help reflowed, click's usage errors as one ``error:`` line."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for sub in self.commands.values():
            _prepare(sub)
        self.help = reflow(self.help)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False,
                                windows_expand_args=windows_expand_args, **extra)
        except click.exceptions.NoArgsIsHelpError:
            code = 2  # a bare ``tether``: typer printed its help

        except click.ClickException as exc:
            err.print(f"[red]error:[/red] {safe(usage_line(exc))}", highlight=False,
                      soft_wrap=True)
            code = 2
        except typer.Abort:
            err.print("aborted", highlight=False)
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)
