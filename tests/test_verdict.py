"""evaluate_recall: the seed's decision boundary without the seed's five defects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tether
from tether._core.verdict import RecallInput
from tether.protocol import (
    Acknowledgement,
    ControlIntent,
    ControlKind,
    JournalFacts,
    NoEffectsReceipt,
    RecallDecision,
    Signed,
    SigningKey,
    TrustedKeys,
    Verdict,
    evaluate_recall,
)

KEY = SigningKey.generate()
TRUSTED = TrustedKeys([KEY.public])
POLICY = tether.Policy(max_grace=60.0, ack_timeout=5.0)


def signed_intent(grace: float = 10.0, seq: int = 1, kind: ControlKind =
                  ControlKind.RECALL, key: SigningKey = KEY) -> Signed:
    return key.sign(ControlIntent(kind, "d", 0, seq, grace, "r", 0.0))


def ack(in_flight: tuple[str, ...] = (), seq: int = 1,
        key: SigningKey = KEY) -> Signed:
    return key.sign(Acknowledgement("d", seq, in_flight, acked_at=0.0))


def receipt(key: SigningKey = KEY, seq: int = 1) -> Signed:
    return key.sign(NoEffectsReceipt("d", seq, 0.0))


def facts(pending: tuple[str, ...] = (), in_doubt: tuple[str, ...] = (), effects: int = 0,
          seq: int = 1) -> JournalFacts:
    return JournalFacts("d", seq, frozenset(pending), frozenset(in_doubt), effects)


def decide(intent: Signed | None = None, f: JournalFacts | None = None,
           now: float = 0.0, a: Signed | None = None,
           r: Signed | None = None) -> RecallDecision:
    return evaluate_recall(RecallInput(
        intent or signed_intent(), f or facts(), 0.0, now, POLICY, TRUSTED, a, r))


# -- the five defects of the seed's reference ------------------------------------------------

def test_defect1_unverified_receipt_string_is_not_trusted() -> None:
    forged = receipt(key=SigningKey.generate())
    d = decide(a=ack(), r=forged)
    assert d.verdict is Verdict.RECALLED_CLEAN
    assert "receipt refused" in d.reason


def test_defect2_grace_above_maximum_is_refused_even_with_actions_in_flight() -> None:
    d = decide(signed_intent(grace=61.0), facts(pending=("a1",)), a=ack(("a1",)))
    assert d.verdict is Verdict.REJECTED


def test_defect3_no_side_effects_needs_the_journal_to_agree() -> None:
    d = decide(f=facts(effects=1), a=ack(), r=receipt())
    assert d.verdict is Verdict.RECALLED_CLEAN
    assert "contradicts the journal" in d.reason
    assert decide(f=facts(effects=0), a=ack(), r=receipt()).verdict is Verdict.NO_SIDE_EFFECTS


def test_defect4_manifest_digest_hashes_the_action_ids_not_their_count() -> None:
    one = decide(f=facts(pending=("a1",)), a=ack(("a1",)))
    two = decide(f=facts(pending=("a2",)), a=ack(("a2",)))
    assert one.manifest_digest and two.manifest_digest
    assert one.manifest_digest != two.manifest_digest


def test_defect5_no_acknowledgement_has_its_own_verdict_then_escalates() -> None:
    waiting = decide(f=facts(pending=("a1",)), now=1.0)
    assert waiting.verdict is Verdict.AWAIT_ACK
    assert waiting.wait == pytest.approx(4.0)
    assert decide(f=facts(pending=("a1",)), now=5.0).verdict is Verdict.ESCALATE_NO_ACK


# -- the rest of the table -------------------------------------------------------------------

def test_in_flight_with_grace_left_waits_for_exactly_the_time_left() -> None:
    d = decide(f=facts(pending=("a1",)), now=3.0, a=ack(("a1",)))
    assert d.verdict is Verdict.WAIT_IN_FLIGHT
    assert d.wait == pytest.approx(7.0)
    assert d.in_flight == ("a1",)


def test_grace_expired_with_actions_in_flight() -> None:
    d = decide(f=facts(pending=("a1",)), now=10.0, a=ack(("a1",)))
    assert d.verdict is Verdict.GRACE_EXPIRED and d.verdict.must_terminate


def test_the_journal_not_the_manifest_says_what_is_in_flight() -> None:
    d = decide(f=facts(pending=("a1", "a2")), now=1.0, a=ack(("a1",)))
    assert d.verdict is Verdict.WAIT_IN_FLIGHT
    assert "1 not in the child's manifest" in d.reason
    assert d.in_flight == ("a1", "a2")


def test_in_doubt_needs_reconciliation() -> None:
    assert decide(f=facts(in_doubt=("a1",)), a=ack()).verdict is Verdict.RECONCILE


def test_terminate_intent() -> None:
    d = decide(signed_intent(kind=ControlKind.TERMINATE))
    assert d.verdict is Verdict.TERMINATE


@pytest.mark.parametrize(("intent", "f", "a"), [
    (signed_intent(key=SigningKey.generate()), facts(), ack()),  # unknown key
    (signed_intent(seq=1), facts(seq=2), ack()),  # stale sequence
    (signed_intent(), facts(), ack(seq=2)),  # ack answers another intent
    (signed_intent(), facts(), ack(key=SigningKey.generate())),  # forged ack
    (Signed(signed_intent().body, KEY.key_id, b"x" * 64), facts(), ack()),  # bad sig
])
def test_rejections(intent: Signed, f: JournalFacts, a: Signed) -> None:
    assert decide(intent, f, a=a).verdict is Verdict.REJECTED


# -- properties over the whole table ---------------------------------------------------------

ids = st.lists(st.sampled_from(["a1", "a2", "a3", "a4"]), unique=True, max_size=4).map(tuple)


@given(pending=ids, in_doubt=ids, effects=st.integers(0, 3), now=st.floats(0, 30),
       grace=st.floats(0.01, 80), has_ack=st.booleans(), declared=ids,
       receipt_kind=st.sampled_from(["none", "valid", "forged"]))
def test_verdict_properties(pending: tuple[str, ...], in_doubt: tuple[str, ...], effects: int,
                            now: float, grace: float, has_ack: bool, declared: tuple[str, ...],
                            receipt_kind: str) -> None:
    r = {"none": None, "valid": receipt(),
         "forged": receipt(key=SigningKey.generate())}[receipt_kind]
    d = decide(signed_intent(grace=grace), facts(pending, in_doubt, effects), now,
               ack(declared) if has_ack else None, r)
    grace_left = grace - now
    if grace > POLICY.max_grace:
        assert d.verdict is Verdict.REJECTED
        return
    # Never "no side effects" while the journal shows one, nor on a receipt that fails.
    if effects or receipt_kind != "valid":
        assert d.verdict is not Verdict.NO_SIDE_EFFECTS
    # Never proceed while anything is in flight.
    if pending:
        assert not d.verdict.settled
        assert d.verdict is not Verdict.RECONCILE
    # Never wait past the grace window.
    if d.verdict in (Verdict.WAIT_IN_FLIGHT, Verdict.AWAIT_ACK):
        assert 0 < d.wait <= grace_left + 1e-9
    if pending and has_ack and grace_left <= 0:
        assert d.verdict is Verdict.GRACE_EXPIRED
    if not pending and in_doubt and has_ack:
        assert d.verdict is Verdict.RECONCILE
