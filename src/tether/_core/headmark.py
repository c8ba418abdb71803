"""What a configuration remembers of delegations' chain heads: a witness outside the journal.

A chain shows any change to a delegation's records that leaves its sealed head as it was, but
not a rollback of the rows, the entries and the head together to a genuine earlier state:
every seal then verifies. So each configuration (its key directory) remembers, per delegation,
the latest head it wrote or accepted (its length and last hash), and refuses a delegation
whose head is older than that, or whose chain no longer holds that head (``chain.rollback``).
Chains only grow, so a head remembered stays a prefix of the genuine chain: only heads known
to be committed are remembered (the journal layer decides when), never one whose commit may
have failed.

Pure: the key directory's file is read and written through the ``load`` and ``save`` given
(``_runtime.keys``), and ``lock`` (any context manager) serialises the threads that note.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadMark:
    length: int  # entries in the chain
    hash: str  # of its last entry

    def to_json(self, delegation_id: str) -> list[object]:
        return [delegation_id, self.length, self.hash]

    @classmethod
    def from_json(cls, data: object) -> tuple[str, HeadMark]:
        if not (isinstance(data, list) and len(data) == 3 and isinstance(data[0], str)
                and type(data[1]) is int and data[1] >= 0 and isinstance(data[2], str)):
            raise ValueError("not a head mark")
        return data[0], cls(data[1], data[2])


def merge_marks(into: dict[str, HeadMark],
                marks: Iterable[tuple[str, HeadMark]]) -> dict[str, HeadMark]:
    """``marks`` taken into ``into``: the longest per delegation (chains only grow, so a
    shorter mark says nothing the longer one does not)."""
    for delegation_id, mark in marks:
        known = into.get(delegation_id)
        if known is None or known.length < mark.length:
            into[delegation_id] = mark
    return into


# Marks the key directory gained since the last look (None: unchanged); marks to append,
# with how many delegations the memory holds (what a compacted file would hold), and whether
# to wait for the directory while another process holds it (if not: ``Busy``).
Load = Callable[[], Mapping[str, HeadMark] | None]
Save = Callable[[Mapping[str, HeadMark], int, bool], None]


class Busy(Exception):
    """Someone else holds the key directory's lock (another process, or another thread of
    this one): the marks stay noted for the next moment."""


class HeadMemory:
    """Marks by delegation id (ids are unique across journals: UUIDv7). ``note`` remembers in
    memory; ``persist`` hands what was noted since to ``save``; ``refresh`` takes in what the
    configuration's other processes persisted."""

    def __init__(self, marks: Mapping[str, HeadMark] | None = None, *,
                 load: Load | None = None, save: Save | None = None,
                 lock: AbstractContextManager[object] | None = None) -> None:
        self._marks = dict(marks or {})
        self._dirty: dict[str, HeadMark] = {}
        # Heads a read accepted that may not be on disk yet: another process's commit that
        # did not wait for it (a relaxed post, the MCP proxy's) is seen by readers at once,
        # and a crash of the server or the machine can still lose it. Remembered by
        # ``confirm`` once a commit that waited for the disk came after the read, on the
        # same connection (``token``), and found the head still in the journal: a durable
        # commit on a crashed server's next life says nothing of what it lost (a crash cuts
        # the connection, unless a pooler hides it: hence the second look).
        self._pending: dict[str, tuple[HeadMark, object]] = {}
        self._load = load
        self._save = save
        self._lock: AbstractContextManager[object] = lock or contextlib.nullcontext()

    def seen(self, delegation_id: str) -> HeadMark | None:
        return self._marks.get(delegation_id)

    def note(self, delegation_id: str, length: int, tip: str) -> None:
        """Remember a head known to be committed; one no longer than the mark is ignored
        (chains only grow: a shorter head is a rollback, never remembered)."""
        with self._lock:
            known = self._marks.get(delegation_id)
            if known is not None and known.length >= length:
                return
            mark = self._marks[delegation_id] = HeadMark(length, tip)
            if self._save is not None:  # (kept in memory only, it has nothing to hand on)
                self._dirty[delegation_id] = mark

    def accept(self, delegation_id: str, length: int, tip: str, token: object = None) -> None:
        """A head a read (through ``token``: its connection) accepted: remembered once
        ``confirm``ed. It replaces one accepted before, which the journal no longer holds
        if this one is not longer than what is remembered (lost, or never on disk)."""
        with self._lock:
            known = self._marks.get(delegation_id)
            if known is not None and known.length >= length:
                self._pending.pop(delegation_id, None)
                return
            self._pending[delegation_id] = (HeadMark(length, tip), token)

    def discard(self, delegation_id: str) -> None:
        """A read judged the delegation's chain wrong: what was accepted of it goes."""
        with self._lock:
            self._pending.pop(delegation_id, None)

    def pending(self, token: object = None) -> dict[str, HeadMark]:
        """The heads accepted through ``token`` and not yet confirmed (None: all)."""
        with self._lock:
            return {d: mark for d, (mark, by) in self._pending.items()
                    if token is None or by == token}

    def confirm(self, marks: Mapping[str, HeadMark]) -> None:
        """These accepted heads are on disk now (a commit that waited for it came after
        they were read, on the connection they were read through): remembered."""
        for delegation_id, mark in marks.items():
            with self._lock:
                if self._pending.get(delegation_id, (None, None))[0] == mark:
                    del self._pending[delegation_id]
            self.note(delegation_id, mark.length, mark.hash)

    def refresh(self) -> None:
        if self._load is None:
            return
        with self._lock:
            merge_marks(self._marks, (self._load() or {}).items())

    def persist(self, *, wait: bool = True) -> None:
        """Hand the marks noted since the last persist to ``save`` (kept for the next try if
        it fails, or if ``wait`` is False and another process holds the directory: ``Busy``)."""
        if self._save is None or not self._dirty:
            return
        with self._lock:
            dirty, self._dirty = self._dirty, {}
            known = len(self._marks)
        try:
            self._save(dirty, known, wait)
        except BaseException:
            with self._lock:
                for delegation_id, mark in dirty.items():
                    self._dirty.setdefault(delegation_id, mark)
            raise
