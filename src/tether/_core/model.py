"""States, effects and the one place their transitions are checked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from tether._core.errors import AlreadyFinished, InvalidTransition, UserError


class Effect(StrEnum):
    """What calling a tool does to the world. Undeclared means EXTERNAL."""

    READ_ONLY = "READ_ONLY"
    IDEMPOTENT = "IDEMPOTENT"
    EXTERNAL = "EXTERNAL"
    DELEGATE = "DELEGATE"

    @property
    def journaled(self) -> bool:
        return self is not Effect.READ_ONLY

    @property
    def side_effecting(self) -> bool:
        """True for effects a replay could repeat. DELEGATE counts through the child's rows."""
        return self in (Effect.IDEMPOTENT, Effect.EXTERNAL)


class ActionState(StrEnum):
    PENDING = "PENDING"  # intent durable, no outcome yet
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"  # the tool said, with certainty, it did not apply (ToolRejected)
    IN_DOUBT = "IN_DOUBT"  # outcome unknown until probed
    NOT_APPLIED = "NOT_APPLIED"  # a probe proved it did not apply
    UNKNOWN = "UNKNOWN"  # a probe could not tell; a person must look


ACTION_FINAL = frozenset(
    {ActionState.COMPLETED, ActionState.FAILED, ActionState.NOT_APPLIED, ActionState.UNKNOWN}
)

_ACTION_MOVES: dict[ActionState, frozenset[ActionState]] = {
    ActionState.PENDING: frozenset(
        {ActionState.COMPLETED, ActionState.FAILED, ActionState.IN_DOUBT}
    ),
    # The executor's late receipt settles an action in doubt either way: it applied
    # (COMPLETED), or the tool said with certainty that it did not (FAILED, ToolRejected).
    ActionState.IN_DOUBT: frozenset(
        {ActionState.COMPLETED, ActionState.FAILED, ActionState.NOT_APPLIED, ActionState.UNKNOWN}
    ),
    # UNKNOWN may be settled by a later probe or a late receipt; a late receipt may prove
    # NOT_APPLIED wrong.
    ActionState.UNKNOWN: frozenset(
        {ActionState.COMPLETED, ActionState.FAILED, ActionState.NOT_APPLIED}
    ),
    ActionState.NOT_APPLIED: frozenset({ActionState.COMPLETED}),
    ActionState.COMPLETED: frozenset(),
    ActionState.FAILED: frozenset(),
}


def action_may_move(old: ActionState, new: ActionState) -> bool:
    return new in _ACTION_MOVES[old]


class CallEnd(StrEnum):
    """How a tool call's code ended in the gateway; its receipt's state is ``receipt_of``'s."""

    RETURNED = "returned"
    REJECTED = "rejected"  # the tool said with certainty that it did not apply (ToolRejected)
    PAST_DEADLINE = "past_deadline"  # never sent: paused past its dispatch deadline
    RAISED = "raised"  # any other exception: the request may have reached the world
    CUT = "cut"  # cancelled on its way: nothing is written, the intent stays as it was


def receipt_of(end: CallEnd) -> ActionState:
    """What the gateway records when a call's code ends (for ``CUT``, what its span says:
    the journal keeps the intent, which the drain or recovery marks in doubt)."""
    if end is CallEnd.RETURNED:
        return ActionState.COMPLETED
    if end in (CallEnd.REJECTED, CallEnd.PAST_DEADLINE):
        return ActionState.FAILED
    return ActionState.IN_DOUBT


# What a probe (or a person) may still settle, in the order a person should look at them: the
# accounting's reads, the console's queue and its decisions, the CLI's exit codes.
AWAITING = (ActionState.UNKNOWN, ActionState.IN_DOUBT)
AWAITING_PROBE = frozenset(AWAITING)


def executor_gone(state: ActionState) -> ActionState:
    """An action whose executor is going away (cancelled, terminated, its process presumed
    dead, its receipt refused by the disk): a call with no outcome yet is in doubt, for a
    probe to settle; any other keeps its state. The journal writes the move guarded by the
    state judged here."""
    return ActionState.IN_DOUBT if state is ActionState.PENDING else state


class DelegationState(StrEnum):
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    RECALLING = "RECALLING"
    RECALLED = "RECALLED"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"
    RECONCILED = "RECONCILED"
    NEEDS_ATTENTION = "NEEDS_ATTENTION"
    SUCCEEDED_PARTIAL = "SUCCEEDED_PARTIAL"  # a cut stream's salvaged output is the result
    CANCELLED = "CANCELLED"  # a re-dispatched attempt torn down before its code ran
    INTERRUPTED = "INTERRUPTED"  # stopped to wait for input; re-delegated with the answer

    @property
    def terminal(self) -> bool:
        return self in DELEGATION_TERMINAL


DELEGATION_TERMINAL = frozenset(
    {
        DelegationState.SUCCEEDED,
        DelegationState.FAILED,
        DelegationState.RECALLED,
        DelegationState.TERMINATED,
        DelegationState.RECONCILED,
        DelegationState.NEEDS_ATTENTION,
        DelegationState.SUCCEEDED_PARTIAL,
        DelegationState.CANCELLED,
        DelegationState.INTERRUPTED,
    }
)

