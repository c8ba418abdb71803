"""Wake-ups from the journal's notifications, routed to the loops that wait for them.

A notification is a hint, never a fact (``_journal/wake.py``): whoever is woken reads the
journal, as its poll would. Each waiting loop listens only for what concerns it (the
adoption watch for intents on this owner's delegations, a worker for queued tasks), so a busy
queue does not make every supervisor re-read its intents; and a ring that comes while its
loop is busy reading is kept for the loop's next wait, so a commit that the read just missed
is read at once, not at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

RECONNECTED = "reconnected"  # the listener was cut: what it missed is read by everyone now


class Bell:
    """One loop's wake-up. ``topics`` None: any notification rings it."""

    def __init__(self, topics: frozenset[str] | None) -> None:
        self.topics = topics
        self._rung = False
        self._waiter: asyncio.Future[None] | None = None

    def hears(self, payload: str) -> bool:
        return self.topics is None or payload == RECONNECTED or payload in self.topics

    def ring(self) -> None:
        self._rung = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, at_most: float) -> None:
        """Until rung (now, if it was rung since the last wait) or ``at_most`` seconds."""
        if not self._rung:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait([self._waiter], timeout=at_most)
            finally:
                self._waiter = None
        self._rung = False


class Bells:
    """The bells of one process's loops, rung from the event loop's thread."""

    def __init__(self) -> None:
        self._bells: set[Bell] = set()

    def bell(self, *topics: str) -> Bell:
        """A bell for a loop that lives as long as the process (``forget`` it otherwise)."""
        made = Bell(frozenset(topics) if topics else None)
        self._bells.add(made)
        return made

    def forget(self, bell: Bell) -> None:
        self._bells.discard(bell)

    @contextlib.contextmanager
    def listening(self, *topics: str) -> Iterator[Bell]:
        """A bell for a loop that reads, then waits, over and over: registered before its
        first read, so that a ring during any read is kept; forgotten however the loop ends."""
        bell = self.bell(*topics)
        try:
            yield bell
        finally:
            self.forget(bell)

    def ring(self, payload: str) -> None:
        for bell in list(self._bells):
            if bell.hears(payload):
                bell.ring()

    async def wait(self, at_most: float, *topics: str) -> None:
        """One wait, for a caller without a loop of its own (rings before it are not kept)."""
        bell = self.bell(*topics)
        try:
            await bell.wait(at_most)
        finally:
            self.forget(bell)
