"""Where a hung chaos process waits: on SIGUSR1, every thread's stack and every asyncio
task's, written to stderr (the trial's log), so that the harness can keep them in the trial's
record before it kills the process.

``python -m tether._chaos.stacks ARGS...`` runs ``tether ARGS...`` with the handler in place
(the worker the harness starts after a disk fault)."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from types import FrameType


def _dump(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    faulthandler.dump_traceback(all_threads=True)
    loop = asyncio._get_running_loop()  # the handler runs on the loop's thread, between steps
    tasks = asyncio.all_tasks(loop) if loop is not None else set()
    sys.stderr.write(f"\nasyncio tasks ({len(tasks)}):\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def install() -> None:
    signal.signal(signal.SIGUSR1, _dump)


if __name__ == "__main__":
    install()
    sys.argv = ["tether", *sys.argv[1:]]
    from tether._cli.app import main

    main()
