"""Ed25519 signatures over canonical document bytes (I5)."""

from __future__ import annotations

import base64
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from tether._core.documents import (
    Acknowledgement,
    ChainSeal,
    ControlIntent,
    Document,
    KeyGrant,
    NoEffectsReceipt,
    WorkOrder,
    decode,
)
from tether._core.errors import BadSignature, Malformed, UnknownKey
from tether._core.headmark import HeadMemory
from tether._core.registrymark import RegistryMemory

D = TypeVar("D", ControlIntent, Acknowledgement, NoEffectsReceipt, KeyGrant, WorkOrder,
            ChainSeal)


_P = 2**255 - 19  # the field's prime
_L = 2**252 + 27742317777372353535851937790883648493  # the prime order of the base point
# The canonical encodings of the eight points of small order (the identity among them; the
# torsion subgroup of Curve25519 in Edwards form). Under such a public key a signature made
# without any private key verifies for a good share of messages; libsodium refuses the same.
_SMALL_ORDER = frozenset(bytes.fromhex(h) for h in (
    "0100000000000000000000000000000000000000000000000000000000000000",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0000000000000000000000000000000000000000000000000000000000000080",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
))


def _point_problem(raw: bytes) -> str | None:
    """Why a 32-byte point encoding is not one a strict verifier accepts, or None."""
    if len(raw) != 32:
        return "not 32 bytes"
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    if y >= _P:
        return "a non-canonical encoding"
    if y in (1, _P - 1) and raw[31] & 0x80:  # x = 0 has no negative: -0 is non-canonical
        return "a non-canonical encoding"
    if raw in _SMALL_ORDER:
        return "a point of small order (a weak key that needs no private key to sign)"
    return None


def public_key(raw: bytes) -> Ed25519PublicKey:
    """The public key ``raw`` encodes; ValueError for anything but a canonical encoding of a
    point outside the small-order subgroup. Every key tether trusts enters through here."""
    problem = _point_problem(raw)
    if problem is not None:
        raise ValueError(f"not an acceptable Ed25519 public key: {problem}")
    return Ed25519PublicKey.from_public_bytes(raw)


def _strict(signature: bytes) -> bool:
    """RFC 8032's checks beyond the equation: S reduced below the group order, R a canonical
    encoding of a point that is not of small order (malleable or degenerate signatures)."""
    return len(signature) == 64 and int.from_bytes(signature[32:], "little") < _L and \
        _point_problem(signature[:32]) is None


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id_of(key: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw_public(key)).hexdigest()[:16]


@dataclass(frozen=True)
class Signed:
    """Canonical document bytes with who signed them. ``body`` is exactly what was signed."""

    body: bytes
    key_id: str
    signature: bytes


# What this process signed, with the raw public key that signed it. Such a signature verifies
# by construction (the bytes are this process's own canonical encoding, signed here), so a
# trusted set holding that very key accepts it without the curve arithmetic and the canonical
# re-encoding: an in-process recall signs its intent and acknowledgement, then verifies both.
# Process memory only: nothing read from a journal or a peer can enter it.
_SIGNED_HERE: dict[Signed, bytes] = {}
_SIGNED_MAX = 8192


class SigningKey:
    def __init__(self, private: Ed25519PrivateKey, label: str = "") -> None:
        self._private = private
        self.public = private.public_key()
        self._public_raw = _raw_public(self.public)
        self.key_id = key_id_of(self.public)
        self.label = label

    @classmethod
    def generate(cls, label: str = "") -> SigningKey:
        return cls(Ed25519PrivateKey.generate(), label)

    @classmethod
    def from_raw(cls, raw: bytes, label: str = "") -> SigningKey:
        return cls(Ed25519PrivateKey.from_private_bytes(raw), label)

    def raw(self) -> bytes:
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def public_b64(self) -> str:
        return base64.b64encode(_raw_public(self.public)).decode("ascii")

    def sign(self, doc: Document) -> Signed:
        body = doc.encode()
        signed = Signed(body=body, key_id=self.key_id, signature=self._private.sign(body))
        if len(_SIGNED_HERE) >= _SIGNED_MAX:
            _SIGNED_HERE.clear()  # forgotten: verified the long way, never wrongly
        _SIGNED_HERE[signed] = self._public_raw
        return signed


class TrustedKeys:
    """The public keys whose intents and acknowledgements a journal accepts."""

    _MEMO = 8192  # verified documents remembered; a recall re-checks the same ones often

    def __init__(self, keys: Iterable[Ed25519PublicKey] = (),
                 memory: RegistryMemory | None = None) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._raw: dict[str, bytes] = {}
        for key in keys:  # however a key was made, a weak one is never trusted
            raw = _raw_public(key)
            public_key(raw)
            self._keys[key_id_of(key)] = key
            self._raw[key_id_of(key)] = raw
        # What this configuration has seen of journals' key registries (``registrymark``):
        # pins carry it to every reading of a registry they root.
        self.memory = memory
        # And of delegations' chain heads (``headmark``): to every judgement of a chain.
        self.heads: HeadMemory | None = None
        # Signed -> decoded document. The key set is fixed at construction, so a document that
        # verified once verifies again: remembering it changes no answer.
        self._verified: OrderedDict[Signed, Document] = OrderedDict()

    @classmethod
    def from_b64(cls, encoded: Mapping[str, str]) -> TrustedKeys:
        """Build from ``{key_id: base64 raw public key}``; a mismatched id is refused."""
        keys = []
        for kid, b64 in encoded.items():
            try:
                key = public_key(base64.b64decode(b64, validate=True))
            except ValueError as exc:
                raise Malformed(f"trusted key {kid} is not a base64 Ed25519 public key "
                                f"({exc})") from None
            if key_id_of(key) != kid:
                raise Malformed(f"trusted key id {kid} does not match its public key")
            keys.append(key)
        return cls(keys)

    def plus(self, *keys: Ed25519PublicKey) -> TrustedKeys:
        """These keys and ``keys``."""
        return TrustedKeys([*self._keys.values(), *keys])

    def public_b64(self, key_id: str) -> str:
        return base64.b64encode(_raw_public(self._keys[key_id])).decode("ascii")

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def ids(self) -> list[str]:
        return sorted(self._keys)

    def signed_here(self, signed: Signed) -> bool:
        """Signed by this process with a key of this set (``_SIGNED_HERE``)."""
        here = _SIGNED_HERE.get(signed)
        return here is not None and here == self._raw.get(signed.key_id)

    def verify_bytes(self, signed: Signed) -> None:
        key = self._keys.get(signed.key_id)
        if key is None:
            raise UnknownKey(f"key {signed.key_id!r} is not trusted by this journal")
        if self.signed_here(signed):
            return
        try:
            if not _strict(signed.signature):
                raise InvalidSignature
            key.verify(signed.signature, signed.body)
        except InvalidSignature:
            raise BadSignature(f"signature by key {signed.key_id} does not verify") from None

    def verify(self, signed: Signed, kind: type[D]) -> D:
        """Check the signature, then decode; a document of another type is Malformed."""
        doc = self._verified.get(signed)
        if doc is None:
            if self.signed_here(signed):
                doc = decode(signed.body, canonical_known=True)
            else:
                self.verify_bytes(signed)
                doc = decode(signed.body)
            self._verified[signed] = doc
            if len(self._verified) > self._MEMO:
                self._verified.popitem(last=False)
        if not isinstance(doc, kind):
            raise Malformed(f"expected a {kind.TYPE!r} document, got {type(doc).TYPE!r}")
        return doc
