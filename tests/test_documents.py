"""I5: signed, canonical, versioned control documents."""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tether
from tether._core.documents import ChainSeal, canonical, decode, manifest_digest, parse_body
from tether.errors import BadSignature, Malformed, UnknownKey
from tether.protocol import (
    Acknowledgement,
    ControlIntent,
    ControlKind,
    Signed,
    SigningKey,
    TrustedKeys,
)

KEY = SigningKey.generate()
TRUSTED = TrustedKeys([KEY.public])


def intent(**over: object) -> ControlIntent:
    fields: dict[str, object] = dict(kind=ControlKind.RECALL, delegation_id="d_1", epoch=0,
                                     seq=1, grace=5.0, reason="r", issued_at=1.5)
    fields.update(over)
    return ControlIntent(**fields)  # type: ignore[arg-type]


def test_round_trip_and_signature_verify() -> None:
    signed = KEY.sign(intent())
    assert TRUSTED.verify(signed, ControlIntent) == intent()


def test_unknown_fields_survive_a_round_trip_and_keep_the_signature_valid() -> None:
    # A newer writer adds a field and bumps the version; an older reader keeps both.
    body = intent().to_json() | {"v": 2, "priority": "high", "trace": {"id": "x"}}
    newer = KEY.sign(ControlIntent.from_json(body))
    read = TRUSTED.verify(newer, ControlIntent)
    assert read.version == 2
    assert read.extra == {"priority": "high", "trace": {"id": "x"}}
    assert read.encode() == canonical(body)


def test_altered_field_is_refused() -> None:
    signed = KEY.sign(intent())
    forged = json.loads(signed.body)
    forged["grace"] = 500.0
    altered = Signed(canonical(forged), signed.key_id, signed.signature)
    with pytest.raises(BadSignature):
        TRUSTED.verify(altered, ControlIntent)


def test_unknown_key_and_unsigned_are_refused() -> None:
    stranger = SigningKey.generate()
    with pytest.raises(UnknownKey):
        TRUSTED.verify(stranger.sign(intent()), ControlIntent)
    unsigned = Signed(intent().encode(), KEY.key_id, b"")
    with pytest.raises(BadSignature):
        TRUSTED.verify(unsigned, ControlIntent)


def test_document_of_another_type_is_refused() -> None:
    ack = Acknowledgement("d_1", 1, ("a",), acked_at=0.0)
    with pytest.raises(Malformed):
        TRUSTED.verify(KEY.sign(ack), ControlIntent)


@pytest.mark.parametrize("bad", [
    b"not json", b"[1,2]", b'{"type":"control"}', b'{"a":1, "b":2}',
    b'{"type":"control","v":1}', b'{"type":"nope","v":1}',
    canonical(intent().to_json() | {"seq": 0}), canonical(intent().to_json() | {"seq": True}),
    canonical(intent().to_json() | {"kind": "PAUSE"}),
    canonical(intent().to_json() | {"grace": None}),
    canonical(intent().to_json() | {"v": 0}),
])
def test_malformed_documents_are_refused(bad: bytes) -> None:
    with pytest.raises(Malformed):
        decode(bad)


def test_non_canonical_bytes_are_refused() -> None:
    with pytest.raises(Malformed):
        parse_body(json.dumps(intent().to_json(), indent=1).encode())


def test_nan_cannot_be_encoded() -> None:
    with pytest.raises(tether.errors.UserError):
        canonical({"grace": math.nan})


def test_ack_digest_binds_delegation_sequence_and_action_ids() -> None:
    base = manifest_digest("d", 1, ["a", "b"])
    assert base == manifest_digest("d", 1, ["b", "a"])
    assert base != manifest_digest("d", 1, ["a", "c"])  # same count, other ids
    assert base != manifest_digest("d", 2, ["a", "b"])
    assert base != manifest_digest("e", 1, ["a", "b"])
    ack = Acknowledgement("d", 1, ("b", "a"), acked_at=0.0)
    body = ack.to_json() | {"in_flight": ["a", "c"]}  # a manifest swapped under its digest
    with pytest.raises(Malformed):
        decode(canonical(body))


@given(st.binary(max_size=300))
def test_decoder_never_crashes_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(Malformed):
        decode(data)


