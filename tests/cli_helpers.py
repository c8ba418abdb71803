"""The ``tether`` command line run inside the test's process.

A process of its own costs a cold start (about half a second of CPU) and tells nothing about a
command that only reads and prints, such as ``verify``; the tests where a second process is
the point (a recall from another shell while an owner runs, signals, exit codes of a killed
process) keep ``tests.test_cli.tether_cli``. The command runs in a thread with a loop of its
own, as in its own process, while the test's loop goes on.
"""

from __future__ import annotations

import asyncio

from typer.testing import CliRunner

from tether._cli.app import app


def _invoke(args: tuple[str, ...]) -> tuple[int, str, str]:
    # catch_exceptions=False: a traceback is a failure of the test, never an exit code.
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


async def tether_here(*args: str) -> tuple[int, str, str]:
    """``tether ARGS`` in this process: its exit code, standard output and error."""
    return await asyncio.to_thread(_invoke, args)
