"""The tamper-evident journal: each delegation's records form a hash chain, its head sealed.

A delegation's records are its own row, its actions, its control rows, its documents (acks,
receipts, decisions) and its events. Every commit that writes one of them appends an *entry*
to the delegation's chain per record written: the record's key, the hash of its row as
committed, and the hash of the entry before. The chain's *head* (its length and last hash) is
a leaf of a Merkle tree over every head that commit moved; the writing process signs the
tree's root once per commit (a ``ChainSeal``), so the cost of a signature is shared by the
whole batch. A head keeps its path to the root beside the signed seal.

Reading it back (``judge``): the head's seal must be signed by a key the registry trusts and
its path must lead from this head to the seal's root; the entries must link, 1..length, to the
head's hash; each record's row must hash to its latest entry. So a row altered by hand (a
state flipped, a result or reason rewritten) differs from its entry, a row inserted by hand
has none, a row deleted by hand leaves its entry without a row, and an entry deleted or edited
breaks the links to the signed head. What a chain alone cannot show is a rollback of
everything together (rows, entries and head) to a genuine earlier state: for that the reader
brings what its configuration remembers of the head (``_core.headmark``), and a chain older
than that is named (``rollback``; docs/security.md, "Rollback").

Pure: no I/O. The journal layer reads the rows and writes the entries.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether._core import columns
from tether._core.documents import ChainSeal
from tether._core.errors import ControlRefused, Malformed
from tether._core.headmark import HeadMark
from tether._core.signing import Signed
from tether._core.trust import Registry

# The columns of each chained table, in the order their rows are hashed (``columns``: the
# order each table was made in, which a journal's hashes depend on). Every column: a record's
# whole row is what the writer committed.
COLUMNS: dict[str, str] = {t.name: t.select() for t in (
    columns.DELEGATIONS, columns.ACTIONS, columns.CONTROLS, columns.DOCUMENTS, columns.EVENTS)}
# What a record is called in a chain, and in a report: "action a-1", "event 17".
KIND = {"delegations": "delegation", "actions": "action", "controls": "control",
        "documents": "document", "events": "event"}
TABLE = {v: k for k, v in KIND.items()}


def record(table: str, pk: object) -> str:
    return f"{KIND[table]} {pk}"


def owner_of(table: str, row: Sequence[Any]) -> str | None:
    """The delegation whose chain a row belongs to (None: an event only an action names,
    which the reader resolves; or no delegation at all)."""
    if table == "delegations":
        return str(row[0])
    value = row[1]
    return None if value is None else str(value)


def plain(value: object) -> object:
    """A column's value, the same however the driver hands it over (bytes or a buffer)."""
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return value


_KEEP = frozenset({str, int, float, bytes, type(None)})


def _hash(*parts: object) -> str:
    # Not RFC 8785 (nothing here is signed or read by anyone else): the ``repr`` of each
    # scalar (str, int, float, bytes, None), NUL-separated; a repr never holds a raw NUL.
    # Several times cheaper than JSON on the per-action path. A column reads back with the
    # same type every time, so the same row always hashes the same.
    return hashlib.sha256("\0".join(map(repr, parts)).encode()).hexdigest()


def content_hash(row: Sequence[Any]) -> str:
    return _hash("row", *[v if type(v) in _KEEP else plain(v) for v in row])


def entry_hash(prev: str, delegation_id: str, seq: int, rec: str, content: str,
               found: str) -> str:
    return _hash("entry", delegation_id, seq, rec, content, found, prev)


def leaf(delegation_id: str, length: int, head: str, legacy: bool) -> str:
    return _hash("head", delegation_id, length, head, int(legacy))


def _node(left: str, right: str) -> str:
    return hashlib.sha256(b"\1" + bytes.fromhex(left) + bytes.fromhex(right)).hexdigest()


