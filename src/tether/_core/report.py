"""Honest outcome reports (I8): what completed, what did not, what is unknown."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tether._core.model import ActionState, DelegationState, Effect


@dataclass(frozen=True)
class ActionRecord:
    """One journaled action as the journal holds it."""

    id: str
    delegation_id: str
    ordinal: int
    tool: str
    effect: Effect
    args: dict[str, Any]
    idempotency_key: str
    state: ActionState
    result: Any = None
    error: str | None = None
    evidence: dict[str, Any] | None = None
    late: bool = False  # the outcome arrived after the action had been declared IN_DOUBT
    started_at: float = 0.0
    ended_at: float | None = None
    deadline_at: float | None = None  # after this wall time the call can no longer apply

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "delegation": self.delegation_id,
            "ordinal": self.ordinal,
            "tool": self.tool,
            "effect": self.effect.value,
            "args": self.args,
            "idempotency_key": self.idempotency_key,
            "state": self.state.value,
            "result": self.result,
            "error": self.error,
            "evidence": self.evidence,
            "late": self.late,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "deadline_at": self.deadline_at,
        }


@dataclass(frozen=True)
class Report:
    """What became of a delegation and its subtree. ``outcome`` is never a bare "cancelled":
    the action lists say exactly what happened to each side effect."""

    delegation_id: str
    task_id: str
    epoch: int
    attempt: int
    agent: str
    outcome: DelegationState
    verdict: str | None
    reason: str
    actions: tuple[ActionRecord, ...]
    children: tuple[Report, ...] = ()
    result: Any = None
    error: str | None = None

    def _mine(self, *states: ActionState) -> tuple[ActionRecord, ...]:
        return tuple(a for a in self.actions if a.state in states)

    @property
    def completed(self) -> tuple[ActionRecord, ...]:
        return self._mine(ActionState.COMPLETED)

    @property
    def not_applied(self) -> tuple[ActionRecord, ...]:
        return self._mine(ActionState.NOT_APPLIED, ActionState.FAILED)

    @property
    def unknown(self) -> tuple[ActionRecord, ...]:
        """Outcomes nobody could establish; a person must look (never guessed)."""
        return self._mine(ActionState.UNKNOWN, ActionState.IN_DOUBT, ActionState.PENDING)

    @property
    def late(self) -> tuple[ActionRecord, ...]:
        return tuple(a for a in self.actions if a.late)

    def walk(self) -> Iterator[Report]:
        yield self
        for child in self.children:
            yield from child.walk()

    def all_actions(self) -> tuple[ActionRecord, ...]:
        return tuple(a for r in self.walk() for a in r.actions)

    @property
    def needs_attention(self) -> bool:
        return any(r.unknown for r in self.walk())

    def to_json(self) -> dict[str, Any]:
        return {
            "delegation": self.delegation_id,
            "task": self.task_id,
            "epoch": self.epoch,
            "attempt": self.attempt,
            "agent": self.agent,
            "outcome": self.outcome.value,
            "verdict": self.verdict,
            "reason": self.reason,
            "completed": [a.id for a in self.completed],
            "not_applied": [a.id for a in self.not_applied],
            "unknown": [a.id for a in self.unknown],
            "late": [a.id for a in self.late],
            "actions": [a.to_json() for a in self.actions],
            "children": [c.to_json() for c in self.children],
            "result": self.result,
            "error": self.error,
        }
