"""Who a deployment trusts: a journal's key registry read against a configuration's pins.

The registry is a list of signed ``KeyGrant`` entries in the journal. Its first ``root`` entry
is self-signed and written once, when the journal is first opened by a process whose key its
configuration pins. A configuration believes the registry only if it pins that root: from it,
each ``trust`` entry signed by an already trusted key adds a key, each ``revoke`` entry so
signed removes one. An entry that does not verify is ignored and listed as a problem, so a
process that can write the journal but holds no trusted key cannot add one.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from tether._core import values
from tether._core.documents import ControlIntent, KeyGrant, WorkOrder, decode, digest
from tether._core.errors import (
    ControlRefused,
    Malformed,
    Unbound,
    UnknownKey,
    UserError,
    WorkRefused,
)
from tether._core.model import ControlKind
from tether._core.registrymark import RegistryMark, entries_digest
from tether._core.signing import D, Signed, TrustedKeys, public_key


def _public(b64: str) -> Ed25519PublicKey:
    try:
        return public_key(base64.b64decode(b64, validate=True))
    except ValueError as exc:
        raise Malformed(f"not a base64 Ed25519 public key ({exc})") from None


@dataclass(frozen=True)
class Registry:
    """The keys a configuration trusts in one journal, and why others are not."""

    keys: TrustedKeys
    root: str | None  # the journal's root key id (None: no root recorded yet)
    pinned: tuple[str, ...]  # the configuration's pinned root key ids
    labels: dict[str, str] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()  # registry entries that were ignored, and why
    anchor: str | None = None  # the digest of the root entry: which journal's registry
    chained: bool = False  # its signed root entry says no delegation predates the chain
    mark: RegistryMark | None = None  # what a configuration remembers of it (registrymark)

    def explain(self, key_id: str) -> str:
        """Why ``key_id`` is not trusted, in one sentence."""
        if self.root is None:
            return f"key {key_id} is not trusted: this journal has no root key yet"
        if self.root not in self.pinned:
            return (f"key {key_id} is not trusted: this journal's keys are rooted in key "
                    f"{self.root}, which your configuration does not pin (it pins "
                    f"{', '.join(self.pinned) or 'nothing'}); run 'tether keys pin'")
        if key_id in self.revoked:
            return f"key {key_id} was revoked in this journal"
        return (f"key {key_id} is not trusted by this journal; a trusted key must run "
                f"'tether keys trust {key_id}'")

    def verify(self, signed: Signed, kind: type[D]) -> D:
        if signed.key_id not in self.keys:
            raise UnknownKey(self.explain(signed.key_id))
        return self.keys.verify(signed, kind)

    def verify_bytes(self, signed: Signed) -> None:
        """The signature alone, by a trusted key (documents decoded elsewhere)."""
        if signed.key_id not in self.keys:
            raise UnknownKey(self.explain(signed.key_id))
        self.keys.verify_bytes(signed)


def _digest(entries: Sequence[tuple[int, Signed]]) -> str:
    return entries_digest([(i, s.body, s.key_id, s.signature) for i, s in entries])


def effective(pins: TrustedKeys, entries: Sequence[tuple[int, Signed]],
              seen: Callable[[str], RegistryMark | None] | None = None) -> Registry:
    """Replay the registry ``entries`` (id order) from the root the configuration pins.
    ``seen``: what the configuration remembers of this journal's registry (by its anchor). A
    registry that does not begin with the entries remembered was rolled back by hand: that is
    named, and it is replayed again without the keys the configuration saw revoked (nor what
    they signed), so that deleting a revocation never trusts a key again."""
    found = _replay(pins, entries, frozenset())
    known = None if found.anchor is None or seen is None else seen(found.anchor)
    if known is None or (len(entries) >= known.length
                         and _digest(entries[:known.length]) == known.digest):
        return found
    again = _replay(pins, entries, frozenset(known.revoked) - {found.root})
    return dataclasses.replace(again, mark=None, problems=(
        f"the key registry was rolled back: this configuration read {known.length} entries "
        f"of it before, and the journal now holds {len(entries)} that do not begin with "
        "those (entries deleted or rewritten by hand); keys it saw revoked stay revoked",
        *again.problems))


def _replay(pins: TrustedKeys, entries: Sequence[tuple[int, Signed]],
            banned: frozenset[str]) -> Registry:
    trusted: dict[str, Ed25519PublicKey] = {}
    labels: dict[str, str] = {}
    revoked: set[str] = set(banned)
    problems: list[str] = []
    root: str | None = None
    anchor: str | None = None
    chained = False
    for entry_id, signed in entries:
        try:
            grant = decode(signed.body)
            if not isinstance(grant, KeyGrant):
                raise Malformed("not a key registry entry")
        except ControlRefused as exc:
            problems.append(f"registry entry {entry_id}: {exc}")
            continue
        if grant.op == "root":
            if root is not None:
                problems.append(f"registry entry {entry_id}: a second root")
                continue
            try:
                key = _public(grant.public)
                TrustedKeys([key]).verify_bytes(signed)
                if signed.key_id != grant.key_id:
                    raise Malformed("a root entry must be signed by the root key itself")
            except ControlRefused as exc:
                problems.append(f"registry entry {entry_id} (root): {exc}")
                continue
            root = grant.key_id
            anchor = _digest([(entry_id, signed)])
            chained = grant.extra.get("chained") is True
            if root in pins:
                trusted[root], labels[root] = key, grant.label
            continue
        signer = trusted.get(signed.key_id)
        try:
            if signer is None:
                raise UnknownKey(f"signed by key {signed.key_id}, which is not trusted")
            TrustedKeys([signer]).verify_bytes(signed)
            if grant.op == "trust":
                if grant.key_id in revoked:
                    # Sticky: otherwise a copy of the key's old grant (genuinely signed),
                    # appended after its revocation, would trust a leaked key again.
                    raise Malformed("that key was revoked earlier in this registry; a "
                                    "revoked key is never trusted again (make a new key)")
                key = _public(grant.public)
                if TrustedKeys([key]).ids() != [grant.key_id]:
                    raise Malformed("the key id does not match its public key")
                trusted[grant.key_id], labels[grant.key_id] = key, grant.label
            elif grant.key_id == root:
                raise Malformed("the root key cannot be revoked")
            else:
                trusted.pop(grant.key_id, None)
                revoked.add(grant.key_id)
        except ControlRefused as exc:
            problems.append(f"registry entry {entry_id} ({grant.op} {grant.key_id}): {exc}")
    return Registry(TrustedKeys(trusted.values()), root, tuple(pins.ids()), labels,
                    frozenset(revoked), tuple(problems), anchor, chained,
                    RegistryMark(len(entries), _digest(entries), tuple(sorted(revoked))))


def bound(intent: ControlIntent, delegation_id: str, seq: int, kind: ControlKind,
          epoch: int) -> None:
    """The signed body must name the row it is attached to (a copy or replay does not)."""
    signed_as = (intent.delegation_id, intent.seq, intent.kind, intent.epoch)
    row = (delegation_id, seq, kind, epoch)
    if signed_as != row:
        raise Unbound(
            f"intent signed for delegation {intent.delegation_id} (epoch {intent.epoch}, "
            f"sequence {intent.seq}, {intent.kind.value}) is attached to delegation "
            f"{delegation_id} (epoch {epoch}, sequence {seq}, {kind.value}): a copied or "
            "replayed intent"
        )


def args_digest(args: object) -> str:
    """What a work order signs of a task's arguments. RFC 8785 refuses integers beyond 2**53,
    which tether stores exactly (``values``): such arguments are digested in the stored
    encoding instead (its own prefix keeps the two apart), so a task that runs here also runs
    through a worker, and every digest that RFC 8785 could make stays what it was."""
    try:
        return digest(args)
    except UserError:
        stored = values.dumps(args)  # refuses what cannot be stored, as delegate() does
        return hashlib.sha256(b"tether-values\0" + stored.encode()).hexdigest()


def work_order(delegation_id: str, task_id: str, parent_id: str | None, agent: str,
               args: object, surface: Sequence[str], issued_at: float) -> WorkOrder:
    return WorkOrder(delegation_id, task_id, parent_id, agent, args_digest(args),
                     tuple(surface), issued_at)


def check_work(order: WorkOrder, delegation_id: str, task_id: str, parent_id: str | None,
               agent: str, args: object, surface: Sequence[str]) -> None:
    """The signed work order must describe the row a worker is about to run."""
    expected = work_order(delegation_id, task_id, parent_id, agent, args, surface,
                          order.issued_at)
    if expected != order:
        raise WorkRefused(f"the signed work order of {delegation_id} does not match its row "
                          "(agent, arguments, surface or parent were changed)")
