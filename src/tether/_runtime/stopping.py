"""SIGTERM for a process running ``async with Supervisor(..., handle_signals=True)``: what the
supervisor runs is terminated and accounted for before the process exits, instead of being
left RUNNING by a process that died in the middle.

A library does not take a process's signals unless asked. By default SIGTERM keeps Python's
behaviour (the process ends at once) and the next supervisor to open the journal settles the
dead process's delegations when it starts (``Supervisor.recover``). With
``handle_signals=True``, SIGTERM cancels the task that entered the block; the supervisor's exit
terminates its children as on any exit, then raises ``SystemExit(128 + SIGTERM)``: the exit
status a shell reports for a process ended by SIGTERM, without a traceback. A second SIGTERM
meanwhile meets the handler that was there before (by default: the process ends). To stop on
another signal, cancel that task from your own handler: the exit settles the children alike.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

from tether._core.errors import UserError

SIGNALS = (signal.SIGTERM,)  # SIGINT already cancels the main task under asyncio.run


class Stopping:
    def __init__(self, handle_signals: bool) -> None:
        self._handle = handle_signals
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}
        self.signal: int | None = None

    def enter(self) -> None:
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self.signal = None
        if not self._handle:
            return
        if threading.current_thread() is not threading.main_thread():
            raise UserError("handle_signals=True needs the main thread, where signals are "
                            "delivered; cancel the supervisor's task from your own handler")
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            try:
                self._loop.add_signal_handler(sig, self._received, sig)
            except NotImplementedError:  # an event loop without signal support
                raise UserError("this event loop cannot handle signals: cancel the "
                                "supervisor's task from your own handler") from None

    def _received(self, signum: int) -> None:
        # The previous handler is back at once: a second SIGTERM during the settling does what
        # it did before (Python's default ends the process there and then).
        self._restore()
        if self.signal is not None or self._task is None or self._task.done():
            return  # a second one already queued when the first was handled
        self.signal = signum
        self._task.cancel(f"tether: signal {signum}")

    def _restore(self) -> None:
        if self._loop is not None:
            for sig, previous in self._previous.items():
                self._loop.remove_signal_handler(sig)
                signal.signal(sig, previous)
        self._previous.clear()

    def leave(self) -> int | None:
        """Restore the signal handlers; the signal that ended the block, if one did."""
        self._restore()
        self._task = None
        return self.signal
