"""The outcome model: when an action's outcome is final, and what the journal does with a new
fact about it. Pure: the journal's operations, the runtime and the simulator all decide here.

Final means final. A probe's "not applied" is final only when the call can no longer apply:
the probe voided the key at the provider, or the tool's dispatch deadline, journaled with the
intent, has passed by more than the clock tolerance. Until then the action stays IN_DOUBT,
"not applied yet", and is probed again then.

The deadline is written on the executor's clock and judged on the judge's: every judgement adds
the clock tolerance T, and every process on a shared journal checks that its clock is within
T/2 of the journal server's (the runtime's ``clockcheck``), so any two are within T of each
other and "past deadline + T on my clock" implies "past the deadline on the writer's".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tether._core.model import (
    DEFAULT_CLOCK_TOLERANCE,
    ActionState,
    DelegationState,
    ProbeOutcome,
    action_may_move,
)

# Seconds after an intent within which a dispatched call may still apply at the provider
# (a request in the network, a provider's queue). A tool declares its own; this is the default.
DEFAULT_DISPATCH_DEADLINE = 30.0

_A = ActionState
_S = DelegationState
# Outcomes that prove nothing was applied: the only ones that free an idempotency key.
KEY_FREE = frozenset({_A.FAILED, _A.NOT_APPLIED})
# Outcomes that still owe reconciliation.
UNSETTLED = frozenset({_A.PENDING, _A.IN_DOUBT})


def may_still_apply(*, deadline_at: float, now: float, tolerance: float) -> bool:
    """Can this call still apply? Until its dispatch deadline it can, whatever is known of its
    executor: a task that raised, was cancelled or whose process died may have left its
    request in the network. The tool's deadline is its promise that nothing applies later.
    ``deadline_at`` was written on its executor's clock and ``now`` read on the judge's: the
    call may still apply until ``tolerance`` (the most two clocks may differ) past it."""
    return now < final_at(deadline_at, tolerance)


def final_at(deadline_at: float, tolerance: float) -> float:
    """The first time, on any process's clock, at which the call surely can no longer apply."""
    return deadline_at + tolerance


def judge_probe(answer: ProbeOutcome, *, voided: bool, deadline_at: float,
                now: float, tolerance: float) -> ActionState:
    """The state a probe's answer moves an in-doubt action to."""
    if answer is ProbeOutcome.COMPLETED:
        return _A.COMPLETED
    if answer is ProbeOutcome.UNKNOWN:
        return _A.UNKNOWN
    if voided or not may_still_apply(deadline_at=deadline_at, now=now, tolerance=tolerance):
        return _A.NOT_APPLIED
    return _A.IN_DOUBT  # not applied *yet*: probed again after the deadline


def probe_again(state: ActionState, *, deadline_at: float, asked_at: float | None,
                tolerance: float, can_probe: bool) -> bool:
    """Whether an action is to be probed again once its call can no longer apply (at
    ``final_at``): IN_DOUBT always ("not applied yet"); UNKNOWN when the probe that could not
    tell (it failed, it timed out) was asked while the call could still apply, and the tool
    has a probe: at the deadline an answer is final. When unsure, keep checking. (Asked, not
    answered: a probe sent before the deadline that times out after it spoke of a moment the
    call could still apply.)"""
    if state is _A.IN_DOUBT:
        return True
    return state is _A.UNKNOWN and can_probe and (asked_at is None or may_still_apply(
        deadline_at=deadline_at, now=asked_at, tolerance=tolerance))


class Receipt(StrEnum):
    """What the journal does with a new outcome for an action."""

    RECORD = "RECORD"  # the outcome of a call still PENDING, or a probe's answer
    LATE = "LATE"  # an executor's receipt for an action already declared in doubt: kept, flagged
    IGNORE = "IGNORE"  # the same outcome again, or one that cannot follow (logged as an event)