def merkle_proofs(leaves: Sequence[str]) -> tuple[str, list[bytes]]:
    """The root over ``leaves`` and each leaf's path to it as a head keeps it: per level the
    side of its sibling (``L`` when on the left) and the sibling's 32 bytes. An odd node out
    is carried up unchanged. Worked in bytes: a commit's heads are a thousand leaves."""
    if not leaves:
        raise ValueError("no leaves")
    sha256 = hashlib.sha256
    level = [bytes.fromhex(x) for x in leaves]
    levels = [level]
    while len(level) > 1:
        up = [sha256(b"\1" + level[k] + level[k + 1]).digest()
              for k in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
        level = up
    proofs = []
    for i in range(len(leaves)):
        parts, at = [], i
        for below in levels[:-1]:
            sibling = at ^ 1
            if sibling < len(below):  # else: the odd node out, carried up with no sibling
                parts.append((b"L" if sibling < at else b"R") + below[sibling])
            at //= 2
        proofs.append(b"".join(parts))
    return level[0].hex(), proofs


def fold(start: str, path: Iterable[Sequence[str]]) -> str:
    node = start
    for side, sibling in path:
        node = _node(sibling, node) if side == "L" else _node(node, sibling)
    return node


_PATH_MAX = 64  # levels: 2**64 heads in one seal


def _decode_path(text: str) -> list[list[str]]:
    try:
        if len(text) > _PATH_MAX * 80:  # before parsing: no deep nesting, no huge text
            raise ValueError
        path = json.loads(text)
        if not isinstance(path, list) or not all(
                isinstance(p, list) and len(p) == 2 and p[0] in ("L", "R")
                and isinstance(p[1], str) and len(p[1]) == 64 and bytes.fromhex(p[1])
                for p in path):
            raise ValueError
    except (ValueError, RecursionError):
        raise Malformed("the head's path to its seal is not a list of hashes") from None
    return path


def _decode_proof(proof: bytes) -> list[list[str]]:
    if len(proof) % 33 or len(proof) > _PATH_MAX * 33 or \
            any(proof[k] not in b"LR" for k in range(0, len(proof), 33)):
        raise Malformed("the head's path to its seal is not a list of hashes")
    return [[chr(proof[k]), proof[k + 1:k + 33].hex()] for k in range(0, len(proof), 33)]


@dataclass(frozen=True)
class Head:
    """A delegation's chain head as stored. ``seal`` None: never sealed (a head made by the
    upgrade for a delegation older than the chain, or written by a process with no key). Its
    path to the seal's root: ``proof`` (binary, the seal stored once per commit), or ``path``
    (text, the seal kept in the head: written before version 7)."""

    length: int
    hash: str
    legacy: bool
    path: str | None
    seal: Signed | None
    problem: str | None = None  # its row, or one of its entries' rows, is malformed
    proof: bytes | None = None


@dataclass(frozen=True)
class Entry:
    """One record as a commit wrote it (``content``), and as that commit found it before
    writing (``found``: "" for a row it inserted)."""

    seq: int
    record: str
    content: str
    found: str
    hash: str


@dataclass(frozen=True)
class Problem:
    record: str
    problem: str


@dataclass
class ChainVerdict:
    """What reading one delegation's chain found. ``problems``: altered, inserted or deleted
    records and a broken chain or seal. ``unchained``: records written before the chain
    existed (a delegation older than the upgrade), which are not failures."""

    delegation_id: str
    problems: list[Problem] = field(default_factory=list)
    unchained: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def seal_problem(delegation_id: str, head: Head, registry: Registry) -> str | None:
    """Why ``head`` is not sealed by a key ``registry`` trusts (None: it is). A writer checks
    this before it extends a chain another process sealed: sealing over a head rewritten by
    hand would make that rewrite its own."""
    if head.problem is not None:
        return head.problem
    if head.legacy and registry.chained:
        return ("the chain's head is marked as older than the chain, in a journal whose root "
                "entry says every delegation was chained from the start (marked by hand)")
    if head.seal is None or (head.path is None and head.proof is None):
        if head.legacy and head.length == 0:
            return None
        return ("the chain's head is not sealed (written by a process without a signing key, "
                "or its seal was removed)")
    try:
        seal = registry.verify(head.seal, ChainSeal)
        path = _decode_proof(head.proof) if head.proof is not None else \
            _decode_path(head.path or "")
        root = fold(leaf(delegation_id, head.length, head.hash, head.legacy), path)
        if root != seal.root:
            raise Malformed("the head is not the one its seal signed (its length, hash or "
                            "legacy mark was changed, or a seal copied from elsewhere)")
    except ControlRefused as exc:
        return f"the chain's seal: {exc}"
    return None


def _check_head(verdict: ChainVerdict, head: Head, tip: str, length: int,
                registry: Registry) -> None:
    d = verdict.delegation_id
    if head.problem is not None:
        verdict.problems.append(Problem("chain", head.problem))
        return
    if (head.length, head.hash) != (length, tip):
        verdict.problems.append(Problem("chain", (
            f"the chain holds {length} entries ending in {tip[:12] or '(none)'} but its head "
            f"says {head.length} ending in {head.hash[:12] or '(none)'}: entries were "
            "deleted, inserted or edited")))
    problem = seal_problem(d, head, registry)
    if problem is not None:
        verdict.problems.append(Problem("chain", problem))


ROLLED_BACK = "rolled back"  # how a rollback's problem begins (``Journal.untampered``)


def rollback(head: Head, entries: Sequence[Entry], seen: HeadMark) -> str | None:
    """Why ``head`` and ``entries`` are older than the head ``seen`` by this configuration
    (None: they are that head or extend it). A genuine chain only grows, so a shorter one, or
    one whose entry at the length seen is another, was written back by hand (or restored from
    a backup, or lost by a failover): every seal may verify, and still it is not the chain."""
    if head.problem is not None or seen.length == 0:
        return None
    if head.length < seen.length:
        return (f"{ROLLED_BACK}: this configuration saw its chain at length {seen.length}, the "
                f"journal now holds {head.length} (an earlier state of its rows, chain and "
                "sealed head written back together, or a journal restored from a backup)")
    tip = head.hash if head.length == seen.length else next(
        (e.hash for e in entries if e.seq == seen.length), None)
    if tip is None or tip == seen.hash:
        return None  # an entry missing under the head is named as a broken chain already
    return (f"{ROLLED_BACK} and rewritten: this configuration saw entry {seen.length} of its "
            f"chain ending in {seen.hash[:12]}, the journal's entry {seen.length} ends in "
            f"{tip[:12]} (rolled back by hand and written again)")


def judge(delegation_id: str, head: Head | None, entries: Sequence[Entry],
          rows: Mapping[str, str], registry: Registry,
          seen: HeadMark | None = None) -> ChainVerdict:
    """Judge one delegation's records (``rows``: record to the hash of its row now, every
    row that belongs to the delegation and every row its chain names) against its chain, and
    its head against the one this configuration remembers (``seen``, if any)."""
    verdict = ChainVerdict(delegation_id)
    if head is None and not entries and not rows:
        return verdict  # gone as a whole, chain and all: pruned since it was listed
    if head is None:
        verdict.problems.append(Problem("chain", (
            "the delegation has no chain head (deleted by hand; every delegation written "
            "since the chain was introduced has one)")))
        verdict.unchained = sorted(rows)
        return verdict
    prev, latest, broken = "", dict[str, str](), False
    for n, entry in enumerate(sorted(entries, key=lambda e: e.seq), start=1):
        if not broken and (entry.seq != n or entry_hash(
                prev, delegation_id, entry.seq, entry.record, entry.content,
                entry.found) != entry.hash):
            broken = True  # every later entry then fails too: the first break is named
            verdict.problems.append(Problem("chain", (
                f"chain entry {entry.seq} does not follow entry {n - 1} (entries were "
                "deleted, inserted or edited)")))
        was = latest.get(entry.record)
        if entry.found != (was or "") and not (was is None and head.legacy):
            # The writer updated a row that was not what the chain last recorded: altered by
            # hand in between (and then written over, which would otherwise hide it).
            verdict.problems.append(Problem(entry.record, (
                f"altered before chain entry {entry.seq}: the row its writer found was not "
                "the one committed and sealed before" if was is not None else
                f"inserted before chain entry {entry.seq}: its writer found a row no entry "
                "records")))
        prev = entry.hash
        latest[entry.record] = entry.content
    _check_head(verdict, head, prev, len(entries), registry)
    older = None if seen is None else rollback(head, entries, seen)
    if older is not None:
        verdict.problems.append(Problem("chain", older))
    for rec, content in sorted(rows.items()):
        if rec not in latest:
            if head.legacy:
                verdict.unchained.append(rec)
            else:
                verdict.problems.append(Problem(rec, (
                    "inserted: this row is in no entry of the delegation's chain (written "
                    "by hand)")))
        elif latest[rec] != content:
            verdict.problems.append(Problem(rec, (
                "altered: this row differs from what its writer committed and sealed")))
    for rec in sorted(set(latest) - set(rows)):
        verdict.problems.append(Problem(rec, (
            "deleted: the chain records this row but it is gone from the journal")))
    return verdict
