"""State machines and policy bounds (I3, I4)."""

from __future__ import annotations

import math

import pytest

import tether
from tether._core.model import (
    ACTION_FINAL,
    action_may_move,
    check_delegation_move,
    check_grace,
)

S = tether.DelegationState
A = tether.ActionState


def test_terminal_delegations_only_move_to_reconciliation() -> None:
    for state in S:
        if state.terminal and state not in (S.RECONCILED, S.NEEDS_ATTENTION, S.CANCELLED):
            with pytest.raises(tether.AlreadyFinished):
                check_delegation_move("d", state, S.RECALLING)
            check_delegation_move("d", state, S.RECONCILED)


def test_a_cancelled_attempt_never_moves_again() -> None:
    # It was torn down before its code ran: nothing of it can need reconciling.
    for state in S:
        with pytest.raises(tether.InvalidTransition):
            check_delegation_move("d", S.CANCELLED, state)


def test_recall_twice_is_an_invalid_transition_but_terminate_escalates() -> None:
    with pytest.raises(tether.InvalidTransition):
        check_delegation_move("d", S.RECALLING, S.RECALLING)
    check_delegation_move("d", S.RECALLING, S.TERMINATING)
    with pytest.raises(tether.InvalidTransition):
        check_delegation_move("d", S.TERMINATING, S.RECALLING)


def test_every_action_path_ends_in_a_final_state() -> None:
    # From PENDING, every state reachable leads to a final one (I3: nothing dropped).
    seen, frontier = set(), [A.PENDING]
    while frontier:
        state = frontier.pop()
        seen.add(state)
        nexts = [n for n in A if action_may_move(state, n)]
        assert nexts or state in ACTION_FINAL
        frontier += [n for n in nexts if n not in seen]
    assert A.IN_DOUBT in seen and A.UNKNOWN in seen


def test_completed_is_never_undone() -> None:
    assert not any(action_may_move(A.COMPLETED, n) for n in A)


@pytest.mark.parametrize("grace", [0, -1, math.nan, math.inf, "5", None, True, 301])
def test_bad_grace_is_refused(grace: object) -> None:
    with pytest.raises(tether.UserError):
        check_grace(grace, tether.Policy())


def test_grace_at_the_maximum_is_accepted() -> None:
    assert check_grace(300, tether.Policy()) == 300.0


def test_bad_policy_is_refused() -> None:
    with pytest.raises(tether.UserError):
        tether.Policy(max_grace=math.nan)
    with pytest.raises(tether.UserError):
        tether.Policy(lease=0)
