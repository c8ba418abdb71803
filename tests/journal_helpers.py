"""Rows and a clock for tests that drive the journal's operations directly, without a
supervisor: a root delegation, one call to ``pay`` in it, and a clock that stands still."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import tether
from tether._journal.rows import NewAction, NewDelegation


def pay_action(id_: str, delegation: str, now: float) -> NewAction:
    """A call to ``pay`` with the key ``k1``, begun at ``now``, its dispatch deadline 1 s on."""
    return NewAction(
        id=id_, delegation_id=delegation, epoch=0, ordinal=0, tool="pay",
        effect=tether.Effect.EXTERNAL, args_json="{}", args_hash="h", idem_key="k1", now=now,
        deadline_at=now + 1.0)


def root_delegation(id_: str, task: str) -> NewDelegation:
    """A delegation with no parent, owned by ``o``, whose surface is ``pay``."""
    return NewDelegation(id=id_, task_id=task, parent_id=None, attempt=1, agent="agent",
                         surface=("pay",), args={}, owner_id="o", now=1.0)


class FixedClock:
    """A clock that reads a fixed wall time (the instant a probe is sent)."""

    def __init__(self, wall: float) -> None:
        self._wall = wall

    def now(self) -> float:
        return self._wall

    def wall(self) -> float:
        return self._wall

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)


async def writer_held(runner: Any) -> tuple[asyncio.Future[Any], threading.Event]:
    """Hold a journal's writer thread (``ThreadRunner``) in a batch of its own until the
    returned event is set: whatever is submitted meanwhile queues for its next batch. Returns
    the holding operation's future (await it after setting the event) and the event."""
    held, hold = threading.Event(), threading.Event()

    def block(db: Any) -> bool:
        held.set()
        return hold.wait(5)

    blocker = runner.submit(block, write=False)
    await asyncio.to_thread(held.wait, 5)  # the writer thread runs the blocker
    return blocker, hold