def judge_receipt(old: ActionState, new: ActionState, *, from_probe: bool,
                  fills_result: bool = False) -> Receipt:
    """A fence refuses new intents, never receipts: an executor's outcome is recorded whenever
    it arrives. A COMPLETED fact overrides NOT_APPLIED or UNKNOWN, the tool's certain
    rejection (FAILED) an IN_DOUBT or UNKNOWN; nothing overrides
    COMPLETED or FAILED. ``fills_result``: the executor's COMPLETED receipt carries the result
    a probe that found the call applied could not tell; it is kept (late)."""
    if old is _A.COMPLETED and new is _A.COMPLETED and fills_result and not from_probe:
        return Receipt.LATE
    if old is new and not (from_probe and old in (_A.IN_DOUBT, _A.UNKNOWN)):
        return Receipt.IGNORE
    if old is new:
        # A probe's "not yet" (IN_DOUBT), or another probe that could not tell (UNKNOWN):
        # its evidence is recorded, and with it when it was asked, which says whether to ask
        # again (``probe_again``): one asked once nothing could apply any more is the last.
        return Receipt.RECORD
    if not action_may_move(old, new):
        return Receipt.IGNORE
    if old is _A.PENDING or from_probe:
        return Receipt.RECORD
    return Receipt.LATE


# -- idempotency keys (I7) -------------------------------------------------------------------

@dataclass(frozen=True)
class PriorCall:
    """An earlier action with the same idempotency key."""

    action_id: str
    tool: str
    args_hash: str
    state: ActionState
    result: Any = None
    deadline_at: float | None = None  # None: an older journal's row (its tool's deadline)


def holds_key(call: PriorCall, now: float, tolerance: float) -> bool:
    """An UNKNOWN earlier call still holds its key for others to wait on until its deadline:
    its own receipt may still come (then it replays), or the next probe may be final."""
    return call.state in UNSETTLED or (
        call.state is _A.UNKNOWN and call.deadline_at is not None
        and may_still_apply(deadline_at=call.deadline_at, now=now, tolerance=tolerance))


class KeyVerdict(StrEnum):
    RUN = "RUN"  # no live use of the key: the intent may be written
    REPLAY = "REPLAY"  # the key COMPLETED with these arguments: return its result
    WAIT = "WAIT"  # the earlier call may still apply: wait for its outcome, then decide again
    UNKNOWN = "UNKNOWN"  # the earlier call's outcome is unknown: a person must decide
    CONFLICT = "CONFLICT"  # the key was used with other arguments (the Stripe rule)


@dataclass(frozen=True)
class KeyDecision:
    verdict: KeyVerdict
    prior: PriorCall | None = None


def decide_key(tool: str, args_hash: str, prior: Sequence[PriorCall],
               now: float, tolerance: float) -> KeyDecision:
    """A probe never frees a key that may still be live: only FAILED and a final NOT_APPLIED do.
    A re-delegated child reaching a key still in flight or in doubt waits for it; an UNKNOWN
    one is a person's to decide once its deadline has passed."""
    waiting: PriorCall | None = None
    for call in prior:
        if call.args_hash != args_hash or call.tool != tool:
            return KeyDecision(KeyVerdict.CONFLICT, call)
    for call in prior:
        if call.state is _A.COMPLETED:
            return KeyDecision(KeyVerdict.REPLAY, call)
        if holds_key(call, now, tolerance):
            waiting = call
        elif call.state is _A.UNKNOWN:
            return KeyDecision(KeyVerdict.UNKNOWN, call)
    if waiting is not None:
        return KeyDecision(KeyVerdict.WAIT, waiting)
    return KeyDecision(KeyVerdict.RUN)


# -- the fence (I2, I4) ------------------------------------------------------------------------

class Gate(StrEnum):
    OPEN = "OPEN"
    FENCED = "FENCED"  # a RECALL or TERMINATE was accepted for the delegation
    STALE_EPOCH = "STALE_EPOCH"  # the task was re-delegated
    LEASE_EXPIRED = "LEASE_EXPIRED"  # the owning worker's lease ran out


def judge_gate(*, fenced: bool, epoch: int, task_epoch: int, caller_epoch: int,
               lease_until: float | None, now: float) -> Gate:
    """Whether a new intent (action, child, attempt) may pass. Receipts never come here."""
    if fenced:
        return Gate.FENCED
    if lease_until is not None and lease_until <= now:
        return Gate.LEASE_EXPIRED
    if epoch != caller_epoch or task_epoch != caller_epoch:
        return Gate.STALE_EPOCH
    return Gate.OPEN


