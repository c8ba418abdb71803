"""Control intents, acknowledgements and receipts, with a versioned canonical encoding.

Every document encodes to RFC 8785 canonical JSON: ``{"type": ..., "v": ..., <fields>}``.
Fields a reader does not know are kept in ``extra`` and written back unchanged, so a newer
writer's additions survive a round trip through an older reader and its signature still holds.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring as _quote  # C; for ASCII, RFC 8785's escapes
from typing import Any, ClassVar

import rfc8785

from tether._core.errors import Malformed, UserError
from tether._core.model import ControlKind

VERSION = 1


def canonical(value: object) -> bytes:
    """RFC 8785 bytes of a JSON value; UserError for anything JSON cannot carry."""
    parts: list[str] = []
    try:
        if _plain(value, parts):
            return "".join(parts).encode("ascii")
        return bytes(rfc8785.dumps(value))  # type: ignore[arg-type]
    except (rfc8785.CanonicalizationError, RecursionError) as exc:
        raise UserError(f"value cannot be serialized as canonical JSON: {exc}") from None


_SAFE = 2 ** 53  # RFC 8785's integers: below this in size, written as Python writes them


def _plain(value: object, out: list[str]) -> bool:
    """Write ``value`` into ``out`` as RFC 8785 does, where its spelling is Python's own (the
    library is pure Python and costs tens of microseconds a document): ASCII text, whose keys
    sort alike by code point and by UTF-16 unit and whose escapes are the same; safe integers;
    the floats ``_plain_number`` spells. False (``out`` then holds junk): the library decides,
    refusals included. A property test holds it to the library byte for byte."""
    if type(value) is str:
        if not value.isascii():
            return False
        out.append(_quote(value))
    elif type(value) is dict:
        keys = list(value)
        if not all(type(key) is str and key.isascii() for key in keys):
            return False
        keys.sort()
        out.append("{")
        for i, key in enumerate(keys):
            if i:
                out.append(",")
            out.append(_quote(key))
            out.append(":")
            if not _plain(value[key], out):
                return False
        out.append("}")
    elif type(value) is list or type(value) is tuple:
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            if not _plain(item, out):
                return False
        out.append("]")
    elif type(value) is int:
        if not -_SAFE < value < _SAFE:
            return False
        out.append(str(value))
    elif value is None or type(value) is bool:
        out.append("null" if value is None else "true" if value else "false")
    else:
        spelled = _plain_number(value)
        if spelled is None:
            return False
        out.append(spelled)
    return True


def digest(value: object) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def manifest_digest(delegation_id: str, seq: int, action_ids: Iterable[str]) -> str:
    """Binds the delegation, the control sequence and the exact set of in-flight actions."""
    return digest({"delegation": delegation_id, "seq": seq, "actions": sorted(action_ids)})


_HEX = re.compile(r"[0-9a-f]*")


def _plain_int(value: object) -> bool:
    return type(value) is int and 0 <= value < 2 ** 53


def _plain_number(value: object) -> str | None:
    """``value`` as RFC 8785 writes it (ECMAScript's number to string), when that is Python's
    own spelling: an integral float below 2**53 without its ``.0``, or a float whose ``repr``
    has no exponent in the range where neither writes one. None: leave it to the library."""
    if type(value) is not float or not math.isfinite(value):
        return None
    size = abs(value)
    if value.is_integer():  # exact below 2**53, where the shortest digits are all of them
        return str(int(value)) if size < 2.0 ** 53 else None
    return repr(value) if 1e-4 <= size < 1e16 else None


def _str(body: Mapping[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise Malformed(f"field {name!r} must be a string")
    return value


def _int(body: Mapping[str, Any], name: str, minimum: int = 0) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise Malformed(f"field {name!r} must be an integer >= {minimum}")
    return value


def _float(body: Mapping[str, Any], name: str, optional: bool = False) -> float | None:
    value = body.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Malformed(f"field {name!r} must be a finite number")
    return float(value)


def _str_list(body: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = body.get(name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Malformed(f"field {name!r} must be a list of strings")
    return tuple(value)


@dataclass(frozen=True)
class Document:
    """Base of signed documents. Subclasses list their fields in KNOWN."""

    TYPE: ClassVar[str] = ""
    KNOWN: ClassVar[tuple[str, ...]] = ()

    version: int = field(default=VERSION, kw_only=True)
    extra: Mapping[str, Any] = field(default_factory=dict, kw_only=True, compare=False)

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = dict(self.extra)
        body.update(self._fields())
        body["type"] = self.TYPE
        body["v"] = self.version
        return body

    def encode(self) -> bytes:
        return canonical(self.to_json())


def _split(body: Mapping[str, Any], cls: type[Document]) -> tuple[int, dict[str, Any]]:
    if body.get("type") != cls.TYPE:
        raise Malformed(f"expected a {cls.TYPE!r} document, got type {body.get('type')!r}")
    version = _int(body, "v", minimum=1)
    extra = {k: v for k, v in body.items() if k not in cls.KNOWN and k not in ("type", "v")}
    return version, extra


@dataclass(frozen=True)
class ControlIntent(Document):
    """RECALL or TERMINATE for one delegation at one epoch, sequence-numbered (I4).
    ``issued_by`` names the person who asked (empty for a program's own intent); it is
    encoded only when set, so an intent signed before it existed encodes as it was signed.
    ``recovery`` marks tether's own settling of a delegation whose owner is gone: nobody
    stopped the work, so an engine that runs it (Temporal) may go on with it at a new epoch;
    encoded only when set, and only as true, for the same reason."""

    TYPE: ClassVar[str] = "control"
    KNOWN: ClassVar[tuple[str, ...]] = (
        "kind", "delegation", "epoch", "seq", "grace", "reason", "issued_at", "by", "recovery",
    )

    kind: ControlKind
    delegation_id: str
    epoch: int
    seq: int
    grace: float | None
    reason: str
    issued_at: float
    issued_by: str = ""
    recovery: bool = False

    def _fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "kind": self.kind.value,
            "delegation": self.delegation_id,
            "epoch": self.epoch,
            "seq": self.seq,
            "grace": self.grace,
            "reason": self.reason,
            "issued_at": self.issued_at,
        }
        if self.issued_by:
            fields["by"] = self.issued_by
        if self.recovery:
            fields["recovery"] = True
        return fields

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ControlIntent:
        version, extra = _split(body, cls)
        try:
            kind = ControlKind(_str(body, "kind"))
        except ValueError:
            raise Malformed(f"unknown control kind {body.get('kind')!r}") from None
        grace = _float(body, "grace", optional=True)
        if kind is ControlKind.RECALL and (grace is None or grace <= 0):
            raise Malformed("a RECALL must carry a positive grace")
        # Present means named: an empty name would encode differently from what was signed.
        issued_by = _str(body, "by") if "by" in body else ""
        if "by" in body and not issued_by:
            raise Malformed("field 'by' must name who issued the intent")
        if "recovery" in body and body["recovery"] is not True:
            raise Malformed("field 'recovery' is present only as true")
        if "recovery" in body and kind is not ControlKind.TERMINATE:
            raise Malformed("only a TERMINATE settles a delegation whose owner is gone")
        return cls(
            kind=kind,
            delegation_id=_str(body, "delegation"),
            epoch=_int(body, "epoch"),
            seq=_int(body, "seq", minimum=1),
            grace=grace,
            reason=_str(body, "reason"),
            issued_at=_float(body, "issued_at") or 0.0,
            issued_by=issued_by,
            recovery="recovery" in body,
            version=version,
            extra=extra,
        )


@dataclass(frozen=True)
class Acknowledgement(Document):
    """A child's answer to a control intent: the actions it had in flight when it saw it."""

    TYPE: ClassVar[str] = "ack"
    KNOWN: ClassVar[tuple[str, ...]] = ("delegation", "seq", "in_flight", "digest", "acked_at")

    delegation_id: str
    seq: int
    in_flight: tuple[str, ...]
    acked_at: float

    @property
    def digest(self) -> str:
        return manifest_digest(self.delegation_id, self.seq, self.in_flight)

    def _fields(self) -> dict[str, Any]:
        return {
            "delegation": self.delegation_id,
            "seq": self.seq,
            "in_flight": sorted(self.in_flight),
            "digest": self.digest,
            "acked_at": self.acked_at,
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Acknowledgement:
        version, extra = _split(body, cls)
        ack = cls(
            delegation_id=_str(body, "delegation"),
            seq=_int(body, "seq", minimum=1),
            in_flight=_str_list(body, "in_flight"),
            acked_at=_float(body, "acked_at") or 0.0,
            version=version,
            extra=extra,
        )
        if _str(body, "digest") != ack.digest:
            raise Malformed("acknowledgement digest does not match its in-flight manifest")
        return ack


@dataclass(frozen=True)
class NoEffectsReceipt(Document):
    """A child's signed claim that its subtree started no side-effecting action. It is only
    ever believed together with the journal's own count (I9)."""

    TYPE: ClassVar[str] = "no_effects"
    KNOWN: ClassVar[tuple[str, ...]] = ("delegation", "seq", "issued_at")

    delegation_id: str
    seq: int
    issued_at: float

    def _fields(self) -> dict[str, Any]:
        return {"delegation": self.delegation_id, "seq": self.seq, "issued_at": self.issued_at}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> NoEffectsReceipt:
        version, extra = _split(body, cls)
        return cls(
            delegation_id=_str(body, "delegation"),
            seq=_int(body, "seq", minimum=1),
            issued_at=_float(body, "issued_at") or 0.0,
            version=version,
            extra=extra,
        )


KEY_OPS = ("root", "trust", "revoke")


@dataclass(frozen=True)
class KeyGrant(Document):
    """An entry of a journal's key registry: its root (self-signed, written once), a key
    trusted, or a key revoked, signed by a key the registry already trusts."""

    TYPE: ClassVar[str] = "key"
    KNOWN: ClassVar[tuple[str, ...]] = ("op", "key_id", "public", "label", "issued_at")

    op: str
    key_id: str
    public: str  # base64 raw Ed25519 public key ("" for a revocation)
    label: str
    issued_at: float

    def _fields(self) -> dict[str, Any]:
        return {"op": self.op, "key_id": self.key_id, "public": self.public,
                "label": self.label, "issued_at": self.issued_at}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> KeyGrant:
        version, extra = _split(body, cls)
        op = _str(body, "op")
        if op not in KEY_OPS:
            raise Malformed(f"unknown key registry operation {op!r}")
        return cls(op=op, key_id=_str(body, "key_id"), public=_str(body, "public"),
                   label=_str(body, "label"), issued_at=_float(body, "issued_at") or 0.0,
                   version=version, extra=extra)


@dataclass(frozen=True)
class WorkOrder(Document):
    """The delegating orchestrator's signature over queued work: what a worker may run."""

    TYPE: ClassVar[str] = "work"
    KNOWN: ClassVar[tuple[str, ...]] = (
        "delegation", "task", "parent", "agent", "args", "surface", "issued_at",
    )

    delegation_id: str
    task_id: str
    parent_id: str | None
    agent: str
    args_digest: str  # sha256 of the canonical arguments
    surface: tuple[str, ...]
    issued_at: float

    def _fields(self) -> dict[str, Any]:
        return {"delegation": self.delegation_id, "task": self.task_id,
                "parent": self.parent_id, "agent": self.agent, "args": self.args_digest,
                "surface": list(self.surface), "issued_at": self.issued_at}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> WorkOrder:
        version, extra = _split(body, cls)
        parent = body.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise Malformed("field 'parent' must be a string or null")
        return cls(delegation_id=_str(body, "delegation"), task_id=_str(body, "task"),
                   parent_id=parent, agent=_str(body, "agent"), args_digest=_str(body, "args"),
                   surface=_str_list(body, "surface"),
                   issued_at=_float(body, "issued_at") or 0.0, version=version, extra=extra)


@dataclass(frozen=True)
class ChainSeal(Document):
    """A writing process's signature over one commit's chain heads: the root of a Merkle tree
    whose leaves are the heads that commit moved (``_core.chain``)."""

    TYPE: ClassVar[str] = "seal"
    KNOWN: ClassVar[tuple[str, ...]] = ("root", "heads", "sealed_at")

    root: str
    heads: int
    sealed_at: float

    def _fields(self) -> dict[str, Any]:
        return {"root": self.root, "heads": self.heads, "sealed_at": self.sealed_at}

    def encode(self) -> bytes:
        # One per commit: written out directly when every field has one plain spelling (the
        # RFC 8785 bytes exactly, as a test checks on any value), else by the library.
        at = _plain_number(self.sealed_at)
        if (at is None or self.extra != {} or not _plain_int(self.heads)
                or not _plain_int(self.version) or type(self.root) is not str
                or not _HEX.fullmatch(self.root)):
            return super().encode()
        return (f'{{"heads":{self.heads},"root":"{self.root}","sealed_at":{at},'
                f'"type":"seal","v":{self.version}}}').encode()

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChainSeal:
        version, extra = _split(body, cls)
        return cls(root=_str(body, "root"), heads=_int(body, "heads", minimum=1),
                   sealed_at=_float(body, "sealed_at") or 0.0, version=version, extra=extra)


AnyDocument = (ControlIntent | Acknowledgement | NoEffectsReceipt | KeyGrant | WorkOrder
               | ChainSeal)
DOCUMENT_TYPES: dict[str, type[AnyDocument]] = {
    ChainSeal.TYPE: ChainSeal,
    ControlIntent.TYPE: ControlIntent,
    Acknowledgement.TYPE: Acknowledgement,
    NoEffectsReceipt.TYPE: NoEffectsReceipt,
    KeyGrant.TYPE: KeyGrant,
    WorkOrder.TYPE: WorkOrder,
}


def parse_body(body: bytes, *, canonical_known: bool = False) -> dict[str, Any]:
    """Decode canonical bytes; anything that is not a canonical JSON object is Malformed.
    ``canonical_known``: the bytes are this process's own encoding (``signing``), so the
    re-encoding that proves their form is skipped."""
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise Malformed("document is not valid UTF-8 JSON") from None
    if not isinstance(value, dict):
        raise Malformed("document is not a JSON object")
    if canonical_known:
        return value
    try:
        again = canonical(value)
    except UserError:
        raise Malformed("document holds values outside canonical JSON") from None
    if again != body:
        raise Malformed("document is not in canonical form")
    return value


def decode(body: bytes, *, canonical_known: bool = False) -> AnyDocument:
    value = parse_body(body, canonical_known=canonical_known)
    cls = DOCUMENT_TYPES.get(str(value.get("type")))
    if cls is None:
        raise Malformed(f"unknown document type {value.get('type')!r}")
    return cls.from_json(value)
