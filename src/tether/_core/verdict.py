"""The recall decision boundary of the seed, made correct.

``evaluate_recall`` is pure: it takes the signed intent, the child's signed acknowledgement and
"no side effects" receipt (if any), and the journal's own facts, and returns what to do next.
Unlike the seed's reference it verifies every signature, checks the grace bound whatever is in
flight, never claims "no side effects" without the journal's count, hashes the action ids into
the manifest digest, and has a verdict for "no acknowledgement yet".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt, manifest_digest
from tether._core.errors import ControlRefused
from tether._core.model import ControlKind, Policy
from tether._core.signing import Signed, TrustedKeys


class Verdict(StrEnum):
    REJECTED = "REJECTED"  # bad signature, unknown key, stale sequence, grace above policy
    TERMINATE = "TERMINATE"  # the intent is a TERMINATE: kill now, then reconcile
    AWAIT_ACK = "AWAIT_ACK"  # no acknowledgement yet; wait up to the ack bound
    ESCALATE_NO_ACK = "ESCALATE_NO_ACK"  # no acknowledgement within the bound: terminate
    WAIT_IN_FLIGHT = "WAIT_IN_FLIGHT"  # actions in flight and grace left
    GRACE_EXPIRED = "GRACE_EXPIRED"  # actions still in flight: terminate, reconcile
    RECONCILE = "RECONCILE"  # nothing in flight, but some outcomes are in doubt
    RECALLED_CLEAN = "RECALLED_CLEAN"  # every action has a receipt
    NO_SIDE_EFFECTS = "NO_SIDE_EFFECTS"  # journal shows none in the subtree AND receipt verifies
    # Not answers of ``evaluate_recall``: how a delegation nobody could drain was settled.
    RECOVERED = "RECOVERED"  # its owner died or gave up: recovery terminated and accounted it
    NEVER_STARTED = "NEVER_STARTED"  # stopped while queued, before any worker claimed it

    @property
    def settled(self) -> bool:
        return self in (Verdict.RECALLED_CLEAN, Verdict.NO_SIDE_EFFECTS)

    @property
    def must_terminate(self) -> bool:
        return self in (Verdict.TERMINATE, Verdict.ESCALATE_NO_ACK, Verdict.GRACE_EXPIRED)


@dataclass(frozen=True)
class JournalFacts:
    """What the journal knows about a delegation's subtree at one instant."""

    delegation_id: str
    control_seq: int
    pending: frozenset[str]  # intent durable, no outcome
    in_doubt: frozenset[str]  # IN_DOUBT or UNKNOWN: reconciliation owed
    side_effecting: int  # IDEMPOTENT or EXTERNAL actions ever started in the subtree


@dataclass(frozen=True)
class RecallInput:
    intent: Signed
    facts: JournalFacts
    accepted_at: float  # clock time at which the journal accepted the intent
    now: float
    policy: Policy
    trusted: TrustedKeys
    ack: Signed | None = None
    receipt: Signed | None = None


@dataclass(frozen=True)
class RecallDecision:
    verdict: Verdict
    reason: str
    wait: float = 0.0  # seconds until the decision should be re-evaluated
    in_flight: tuple[str, ...] = ()
    manifest_digest: str | None = None


def evaluate_recall(state: RecallInput) -> RecallDecision:
    facts = state.facts
    try:
        intent = state.trusted.verify(state.intent, ControlIntent)
    except ControlRefused as exc:
        return RecallDecision(Verdict.REJECTED, f"intent: {exc}")
    if intent.delegation_id != facts.delegation_id:
        return RecallDecision(Verdict.REJECTED, "intent names another delegation")
    if intent.seq != facts.control_seq:
        return RecallDecision(
            Verdict.REJECTED,
            f"intent sequence {intent.seq} is not the journal's current {facts.control_seq}",
        )
    if intent.kind is ControlKind.TERMINATE:
        return RecallDecision(Verdict.TERMINATE, "terminate requested")
    grace = intent.grace or 0.0
    if grace > state.policy.max_grace:
        return RecallDecision(
            Verdict.REJECTED, f"grace {grace:g}s above policy maximum {state.policy.max_grace:g}s"
        )

    elapsed = max(0.0, state.now - state.accepted_at)
    grace_left = grace - elapsed
    pending = tuple(sorted(facts.pending))

    if state.ack is None:
        ack_left = state.policy.ack_timeout - elapsed
        if ack_left > 0 and grace_left > 0:
            return RecallDecision(
                Verdict.AWAIT_ACK, "no acknowledgement yet", min(ack_left, grace_left), pending
            )
        return RecallDecision(Verdict.ESCALATE_NO_ACK, "child did not acknowledge", 0.0, pending)
    try:
        ack = state.trusted.verify(state.ack, Acknowledgement)
    except ControlRefused as exc:
        return RecallDecision(Verdict.REJECTED, f"acknowledgement: {exc}")
    if ack.delegation_id != intent.delegation_id or ack.seq != intent.seq:
        return RecallDecision(Verdict.REJECTED, "acknowledgement answers another intent")
    digest = manifest_digest(ack.delegation_id, ack.seq, ack.in_flight)

    # The journal, not the child's manifest, says what is still in flight: an action the child
    # forgot to declare is still waited for and, if need be, probed.
    if pending:
        undeclared = sorted(set(pending) - set(ack.in_flight))
        note = f"; {len(undeclared)} not in the child's manifest" if undeclared else ""
        if grace_left > 0:
            return RecallDecision(
                Verdict.WAIT_IN_FLIGHT,
                f"{len(pending)} action(s) in flight{note}",
                grace_left,
                pending,
                digest,
            )
        return RecallDecision(
            Verdict.GRACE_EXPIRED, f"{len(pending)} action(s) still in flight{note}", 0.0,
            pending, digest,
        )
    if facts.in_doubt:
        return RecallDecision(
            Verdict.RECONCILE, f"{len(facts.in_doubt)} action(s) in doubt", 0.0, (), digest
        )
    if facts.side_effecting == 0 and state.receipt is not None:
        try:
            receipt = state.trusted.verify(state.receipt, NoEffectsReceipt)
        except ControlRefused as exc:
            return RecallDecision(
                Verdict.RECALLED_CLEAN, f"receipt refused ({exc})", 0.0, (), digest
            )
        if receipt.delegation_id == intent.delegation_id and receipt.seq == intent.seq:
            return RecallDecision(
                Verdict.NO_SIDE_EFFECTS, "journal and signed receipt agree", 0.0, (), digest
            )
    reason = "every action has its receipt"
    if facts.side_effecting and state.receipt is not None:
        reason += "; the child's no-side-effects receipt contradicts the journal"
    return RecallDecision(Verdict.RECALLED_CLEAN, reason, 0.0, (), digest)