# -- liveness ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnerFacts:
    """What the journal (and this host) know of the process that owns a delegation."""

    heartbeat_at: float
    lease_until: float | None  # a worker's lease; None for an owner without one
    same_host: bool
    pid_alive: bool | None  # on this host: does its process exist (None: not asked)


def owner_alive(owner: OwnerFacts | None, *, now: float, server_now: float | None,
                heartbeat_lease: float) -> bool:
    """A worker is alive while its lease holds (judged on the database server's clock where
    there is one); another owner while its heartbeat is recent and, on this host, while its
    process exists. Presumed dead is not gone: its calls may still land (``may_still_apply``)."""
    if owner is None:
        return False
    if owner.lease_until is not None:
        return owner.lease_until > (now if server_now is None else server_now)
    if now - owner.heartbeat_at > heartbeat_lease:
        return False
    return not (owner.same_host and owner.pid_alive is False)


# -- settling a delegation --------------------------------------------------------------------

@dataclass(frozen=True)
class ActionFacts:
    state: ActionState
    probed: bool  # it carries a probe's (or a person's) evidence


def natural_end(state: DelegationState, fallback: DelegationState) -> DelegationState:
    """Where a stopped delegation ends when nothing had to be probed: a recall that was under
    way ends RECALLED (even if its owner died in the grace window), a terminate TERMINATED."""
    if state is _S.RECALLING:
        return _S.RECALLED
    if state is _S.TERMINATING:
        return _S.TERMINATED
    return fallback


def settle(state: DelegationState, actions: Iterable[ActionFacts],
           fallback: DelegationState, *, children_settled: bool = True,
           attention: bool = False) -> DelegationState:
    """A node's state once its accounting is done, or ``state`` unchanged while it is not.

    A node with an action that may still apply (PENDING or IN_DOUBT) is not settled: it keeps
    its state (a stopping one stays RECALLING or TERMINATING), so that whoever checks again can
    settle it. Any UNKNOWN needs a person; anything probed is RECONCILED (an INTERRUPTED node
    stays INTERRUPTED: it still waits for its answer); otherwise the natural end. Applied to a
    settled node, it re-opens the accounting: NEEDS_ATTENTION whose last UNKNOWN was settled
    moves to RECONCILED. A node whose children are not all settled keeps its
    state (a parent is not settled before its subtree), and a RUNNING node settles when its
    code ends, never from outside. ``attention``: a new fact contradicts a final outcome (a
    receipt for a freed key, for a person's decision): a node it settles needs a person."""
    new = _settle(state, list(actions), fallback, children_settled)
    if attention and new.terminal and new not in (_S.NEEDS_ATTENTION, _S.CANCELLED):
        return _S.NEEDS_ATTENTION
    return new


def _settle(state: DelegationState, facts: list[ActionFacts], fallback: DelegationState,
            children_settled: bool) -> DelegationState:
    if state in (_S.RECONCILED, _S.CANCELLED, _S.RUNNING) or not children_settled:
        return state
    if any(a.state in UNSETTLED for a in facts):
        return state
    if any(a.state is _A.UNKNOWN for a in facts):
        return _S.NEEDS_ATTENTION
    if any(a.probed for a in facts) or state is _S.NEEDS_ATTENTION:
        # Its state is the only record that it waits: its result is the questions, and any
        # result may have their shape.
        return _S.INTERRUPTED if state is _S.INTERRUPTED else _S.RECONCILED
    if state.terminal:
        return state
    return natural_end(state, fallback)


__all__ = [
    "DEFAULT_CLOCK_TOLERANCE",
    "DEFAULT_DISPATCH_DEADLINE",
    "KEY_FREE",
    "UNSETTLED",
    "ActionFacts",
    "Gate",
    "KeyDecision",
    "KeyVerdict",
    "OwnerFacts",
    "PriorCall",
    "Receipt",
    "decide_key",
    "final_at",
    "holds_key",
    "judge_gate",
    "judge_probe",
    "judge_receipt",
    "may_still_apply",
    "natural_end",
    "owner_alive",
    "probe_again",
    "settle",
]
