"""Retention: which delegations may leave the journal. Pure.

A delegation tree may be pruned only when nothing in it can change any more and nothing in it
needs a person: every node settled (and none NEEDS_ATTENTION, nor INTERRUPTED, which waits for
a person's answer and is resumed from its records, unless its task was re-delegated since with
the answer), every action final (COMPLETED,
FAILED or NOT_APPLIED; never PENDING, IN_DOUBT or UNKNOWN), every call past its dispatch
deadline (so no late receipt can still arrive for it), and the whole tree ended before the
cut-off. Anything else stays, however old.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tether._core.model import ActionState, DelegationState
from tether._core.outcome import may_still_apply

FINAL_ACTIONS = frozenset({ActionState.COMPLETED, ActionState.FAILED, ActionState.NOT_APPLIED})
AWAITING_PERSON = frozenset({DelegationState.NEEDS_ATTENTION, DelegationState.INTERRUPTED})


@dataclass(frozen=True)
class NodeFacts:
    state: DelegationState
    ended_at: float | None
    # Its task was re-delegated since (a later epoch): an INTERRUPTED attempt was answered
    # there, and waits for nothing any more.
    superseded: bool = False


@dataclass(frozen=True)
class CallFacts:
    state: ActionState
    deadline_at: float | None


def prunable(nodes: Iterable[NodeFacts], calls: Iterable[CallFacts], *, before: float,
             now: float, tolerance: float) -> bool:
    """Whether a tree (its root and every descendant, with all their actions) may be pruned."""
    for node in nodes:
        answered = node.state is DelegationState.INTERRUPTED and node.superseded
        if not node.state.terminal or (node.state in AWAITING_PERSON and not answered):
            return False
        if node.ended_at is None or node.ended_at >= before:
            return False
    for call in calls:
        if call.state not in FINAL_ACTIONS:
            return False
        if call.deadline_at is None or may_still_apply(deadline_at=call.deadline_at, now=now,
                                                        tolerance=tolerance):
            return False
    return True


__all__ = ["FINAL_ACTIONS", "CallFacts", "NodeFacts", "prunable"]
