"""What the runtime's helpers use of the supervisor, as narrow protocols.

Handle, Context, attempts, remote, accounting and draining take one of these instead of
``Supervisor``, so that none of them imports the module that imports them (tests/test_layers.py
checks that the runtime has no import cycle). Nothing here returns a ``Handle``: the ports
return the runtime's records, and callers that need a handle build it (``Handle.for_run``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from tether._core.model import ControlKind, Policy
from tether._core.redispatch import RedispatchPolicy
from tether._core.report import Report
from tether._core.signing import Signed, TrustedKeys
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow, NewDelegation
from tether._runtime.bells import Bells
from tether._runtime.clock import Clock
from tether._runtime.keys import KeyRing
from tether._runtime.state import ChildRuntime, TaskRun
from tether._runtime.telemetry import HookEvent, Telemetry
from tether._runtime.tools import Agent

T = TypeVar("T")


class Journaled(Protocol):
    @property
    def journal(self) -> Journal: ...

    @property
    def clock(self) -> Clock: ...


class Liveness(Journaled, Protocol):
    """Judging whether another owner is alive (``remote.owner_alive``)."""

    @property
    def owner_id(self) -> str: ...

    @property
    def policy(self) -> Policy: ...


class Remote(Liveness, Protocol):
    """Waiting on work another process runs, and reconciling it if that process is gone."""

    async def current_trust(self) -> TrustedKeys: ...

    @property
    def keys(self) -> KeyRing: ...

    @property
    def control_poll(self) -> float: ...

    @property
    def bells(self) -> Bells: ...

    async def wake(self, at_most: float, *topics: str) -> None: ...

    async def recover_delegation(self, row: DelegationRow, reason: str) -> Report: ...


class Handles(Remote, Protocol):
    """What a ``Handle`` does through its supervisor."""

    @property
    def redispatch(self) -> RedispatchPolicy: ...

    async def issue_control(self, delegation_id: str, kind: ControlKind, grace: float | None,
                            reason: str, seq: int | None = None) -> Report: ...

    async def report(self, delegation_id: str) -> Report: ...

    def runtime(self, delegation_id: str) -> ChildRuntime | None: ...

    def sign_work(self, new: NewDelegation) -> NewDelegation: ...

    async def launch(self, rt: ChildRuntime, args: Sequence[Any], kwargs: dict[str, Any],
                     policy: RedispatchPolicy) -> TaskRun: ...


class Calls(Handles, Protocol):
    """What a child's ``Context`` does: journaled tool calls, and grandchildren (with handles)."""

    @property
    def telemetry(self) -> Telemetry: ...

    def track_call(self, action_id: str, task: asyncio.Task[Any],
                   deadline_at: float) -> None: ...

    async def await_call(self, action_id: str, key: str) -> None: ...

    async def start_child(self, parent: ChildRuntime, agent: Agent, args: Sequence[Any],
                          kwargs: dict[str, Any], place: str | None = None) -> TaskRun: ...


class Attempts(Journaled, Protocol):
    """Driving a task's attempts (``attempts.drive``): hooks, forks, forgetting."""

    @property
    def owner_id(self) -> str: ...

    @property
    def telemetry(self) -> Telemetry: ...

    @property
    def keys(self) -> KeyRing: ...

    async def run_hook(self, name: str, event: HookEvent) -> None: ...

    def forget(self, rt: ChildRuntime) -> None: ...

    async def start_attempt(self, rt: ChildRuntime, args: Sequence[Any], kwargs: dict[str, Any],
                            *, retry: bool, after: ChildRuntime | None = None) -> bool: ...


class Drains(Journaled, Protocol):
    """Driving a recall's or terminate's drain (``draining.drain``)."""

    @property
    def policy(self) -> Policy: ...

    @property
    def control_poll(self) -> float: ...

    @property
    def telemetry(self) -> Telemetry: ...

    @property
    def keys(self) -> KeyRing: ...

    async def current_trust(self) -> TrustedKeys: ...


class Issues(Remote, Protocol):
    """Issuing a recall or terminate (``issuing.issue_control``) and draining it."""

    @property
    def telemetry(self) -> Telemetry: ...

    def runtime(self, delegation_id: str) -> ChildRuntime | None: ...

    async def settle_here(self, delegation_id: str, kind: ControlKind, *,
                          seq: int | None = None, reason: str = "") -> Report: ...

    def start_drain(self, rt: ChildRuntime, signed: Signed,
                    accepted_at: float) -> asyncio.Future[Report]: ...

    def spawn(self, coro: Coroutine[Any, Any, T], *, told: bool = False) -> asyncio.Task[T]: ...

    @property
    def is_open(self) -> bool: ...


class Accounts(Liveness, Protocol):
    """What the accounting (``accounting.Accounting``) needs of the supervisor it serves."""

    @property
    def keys(self) -> KeyRing: ...

    @property
    def telemetry(self) -> Telemetry: ...

    @property
    def control_poll(self) -> float: ...

    @property
    def is_open(self) -> bool: ...

    def presumed_dead(self) -> bool: ...

    async def wake(self, at_most: float, *topics: str) -> None: ...

    def runtime(self, delegation_id: str) -> ChildRuntime | None: ...

    def spawn(self, coro: Coroutine[Any, Any, T], *, told: bool = False) -> asyncio.Task[T]: ...


class Adopts(Liveness, Protocol):
    """Acting on intents other processes wrote (``adoption.Adoption``), and the heartbeat."""

    @property
    def control_poll(self) -> float: ...

    @property
    def bells(self) -> Bells: ...

    async def wake(self, at_most: float, *topics: str) -> None: ...

    def presumed_dead(self) -> bool: ...

    def abandon(self) -> None: ...

    def runtime(self, delegation_id: str) -> ChildRuntime | None: ...

    async def current_trust(self) -> TrustedKeys: ...

    def start_drain(self, rt: ChildRuntime, signed: Signed,
                    accepted_at: float) -> asyncio.Future[Report]: ...

    def spawn(self, coro: Coroutine[Any, Any, T], *, told: bool = False) -> asyncio.Task[T]: ...

    async def settle_here(self, delegation_id: str, kind: ControlKind, *,
                          seq: int | None = None, reason: str = "") -> Report: ...
