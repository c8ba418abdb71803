"""The supervisor's in-memory records: each running delegation (``ChildRuntime``), each task
across its attempts (``TaskRun``), and the ids they are made with.

A leaf of the runtime: every other runtime module may import it, and it imports none of them
but ``tools``, so that the records never pull in the code that drives them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from uuid_utils import uuid7

from tether._core.errors import ControlSignal, Terminated
from tether._core.redispatch import RedispatchPolicy
from tether._journal.rows import DelegationRow
from tether._runtime.tools import Agent, Tool

if TYPE_CHECKING:
    from opentelemetry.trace import Span

def _uuid7_bytes() -> bytes:
    return uuid7().bytes


# Where ids' 16 bytes come from: a UUIDv7 in production; a simulation swaps in a seeded
# source (``id_source``) so that a trial's ids, and so its interleaving, follow from its seed.
_id_bytes: Callable[[], bytes] = _uuid7_bytes


@contextmanager
def id_source(source: Callable[[], bytes]) -> Iterator[None]:
    """Make ``new_id`` draw its 16 bytes from ``source`` inside the block."""
    global _id_bytes
    before, _id_bytes = _id_bytes, source
    try:
        yield
    finally:
        _id_bytes = before


# Two base32hex digits for each 10 bits: an id is 13 lookups (``base64.b32hexencode`` is a
# loop in Python, and half of what ``new_id`` cost).
_PAIRS = tuple(a + b for a in "0123456789abcdefghijklmnopqrstuv"
               for b in "0123456789abcdefghijklmnopqrstuv")


def new_id(prefix: str) -> str:
    """Unique across processes and sorting by creation time, to the millisecond: a UUIDv7 in
    RFC 4648 base32hex, lower case (26 characters, whose order is the bytes' order), e.g.
    ``d_069fjb5a1g7vq4s3k9m2r8e1lc``. An operator can tell two ids apart by any part of them,
    and a listing by id is a listing by age."""
    n, t = int.from_bytes(_id_bytes(), "big") << 2, _PAIRS  # 128 bits, padded to 26 x 5
    return (f"{prefix}_{t[n >> 120]}{t[n >> 110 & 1023]}{t[n >> 100 & 1023]}"
            f"{t[n >> 90 & 1023]}{t[n >> 80 & 1023]}{t[n >> 70 & 1023]}{t[n >> 60 & 1023]}"
            f"{t[n >> 50 & 1023]}{t[n >> 40 & 1023]}{t[n >> 30 & 1023]}{t[n >> 20 & 1023]}"
            f"{t[n >> 10 & 1023]}{t[n & 1023]}")


@dataclass(slots=True)
class Answering:
    """Which intents a drain under way answers (``draining``): the newest one (its own, or a
    terminate that cut its grace window short), and whether it has chosen how it ends. A
    terminate after that is answered once the drain is over, with a verdict of its own:
    ``later`` is that terminate's sequence and its settle's task."""

    seq: int = 0
    planned: bool = False
    later: tuple[int, asyncio.Future[Any]] | None = None


@dataclass(eq=False)
class ChildRuntime:
    """In-memory state of one running delegation, owned by its supervisor."""

    row: DelegationRow
    agent: Agent
    surface: dict[str, Tool | Agent | str]
    parent: ChildRuntime | None = None
    task: asyncio.Task[Any] | None = None
    inflight: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    children: list[ChildRuntime] = field(default_factory=list)
    stop: ControlSignal | None = None
    ordinals: Counter[str] = field(default_factory=Counter)  # per tool: derives default keys
    calls: int = 0  # journaled calls so far: orders this delegation's actions
    effects_started: int = 0  # side-effecting intents this child made (for its own receipt)
    draining: asyncio.Future[Any] | None = None  # the report of a recall/terminate under way
    answering: Answering = field(default_factory=Answering)
    run: TaskRun | None = None  # the task this attempt belongs to
    generation: int = 0  # the task's cancel generation when its first attempt started
    span: Span | None = None
    final: DelegationRow | None = None  # the row as the child's own ending left it
    outcome: str | None = None  # its state when its stop hook fired (telemetry)
    # Other processes may run calls of this delegation (a Temporal run's activities on other
    # workers of its queue): its drain waits for intents it has no task for.
    guests: bool = False

    @property
    def id(self) -> str:
        return self.row.id

    def walk(self) -> list[ChildRuntime]:
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out

    def inflight_tasks(self) -> list[asyncio.Task[Any]]:
        return [t for rt in self.walk() for t in rt.inflight.values()]

    def cut(self, *, actions: bool = True) -> None:
        """Stop the subtree now. A terminate also cancels in-flight actions; when a recall's
        grace ends they are left to finish on their own, so that a completion arriving after
        the window is still recorded (a late receipt) rather than lost with its task."""
        for node in self.walk():
            node.stop = Terminated(node.id, "terminated")
            tasks = [*node.inflight.values(), node.task] if actions else [node.task]
            for task in tasks:
                if task is not None and not task.done():
                    task.cancel()


@dataclass(eq=False)
class TaskRun:
    """One delegated task across its attempts."""

    task_id: str
    policy: RedispatchPolicy
    current: ChildRuntime
    attempts: list[ChildRuntime]
    done: asyncio.Future[tuple[bool, Any]]
    span: Span | None = None
    cut_short: asyncio.Event = field(default_factory=asyncio.Event)
