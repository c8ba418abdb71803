"""Plain records passed across the journal boundary, and JSON helpers for their columns."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tether._core.model import ControlKind, DelegationState, Effect
from tether._core.signing import Signed


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


@dataclass(frozen=True)
class NewDelegation:
    id: str
    task_id: str
    parent_id: str | None
    attempt: int
    agent: str
    surface: tuple[str, ...]
    args: Any
    owner_id: str
    now: float
    # For a re-delegation: the epoch the caller saw. The journal moves the task to epoch + 1
    # only if it is still there (compare-and-set), so two racing callers cannot both win.
    redelegate_from_epoch: int | None = None
    # For a re-delegation that must not follow a stop (a Temporal run reopened at its next
    # epoch): the superseded delegation and its control sequence as the caller judged them;
    # refused (StaleSequence) if an intent was accepted for it since.
    unstopped: tuple[str, int] | None = None
    # For a child: the parent's epoch, checked with the parent's fence in the same statement.
    parent_epoch: int | None = None
    # For a re-dispatch: the failed attempt this one replaces, at the same task and epoch.
    retry_of: str | None = None
    model: str | None = None
    trace_id: str | None = None
    # Queued for a worker process (``tether worker``) instead of run by its creator.
    queued: bool = False
    # The delegating process's signed work order (a WorkOrder): what a worker may run.
    work: Signed | None = None


@dataclass(frozen=True)
class DelegationRow:
    id: str
    task_id: str
    parent_id: str | None
    epoch: int
    attempt: int
    agent: str
    surface: tuple[str, ...]
    args: Any
    owner_id: str
    state: DelegationState
    fenced: bool
    control_seq: int
    created_at: float
    updated_at: float
    result: Any
    error: str | None
    failure: str | None = None
    model: str | None = None
    trace_id: str | None = None
    ended_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task_id,
            "parent": self.parent_id,
            "epoch": self.epoch,
            "attempt": self.attempt,
            "agent": self.agent,
            "surface": list(self.surface),
            "owner": self.owner_id,
            "state": self.state.value,
            "fenced": self.fenced,
            "control_seq": self.control_seq,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "result": self.result,
            "error": self.error,
            "failure": self.failure,
            "model": self.model,
            "trace_id": self.trace_id,
            "ended_at": self.ended_at,
        }


@dataclass(frozen=True)
class NewAction:
    id: str
    delegation_id: str
    epoch: int
    ordinal: int
    tool: str
    effect: Effect
    args_json: str
    args_hash: str
    idem_key: str
    now: float
    deadline_at: float  # after this wall time the call can no longer apply (outcome model)


class Begin(StrEnum):
    STARTED = "STARTED"  # intent durable: the tool may run
    REPLAY = "REPLAY"  # the key already COMPLETED with these arguments: return its result
    FENCED = "FENCED"  # a RECALL or TERMINATE was accepted for the delegation (I2)
    STALE_EPOCH = "STALE_EPOCH"  # the task was re-delegated (I4)
    LEASE_EXPIRED = "LEASE_EXPIRED"  # the owning worker's lease ran out: it may be presumed dead
    WAIT = "WAIT"  # an earlier call with this key may still apply: wait for its outcome


@dataclass(frozen=True)
class BeginResult:
    status: Begin
    action_id: str
    result: Any = None


@dataclass(frozen=True)
class ControlRow:
    id: int
    delegation_id: str
    seq: int
    kind: ControlKind
    signed: Signed
    accepted_at: float
    issuer: str


@dataclass(frozen=True)
class DocumentRow:
    delegation_id: str
    seq: int
    type: str
    signed: Signed
    recorded_at: float
    id: int = 0  # its row, as the chain names it


@dataclass(frozen=True)
class EventRow:
    id: int
    delegation_id: str | None
    action_id: str | None
    at: float
    kind: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class OwnerRow:
    id: str
    pid: int
    host: str
    started_at: float
    heartbeat_at: float
    lease_until: float | None = None  # a worker's lease; None for an owner without one


@dataclass(frozen=True)
class QueueEntry:
    """A delegation queued for workers: who claimed it, and when its task was done."""

    delegation_id: str
    task_id: str
    agent: str
    enqueued_at: float
    claimed_by: str | None
    claimed_at: float | None
    done_at: float | None


@dataclass(frozen=True)
class QueueProgress:
    """What an orchestrator waiting on a queued task reads on each poll, in one go."""

    entry: QueueEntry | None
    latest: DelegationRow  # the newest attempt of the task
    claimant: OwnerRow | None  # the worker that claimed it, if any and still registered
    server_now: float | None  # the database server's clock, where it has one (PostgreSQL)