@given(st.integers(0, 2**40), st.integers(1, 2**40), st.floats(0.001, 1e6),
       st.text(max_size=40), st.dictionaries(st.text(min_size=1, max_size=8).filter(
           lambda k: k not in ControlIntent.KNOWN and k not in ("type", "v")),
           st.integers(-(2**53) + 1, 2**53 - 1), max_size=3))
def test_any_intent_round_trips(epoch: int, seq: int, grace: float, reason: str,
                                extra: dict[str, int]) -> None:
    doc = ControlIntent(ControlKind.RECALL, "d", epoch, seq, grace, reason, 0.0,
                               extra=extra)
    again = TRUSTED.verify(KEY.sign(doc), ControlIntent)
    assert again == doc and again.extra == extra


def test_trusted_keys_from_files_check_ids() -> None:
    good = TrustedKeys.from_b64({KEY.key_id: KEY.public_b64()})
    assert KEY.key_id in good
    with pytest.raises(Malformed):
        TrustedKeys.from_b64({"0" * 16: KEY.public_b64()})
    with pytest.raises(Malformed):
        TrustedKeys.from_b64({KEY.key_id: "not base64!"})


def test_an_intent_names_the_person_who_issued_it_only_when_one_did() -> None:
    # Without a name the encoding is the one signed before the field existed, byte for byte.
    assert "by" not in intent().to_json()
    assert intent().encode() == canonical({
        "type": "control", "v": 1, "kind": "RECALL", "delegation": "d_1", "epoch": 0,
        "seq": 1, "grace": 5.0, "reason": "r", "issued_at": 1.5})
    named = KEY.sign(intent(issued_by="alice"))
    assert TRUSTED.verify(named, ControlIntent).issued_by == "alice"
    # The name is signed: another one in the same bytes' place is a different document.
    forged = Signed(named.body.replace(b'"alice"', b'"mallo"'), named.key_id,
                           named.signature)
    with pytest.raises(BadSignature):
        TRUSTED.verify(forged, ControlIntent)


@pytest.mark.parametrize("by", ["", 7, None, ["alice"]])
def test_an_intent_whose_name_is_not_a_name_is_refused(by: object) -> None:
    with pytest.raises(Malformed):
        ControlIntent.from_json(intent().to_json() | {"by": by})


def test_a_recovery_is_marked_in_the_signed_intent_only_when_it_is_one() -> None:
    # Unmarked, the encoding is the one signed before the field existed.
    assert "recovery" not in intent(kind=ControlKind.TERMINATE, grace=None).to_json()
    marked = KEY.sign(intent(kind=ControlKind.TERMINATE, grace=None, recovery=True))
    assert TRUSTED.verify(marked, ControlIntent).recovery is True
    # The mark is signed: a stop cannot be passed off as a recovery by editing its bytes.
    plain = KEY.sign(intent(kind=ControlKind.TERMINATE, grace=None))
    forged = Signed(plain.body.replace(b'"reason"', b'"recovery":true,"reason"'),
                    plain.key_id, plain.signature)
    with pytest.raises(BadSignature):
        TRUSTED.verify(forged, ControlIntent)


@pytest.mark.parametrize("body", [{"recovery": False}, {"recovery": 1}, {"recovery": "yes"},
                                  {"recovery": True, "kind": "RECALL"}])
def test_a_recovery_mark_that_is_not_true_on_a_terminate_is_refused(
        body: dict[str, object]) -> None:
    with pytest.raises(Malformed):
        ControlIntent.from_json(intent(kind=ControlKind.TERMINATE, grace=None).to_json() | body)


@settings(max_examples=3000)
@given(root=st.one_of(st.text(alphabet="0123456789abcdef", max_size=64), st.text(max_size=8)),
       heads=st.integers(min_value=1, max_value=2**70),
       sealed_at=st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                           st.floats(min_value=1e-5, max_value=1e17),
                           st.integers(min_value=-2**60, max_value=2**60).map(float),
                           st.sampled_from([0.0, -0.0, 1e-4, 9.999e-5, 1e16, 2.0**53,
                                            2.0**53 + 2, 1e21, 1e-7, 1800000000.123456])),
       extra=st.one_of(st.dictionaries(st.sampled_from(["later", "z"]), st.integers(),
                                       max_size=1), st.none()),
       version=st.one_of(st.just(1), st.integers(min_value=-2, max_value=2**60), st.booleans(),
                         st.floats(allow_nan=False), st.text(max_size=2)),
       odd_root=st.one_of(st.none(), st.binary(max_size=4), st.integers()))