_S = DelegationState
_FINISH = frozenset({_S.RECONCILED, _S.NEEDS_ATTENTION})
_DELEGATION_MOVES: dict[DelegationState, frozenset[DelegationState]] = {
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.RECALLING, _S.TERMINATING,
                           _S.SUCCEEDED_PARTIAL, _S.CANCELLED, _S.INTERRUPTED}) | _FINISH,
    _S.RECALLING: frozenset({_S.RECALLED, _S.TERMINATING}) | _FINISH,
    _S.TERMINATING: frozenset({_S.TERMINATED}) | _FINISH,
    # A finished child whose own actions were in doubt is reconciled afterwards.
    _S.SUCCEEDED: _FINISH,
    _S.SUCCEEDED_PARTIAL: _FINISH,
    _S.INTERRUPTED: _FINISH,
    _S.FAILED: _FINISH,
    _S.CANCELLED: frozenset(),
    _S.RECALLED: _FINISH,
    _S.TERMINATED: _FINISH,
    _S.NEEDS_ATTENTION: frozenset({_S.RECONCILED}),
    # Only a fact that contradicts a final outcome (a receipt for a key already freed) can
    # re-open a reconciled delegation: a person must look.
    _S.RECONCILED: frozenset({_S.NEEDS_ATTENTION}),
}


def check_delegation_move(delegation_id: str, old: DelegationState, new: DelegationState,
                          control_seq: int | None = None) -> None:
    """The single gate for delegation transitions; raises InvalidTransition (naming the
    control sequence, when a control intent is refused after another was accepted)."""
    if new in _DELEGATION_MOVES[old]:
        return
    current = control_seq if control_seq else None
    if old.terminal:
        raise AlreadyFinished(delegation_id, old.value, new.value, current)
    raise InvalidTransition(delegation_id, old.value, new.value, current)


class ControlKind(StrEnum):
    RECALL = "RECALL"
    TERMINATE = "TERMINATE"

    @property
    def target(self) -> DelegationState:
        """Where an accepted intent moves a live delegation: its drain runs from there."""
        return _S.RECALLING if self is ControlKind.RECALL else _S.TERMINATING

    @property
    def settled(self) -> DelegationState:
        """Where its drain (or recovery) ends it once nothing it started can still apply."""
        return _S.RECALLED if self is ControlKind.RECALL else _S.TERMINATED


def code_ended(*, returned: bool, waiting: bool = False,
               salvaged: bool = False) -> DelegationState:
    """Where a child's own code leaves its delegation: it returned (SUCCEEDED, or INTERRUPTED
    when what it returned asks for input, ``waiting``); it raised on a cut stream whose
    salvaged output is its result (SUCCEEDED_PARTIAL: retrying would destroy it); it raised,
    or its work was refused before it ran (FAILED)."""
    if returned:
        return _S.INTERRUPTED if waiting else _S.SUCCEEDED
    return _S.SUCCEEDED_PARTIAL if salvaged else _S.FAILED


# A new attempt is forked only after one that ended FAILED (its stream cut, I6); the journal's
# fork gate reads the failed attempt's state against this one.
RETRIED_FROM = _S.FAILED
# An attempt forked while a cancel came (I6): refused before its code ran, nothing of it ran.
FORK_REFUSED = _S.CANCELLED


def fenced_below(state: DelegationState, kind: ControlKind) -> DelegationState:
    """A descendant of a delegation whose RECALL or TERMINATE was just accepted (I10): it is
    fenced with the root, and a live one follows the root's state (a RECALLING one under a
    TERMINATE is terminated); one that ended, or is already terminating, keeps its state."""
    if state in (_S.RUNNING, _S.RECALLING):
        return kind.target
    return state


class ProbeOutcome(StrEnum):
    COMPLETED = "COMPLETED"
    NOT_APPLIED = "NOT_APPLIED"
    UNKNOWN = "UNKNOWN"

    @property
    def action_state(self) -> ActionState:
        return ActionState(self.value)


# Seconds by which two processes' wall clocks may differ (``Policy.clock_tolerance``).
DEFAULT_CLOCK_TOLERANCE = 5.0


@dataclass(frozen=True)
class Policy:
    """Bounds the supervisor enforces. Grace above ``max_grace`` is refused, not clamped."""

    max_grace: float = 300.0
    ack_timeout: float = 5.0  # how long to wait for a child's acknowledgement of a recall
    probe_timeout: float = 10.0
    lease: float = 30.0  # an owner whose heartbeat is older than this is presumed dead
    # The most two processes' wall clocks may differ: a call's dispatch deadline, written on
    # its executor's clock, is judged passed only this much after it on any other. A process
    # on a shared journal (PostgreSQL) whose clock is more than half of it off the server's
    # refuses to run (docs/design.md, "The outcome model").
    clock_tolerance: float = DEFAULT_CLOCK_TOLERANCE

    def __post_init__(self) -> None:
        for name in ("max_grace", "ack_timeout", "probe_timeout", "lease", "clock_tolerance"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise UserError(f"policy {name} must be a positive finite number, got {value!r}")


def _positive_finite(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def check_grace(grace: object, policy: Policy) -> float:
    """Grace must be a finite number in (0, policy.max_grace]. Refusing beats clamping: a
    caller who asked for ten minutes and silently got five would plan on the wrong bound."""
    if not _positive_finite(grace):
        raise UserError(f"grace must be a positive finite number of seconds, got {grace!r}")
    assert isinstance(grace, int | float)
    if grace > policy.max_grace:
        raise UserError(
            f"grace {grace:g}s is above the policy maximum of {policy.max_grace:g}s"
        )
    return float(grace)


def check_positive(value: object, name: str) -> float:
    if not _positive_finite(value):
        raise UserError(f"{name} must be a positive finite number of seconds, got {value!r}")
    assert isinstance(value, int | float)
    return float(value)
