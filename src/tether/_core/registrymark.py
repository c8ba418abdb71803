"""What a configuration remembers of each journal's key registry: how long it was and what
its entries hashed to when last read, and which keys it saw revoked. Kept outside the journal
(beside the configuration's keys), so that deleting a registry's last entries (a revocation,
say) cannot make a configuration that saw them trust a revoked key again (docs/security.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from tether._core.documents import canonical


@dataclass(frozen=True)
class RegistryMark:
    length: int  # entries read
    digest: str  # of those entries, in id order
    revoked: tuple[str, ...] = ()  # keys seen revoked

    def to_json(self) -> dict[str, Any]:
        return {"length": self.length, "digest": self.digest, "revoked": list(self.revoked)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RegistryMark:
        length, digest, revoked = data["length"], data["digest"], data.get("revoked", [])
        if not (isinstance(length, int) and isinstance(digest, str) and isinstance(revoked, list)
                and all(isinstance(k, str) for k in revoked)):
            raise ValueError("not a registry mark")
        return cls(length, digest, tuple(sorted(revoked)))


def entries_digest(rows: Sequence[tuple[int, bytes, str, bytes]]) -> str:
    """A hash chain over registry rows (id, body, signer, signature)."""
    tip = ""
    for entry_id, body, signer, signature in rows:
        tip = hashlib.sha256(canonical([tip, entry_id, body.hex(), signer,
                                        signature.hex()])).hexdigest()
    return tip


_TOKENS = itertools.count(1)


class RegistryMemory:
    """Marks by journal (the digest of its root entry). ``save`` persists them (the key ring's
    ``registry.json``); None keeps them in this process only. ``load`` returns the persisted
    marks when they changed since it last looked (None: unchanged): ``refresh`` merges them,
    so that what another process of the configuration saw (a revocation) binds this one."""

    def __init__(self, marks: Mapping[str, RegistryMark] | None = None,
                 save: Callable[[dict[str, RegistryMark]], None] | None = None,
                 load: Callable[[], Mapping[str, RegistryMark] | None] | None = None,
                 lock: AbstractContextManager[object] | None = None) -> None:
        # The journal's writer thread and pooled readers (PostgreSQL) decide at once: each
        # look and each mark remembered is whole under the lock, never interleaved.
        self._lock: AbstractContextManager[object] = lock or contextlib.nullcontext()
        self._marks = dict(marks or {})
        self._save = save
        self._load = load
        self._unsaved = False  # a save failed: tried again at every decision until it lands
        self.version = 0  # moves with every mark remembered (readers memoize on it)
        # Which memory this is, for memos: never reused, unlike ``id()`` of a freed one.
        self.token = next(_TOKENS)

    def seen(self, anchor: str) -> RegistryMark | None:
        return self._marks.get(anchor)

    def refresh(self) -> None:
        """Take in what the configuration's other processes remembered since the last look."""
        with self._lock:
            if self._unsaved:
                self._persist()
            stored = self._load() if self._load is not None else None
            if stored:
                changed = [self._merge(anchor, mark) for anchor, mark in stored.items()]
                if any(changed):
                    self.version += 1

    def _merge(self, anchor: str, mark: RegistryMark) -> bool:
        """The longer of two marks, with every key either saw revoked; whether it changed."""
        known = self._marks.get(anchor)
        if known is None:
            self._marks[anchor] = mark
            return True
        longer = mark if mark.length > known.length else known
        merged = RegistryMark(longer.length, longer.digest,
                              tuple(sorted(set(known.revoked) | set(mark.revoked))))
        if merged == known:
            return False
        self._marks[anchor] = merged
        return True

    def news(self, anchor: str, mark: RegistryMark) -> bool:
        """Whether ``mark`` is more than what is remembered (``advance`` would keep it)."""
        known = self._marks.get(anchor)
        return known is None or known.length < mark.length or \
            not set(mark.revoked) <= set(known.revoked)

    def advance(self, anchor: str, mark: RegistryMark) -> None:
        """Remember a longer registry (a shorter one is a rollback: never remembered), with
        every key revoked in either (one remembered from elsewhere stays revoked)."""
        with self._lock:
            if not self.news(anchor, mark):
                return
            known = self._marks.get(anchor)
            if known is not None and not set(known.revoked) <= set(mark.revoked):
                mark = RegistryMark(mark.length, mark.digest,
                                    tuple(sorted(set(known.revoked) | set(mark.revoked))))
            self._marks[anchor] = mark
            self.version += 1
            self._persist()

    def save_pending(self) -> None:
        """Save a mark whose save failed (raises if it fails again)."""
        with self._lock:
            if self._unsaved:
                self._persist()

    def _persist(self) -> None:
        if self._save is None:
            return
        self._unsaved = True
        self._save(dict(self._marks))  # raises on failure: the caller's decision fails too
        self._unsaved = False
