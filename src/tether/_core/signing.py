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
from tether._core.registrymark import RegistryMemory

D = TypeVar("D", ControlIntent, Acknowledgement, NoEffectsReceipt, KeyGrant, WorkOrder,
            ChainSeal)


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


class SigningKey:
    def __init__(self, private: Ed25519PrivateKey, label: str = "") -> None:
        self._private = private
        self.public = private.public_key()
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
        return Signed(body=body, key_id=self.key_id, signature=self._private.sign(body))


class TrustedKeys:
    """The public keys whose intents and acknowledgements a journal accepts."""

    _MEMO = 8192  # verified documents remembered; a recall re-checks the same ones often

    def __init__(self, keys: Iterable[Ed25519PublicKey] = (),
                 memory: RegistryMemory | None = None) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {key_id_of(k): k for k in keys}
        # What this configuration has seen of journals' key registries (``registrymark``):
        # pins carry it to every reading of a registry they root.
        self.memory = memory
        # Signed -> decoded document. The key set is fixed at construction, so a document that
        # verified once verifies again: remembering it changes no answer.
        self._verified: OrderedDict[Signed, Document] = OrderedDict()

    @classmethod
    def from_b64(cls, encoded: Mapping[str, str]) -> TrustedKeys:
        """Build from ``{key_id: base64 raw public key}``; a mismatched id is refused."""
        keys = []
        for kid, b64 in encoded.items():
            try:
                key = Ed25519PublicKey.from_public_bytes(base64.b64decode(b64, validate=True))
            except ValueError:
                raise Malformed(f"trusted key {kid} is not a base64 Ed25519 public key") from None
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

    def verify_bytes(self, signed: Signed) -> None:
        key = self._keys.get(signed.key_id)
        if key is None:
            raise UnknownKey(f"key {signed.key_id!r} is not trusted by this journal")
        try:
            key.verify(signed.signature, signed.body)
        except InvalidSignature:
            raise BadSignature(f"signature by key {signed.key_id} does not verify") from None

    def verify(self, signed: Signed, kind: type[D]) -> D:
        """Check the signature, then decode; a document of another type is Malformed."""
        doc = self._verified.get(signed)
        if doc is None:
            self.verify_bytes(signed)
            doc = decode(signed.body)
            self._verified[signed] = doc
            if len(self._verified) > self._MEMO:
                self._verified.popitem(last=False)
        if not isinstance(doc, kind):
            raise Malformed(f"expected a {kind.TYPE!r} document, got {type(doc).TYPE!r}")
        return doc
