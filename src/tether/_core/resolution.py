"""A person's decision on an action nobody could settle: the signed document, when one may be
recorded, and what a later fact that contradicts it means. Pure, like the rest of the core.

A probe that cannot tell leaves an action UNKNOWN and its delegation NEEDS_ATTENTION (I3).
The person who finds out (a call to the provider, a bank statement) records what happened,
signed with their key, with their name, a note and the time. The journal keeps the decision
beside the facts: a receipt that arrives later and says otherwise is recorded, flagged, and
puts the delegation back in front of a person; it never silently replaces the decision, nor
the decision the fact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tether._core.documents import Document, _float, _split, _str, parse_body
from tether._core.errors import Malformed
from tether._core.model import ActionState, action_may_move
from tether._core.outcome import final_at, may_still_apply

_A = ActionState
# What a person may decide: the call applied, or it did not (and never will).
DECISIONS = frozenset({_A.COMPLETED, _A.NOT_APPLIED})


@dataclass(frozen=True)
class Resolution(Document):
    """``operator`` decided that ``action`` of ``delegation`` ended ``outcome``, because
    ``note``. Signed by the operator's key (its id is the signature's)."""

    TYPE: ClassVar[str] = "resolution"
    KNOWN: ClassVar[tuple[str, ...]] = (
        "action", "delegation", "outcome", "note", "operator", "issued_at",
    )

    action_id: str
    delegation_id: str
    outcome: ActionState
    note: str
    operator: str
    issued_at: float

    def _fields(self) -> dict[str, Any]:
        return {
            "action": self.action_id,
            "delegation": self.delegation_id,
            "outcome": self.outcome.value,
            "note": self.note,
            "operator": self.operator,
            "issued_at": self.issued_at,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Resolution:
        version, extra = _split(body, cls)
        try:
            outcome = ActionState(_str(body, "outcome"))
        except ValueError:
            raise Malformed(f"unknown outcome {body.get('outcome')!r}") from None
        if outcome not in DECISIONS:
            raise Malformed(f"a resolution decides COMPLETED or NOT_APPLIED, not {outcome}")
        return cls(
            action_id=_str(body, "action"), delegation_id=_str(body, "delegation"),
            outcome=outcome, note=_str(body, "note"), operator=_str(body, "operator"),
            issued_at=_float(body, "issued_at") or 0.0, version=version, extra=extra,
        )


def decode_resolution(body: bytes) -> Resolution:
    return Resolution.from_json(parse_body(body))


def judge_resolution(state: ActionState, decided: ActionState, *, deadline_at: float,
                     now: float, tolerance: float, contradicted: bool = False) -> str | None:
    """None when a person may record ``decided`` for an action in ``state``; otherwise why not.

    Only an outcome nobody established (IN_DOUBT or UNKNOWN) is a person's to decide, and a
    call still in flight is its executor's. "Not applied" is final only once the call can no
    longer apply (its dispatch deadline), for a person as for a probe: before it, the request
    may still land. After a later fact contradicted an earlier decision (``contradicted``),
    the person decides again: to agree with the fact, or to move it where facts may move."""
    if decided not in DECISIONS:
        return f"a person decides COMPLETED or NOT_APPLIED, not {decided.value}"
    if state is _A.PENDING:
        return ("the call is still in flight: its executor will report it; stop its "
                "delegation first (tether terminate) to have it probed")
    if decided is _A.NOT_APPLIED and state in (_A.IN_DOUBT, _A.UNKNOWN) and may_still_apply(
            deadline_at=deadline_at, now=now, tolerance=tolerance):
        return (f"the call may still apply for {final_at(deadline_at, tolerance) - now:.3g} s "
                "(its dispatch deadline and the clock tolerance): decide NOT_APPLIED after "
                "that, or COMPLETED now")
    if state in (_A.IN_DOUBT, _A.UNKNOWN):
        return None
    if contradicted and (state is decided or action_may_move(state, decided)):
        return None
    if contradicted:
        return (f"the journal holds a {state.value} receipt for it, which a decision cannot "
                f"undo; decide {state.value} to acknowledge it")
    return f"it is already settled ({state.value}): there is nothing to decide"


def contradicts(decided: ActionState, fact: ActionState) -> bool:
    """Whether an outcome recorded after a person's decision says otherwise. A failure agrees
    with "not applied"; "not yet" and "unknown" say nothing."""
    if decided is _A.COMPLETED:
        return fact in (_A.FAILED, _A.NOT_APPLIED)
    if decided is _A.NOT_APPLIED:
        return fact is _A.COMPLETED
    return False


__all__ = ["DECISIONS", "Resolution", "contradicts", "decode_resolution", "judge_resolution"]