def test_a_chain_seal_encodes_as_rfc_8785_whatever_its_values(
        root: str, heads: int, sealed_at: float, extra: dict[str, int] | None, version: Any,
        odd_root: Any) -> None:
    """The seal, written once per commit, has its own writer: byte for byte the library's,
    or the library's own refusal, for any field of any type."""
    seal = ChainSeal(root if odd_root is None else odd_root, heads, sealed_at,
                     extra=extra, version=version)  # type: ignore[arg-type]
    try:
        expected: bytes | str = canonical(seal.to_json())
    except (tether.errors.UserError, TypeError) as exc:  # beyond what JSON carries: refused alike
        expected = f"{type(exc).__name__}: {exc}"
    try:
        got: bytes | str = seal.encode()
    except (tether.errors.UserError, TypeError) as exc:
        got = f"{type(exc).__name__}: {exc}"
    assert got == expected


_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.text(max_size=6),
              st.text(alphabet=st.characters(max_codepoint=127), max_size=6),
              st.integers(min_value=-2**54, max_value=2**54),
              st.sampled_from([2**53 - 1, 2**53, -(2**53) + 1, -(2**53), 0, -1]),
              st.floats(), st.floats(min_value=1e-5, max_value=1e17),
              st.sampled_from([0.0, -0.0, 1e-4, 9.999e-5, 1e16, 2.0**53, 1e21, 1e-7, 0.5])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=4),
                                  st.text(alphabet=st.characters(max_codepoint=127),
                                          max_size=4)),
                        inner, max_size=4),
        st.dictionaries(st.one_of(st.integers(), st.text(max_size=2)), inner, max_size=2)),
    max_leaves=12)


def _outcome(encode: Any, value: Any) -> bytes | str:
    try:
        return bytes(encode(value))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@settings(max_examples=4000)
@given(value=_JSON)
def test_canonical_bytes_are_the_librarys_for_any_value(value: Any) -> None:
    """Every document is written by ``canonical``, which spells plain values itself: byte for
    byte what RFC 8785's library writes, or the library's own refusal."""
    import rfc8785

    def library(v: Any) -> bytes:
        try:
            return bytes(rfc8785.dumps(v))
        except (rfc8785.CanonicalizationError, RecursionError) as exc:
            raise tether.errors.UserError(f"value cannot be serialized as canonical JSON: {exc}"
                                   ) from None

    assert _outcome(canonical, value) == _outcome(library, value)


def test_a_document_signed_here_is_taken_without_the_curve_only_as_it_was_signed() -> None:
    """This process skips re-verifying what it signed itself: only the very bytes, signature
    and key it signed, and only where that key is trusted; anything else is checked in full."""
    signed = KEY.sign(intent())
    fresh = TrustedKeys([KEY.public])  # no memory of verified documents yet
    assert fresh.signed_here(signed)
    assert fresh.verify(signed, ControlIntent) == intent()
    flipped = bytes([signed.signature[0] ^ 1]) + signed.signature[1:]
    for forged in (Signed(signed.body, signed.key_id, flipped),
                   Signed(signed.body.replace(b'"reason":"', b'"reason":"x'), signed.key_id,
                          signed.signature)):
        assert not fresh.signed_here(forged)
        with pytest.raises(BadSignature):
            TrustedKeys([KEY.public]).verify(forged, ControlIntent)
    with pytest.raises(UnknownKey):
        TrustedKeys([SigningKey.generate().public]).verify(signed, ControlIntent)
    with pytest.raises(UnknownKey):
        TrustedKeys([SigningKey.generate().public]).verify_bytes(signed)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _cyclic() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


@pytest.mark.parametrize("make", [lambda: _nested(5000), _cyclic, lambda: {"a": _cyclic()}],
                         ids=["deep", "cycle", "cycle-in-dict"])
def test_what_json_cannot_carry_is_a_user_error_not_a_recursion_error(make: Any) -> None:
    with pytest.raises(tether.errors.UserError):
        canonical(make())
