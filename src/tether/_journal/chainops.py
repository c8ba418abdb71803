"""The chain's reads and writes (``_core.chain`` decides what they mean).

``seal`` runs at the end of every write transaction, before its COMMIT, over the records the
transaction's operations wrote (``tables.touch``): it appends one entry per record to its
delegation's chain, moves each head under a row lock (PostgreSQL: two processes appending to
one delegation queue on its head, so a chain never forks; heads are locked in id order, and
a transaction takes no other lock after them), and signs the Merkle root of the moved heads
once. ``read`` gathers what ``chain.judge`` needs for one delegation.

A head older than one the configuration remembers (``_core.headmark``) is never extended: a
rollback of the whole delegation stays visible, as a rewritten chain does. What a commit
sealed is remembered only once the commit is known to have happened (``Journal`` confirms it
when the operation that carried it returns, or reads it back at a flush): a batch that failed
after sealing, then ran again, must not read as a rollback of itself.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from tether._core import chain
from tether._core.columns import CHAIN, CHAIN_HEADS
from tether._core.documents import ChainSeal
from tether._core.headmark import Busy, HeadMark, HeadMemory
from tether._core.signing import Signed, SigningKey, TrustedKeys
from tether._core.trust import Registry
from tether._journal import trustops
from tether._journal.tables import Conn, Db, Step, Tx, blob, chunks, marks

T = TypeVar("T")
log = logging.getLogger("tether.journal")
_UNNAMED = (None, None, None)  # a head's seal columns when it names no seal row
_NONE = (None,) * 10  # a head not found (made in this transaction)
# A seal goes in the commit that moves the last head naming it (whoever's it was): judged by
# the heads as they are, so a seal a head still names stays whatever any process remembers
# (a commit lost with a server, a restart). One a rival is deleting meanwhile is skipped
# (PostgreSQL: no wait, so no deadlock); left over, it goes with a prune or a slice.
_UNNAMED_SEALS = ("DELETE FROM chain_seals WHERE id IN (SELECT id FROM chain_seals s WHERE "
                  "id IN ({}) AND NOT EXISTS (SELECT 1 FROM chain_heads h WHERE h.seal_id = "
                  "s.id) /*SKIP s*/)")
# The same for the seals of a slice of the ids, now and then (``seal``).
_UNNAMED_SLICE = ("DELETE FROM chain_seals WHERE id IN (SELECT id FROM chain_seals s WHERE "
                  "id BETWEEN ? AND ? AND NOT EXISTS (SELECT 1 FROM chain_heads h WHERE "
                  "h.seal_id = s.id) /*SKIP s*/)")
_SWEEP_EVERY, _SLICE = 64, 2**63 // 256  # a 256th of the seals every 64 shared seals
_NEW_HEAD = CHAIN_HEADS.insert(("delegation_id", "length", "hash"), " ON CONFLICT DO NOTHING")
# A head as ``_head`` decodes it: its own columns, then the seal it names (version 7), read
# in one statement (one moment, at READ COMMITTED). A head is locked by a statement on its
# own table: PostgreSQL re-reads a locked row that moved meanwhile, not the rows joined to it.
_OWN = "h.length, h.hash, h.legacy, h.path, h.seal, h.signer, h.signature, h.seal_id, h.proof"
_HEAD = (f"SELECT {_OWN}, s.seal, s.signer, s.signature FROM chain_heads h "
         "LEFT JOIN chain_seals s ON s.id = h.seal_id WHERE h.delegation_id = ?")


def _hex(value: Any) -> str | None:
    """A chain hash as the core spells it (stored as its 32 bytes); None for anything else."""
    return bytes(value).hex() if isinstance(value, bytes | bytearray | memoryview) else None


def _row(db: Db, table: str, pk: Any) -> Any:
    return db.execute(f"SELECT {chain.COLUMNS[table]} FROM {table} WHERE id = ?",
                      (pk,)).fetchone()


def _action_owner(db: Db, action_id: Any) -> str | None:
    found = db.execute("SELECT delegation_id FROM actions WHERE id = ?",
                       (action_id,)).fetchone()
    return None if found is None else str(found[0])


class Sealer:
    """One process's side of the chain: its key, the pins its registry is read from, and the
    heads it sealed itself (those it extends without checking their seal again)."""

    MEMO = 100_000

    def __init__(self) -> None:
        self.signer: SigningKey | None = None
        self.pins: TrustedKeys | None = None
        self.own: dict[str, tuple[int, str, bool]] = {}  # length, hash, legacy
        self.shared = 0  # the commits it sealed with a seal row (shared by their heads)
        # Heads sealed whose commit nobody has confirmed yet (a batch of posted writes alone):
        # read back at the next flush. Touched by the writer thread only.
        self.unconfirmed: dict[str, tuple[int, str]] = {}
        # Heads sealed by a commit that did not wait for the disk: unconfirmed once a later
        # durable commit that sealed heads did (it synced the log up to itself: SQLite's WAL,
        # PostgreSQL's). Touched by the writer thread only.
        self.unsynced: dict[str, tuple[int, str]] = {}

    @property
    def witness(self) -> HeadMemory | None:
        """What this process's configuration remembers of chain heads (None: nothing)."""
        return None if self.pins is None else self.pins.heads

    def older(self, db: Db, delegation_id: str, head: chain.Head) -> bool:
        """Whether ``head`` is older than the one the configuration remembers: shorter, or no
        longer holding the entry remembered (rolled back as a whole, then maybe extended).
        Even the head this process sealed last: another process of the configuration may
        have extended it since (``seal`` refreshes the memory once a batch)."""
        witness = self.witness
        if witness is None:
            return False
        mark = witness.seen(delegation_id)
        if mark is None or mark.length == 0:
            return False
        if head.length <= mark.length:
            return head.length < mark.length or head.hash != mark.hash
        if self.own.get(delegation_id) == (head.length, head.hash, head.legacy):
            return False  # sealed here over a chain that held the remembered entry
        found = db.execute("SELECT hash FROM chain WHERE delegation_id = ? AND seq = ?",
                           (delegation_id, mark.length)).fetchone()
        return found is None or _hex(found[0]) != mark.hash

    def trusts(self, delegation_id: str, head: chain.Head,
               registry: Callable[[], Registry]) -> bool:
        """Whether to extend ``head``: sealed by this process, or by a key the registry (as
        this process's pins root it) trusts. A chain whose head fails is left as it is, for
        ``tether verify`` to name, never sealed over."""
        if head.problem is not None:
            return False
        if head.length == 0 and not head.legacy and head.seal is None:
            return True  # a new delegation's head, made in this transaction
        if self.own.get(delegation_id) == (head.length, head.hash, head.legacy):
            return True
        if self.pins is None:
            return head.seal is None and head.legacy and head.length == 0
        return chain.seal_problem(delegation_id, head, registry()) is None

    def sealed(self, delegation_id: str, length: int, tip: str, legacy: bool = False,
               relaxed: bool = False) -> None:
        """A head this process sealed, once its batch committed (``relaxed``: without
        waiting for the disk)."""
        if len(self.own) >= self.MEMO:
            self.own.clear()
        self.own[delegation_id] = (length, tip, legacy)
        if self.witness is not None:
            pending = self.unsynced if relaxed else self.unconfirmed
            if len(pending) >= self.MEMO:
                pending.clear()  # unremembered then: a weaker witness, never a false one
            pending[delegation_id] = (length, tip)

    def synced(self) -> None:
        """A commit that wrote waited for the disk: every earlier commit is as durable."""
        if self.unsynced:
            if len(self.unconfirmed) + len(self.unsynced) > self.MEMO:
                self.unconfirmed.clear()
            self.unconfirmed.update(self.unsynced)
            self.unsynced = {}

    def committed(self, ran: list[Any]) -> None:
        """An awaited operation returned: the batch it last ran in (``noting``) committed, so
        the heads that batch sealed are remembered (once per batch, by the first of its
        operations to return)."""
        last = ran[-1] if ran else None
        sealed = last.sealed if isinstance(last, Tx) else None
        witness = self.witness
        if sealed and witness is not None and isinstance(last, Tx) and not last.relaxed:
            last.sealed = None
            for delegation_id, length, tip in sealed:
                witness.note(delegation_id, length, tip)


def noting(fn: Callable[[Any], T], ran: list[Any]) -> Callable[[Any], T]:
    """``fn``, keeping the connection of each batch it runs in (a batch that failed runs
    again on a new one): the last holds what its batch sealed (``seal``)."""

    def op(db: Any) -> T:
        ran.append(db)
        return fn(db)

    return op


def persist(*witnesses: HeadMemory | None, wait: bool = True) -> bool:
    """Hand the heads remembered since the last time to the configuration's key directory
    (``heads.jsonl``). A failure is logged and tried again at the next moment: the journal's
    own work goes on. Not ``wait``: never wait for the directory's lock (the event loop must
    not wait on another process); whether some were left because another process held it."""
    busy = False
    for witness in {id(w): w for w in witnesses if w is not None}.values():
        try:
            witness.persist(wait=wait)
        except Busy:
            busy = True
        except Exception as exc:
            log.warning("could not remember chain heads in the key directory: %s", exc)
    return busy


def verdicts(db: Db, delegation_ids: Sequence[str], registry: Registry,
             seen: Mapping[str, HeadMark | None], witness: HeadMemory | None,
             token: object = None) -> list[chain.ChainVerdict]:
    """Each delegation judged against its chain and the head its configuration remembered
    (``seen``, taken before the read began); each that verifies is accepted in turn, and
    remembered once on disk (``HeadMemory.accept``: it may be a commit, this process's or
    another's, that did not wait for the disk; ``read_back`` confirms it, through the same
    connection, ``token``)."""
    # This batch's own writes (``Tx.dirty``) are chained at its end, after this read: a record
    # it inserted has no entry yet, one it updated differs from its entry. Neither is anyone's
    # tampering, as long as the row it found was the one last sealed (its pre-image): a row
    # altered or inserted by hand before this batch wrote over it is still named.
    found_by = ({chain.record(t, pk): db.pre.get((t, pk), "") for t, pk in db.dirty}
                if isinstance(db, Tx) else {})
    found = []
    for d in delegation_ids:
        head, entries, rows = read(db, d)
        verdict = chain.judge(d, head, entries, rows, registry, seen.get(d))
        if found_by:
            sealed = {e.record: e.content for e in sorted(entries, key=lambda e: e.seq)}
            verdict.problems = [p for p in verdict.problems
                                if not _own_write(p, found_by, sealed)]
        if witness is not None and verdict.ok and head is not None:
            witness.accept(d, head.length, head.hash, token)
        elif witness is not None:
            witness.discard(d)
        found.append(verdict)
    return found


def _own_write(problem: chain.Problem, found_by: Mapping[str, str],
               sealed: Mapping[str, str]) -> bool:
    """A row this batch wrote, found as its chain last sealed it ("" for one it inserted)."""
    if problem.record not in found_by:
        return False
    if problem.problem.startswith("inserted: "):
        return found_by[problem.record] == ""
    if problem.problem.startswith("altered: "):
        return found_by[problem.record] == sealed.get(problem.record)
    return False


def read_back(db: Db, sealer: Sealer, readers: Sequence[HeadMemory | None] = (),
              token: object = None) -> None:
    """At a flush, everything queued before it has committed or failed: remember each head
    sealed and not yet confirmed whose entry the journal holds as sealed (the others never
    committed). Run by the writer thread, inside the flush's transaction. A flush that waits
    for the disk also puts on disk every head a read accepted before it (``readers``'
    ``accept``; its commit syncs the log past them, ``Tx.sync_log``): remembered once it
    committed, those read through this connection (``token``) alone, and only those the
    journal still holds, read in this transaction: a connection that outlived its server's
    crash (a transaction pooler's, which gives the client a new server session silently)
    would otherwise flush a new life of the server that lost them."""
    if isinstance(db, Tx) and not db.relaxed:
        for memory in {id(m): m for m in (sealer.witness, *readers) if m is not None}.values():
            accepted = {d: mark for d, mark in memory.pending(token).items()
                        if _holds(db, d, mark.length, mark.hash)}
            if accepted:
                db.sync_log = True
                db.after.append(functools.partial(memory.confirm, accepted))
    witness, pending = sealer.witness, sealer.unconfirmed
    sealer.unconfirmed = {}
    if witness is None:
        return
    for delegation_id, (length, tip) in pending.items():
        mark = witness.seen(delegation_id)
        if mark is not None and mark.length >= length:
            continue  # confirmed already (the operation that carried it returned)
        if _holds(db, delegation_id, length, tip):
            witness.note(delegation_id, length, tip)


def _holds(db: Db, delegation_id: str, length: int, tip: str) -> bool:
    """Whether the journal holds this head: its chain's entry at ``length`` is ``tip``."""
    found = db.execute("SELECT hash FROM chain WHERE delegation_id = ? AND seq = ?",
                       (delegation_id, length)).fetchone()
    return found is not None and _hex(found[0]) == tip


# A delegation's own rows, per chained table (an event may name only its action).
_OWN_ROWS = {
    "delegations": "id = ?",
    "actions": "delegation_id = ?",
    "controls": "delegation_id = ?",
    "documents": "delegation_id = ?",
    "events": "delegation_id = ? OR (delegation_id IS NULL AND action_id IN "
              "(SELECT id FROM actions WHERE delegation_id = ?))",
}


def _rows(db: Db, keys: Sequence[tuple[str, Any]]) -> dict[tuple[str, Any], Any]:
    """The rows named, read a table at a time."""
    by_table: dict[str, list[Any]] = {}
    for table, pk in keys:
        by_table.setdefault(table, []).append(pk)
    found: dict[tuple[str, Any], Any] = {}
    for table, pks in by_table.items():
        for part in chunks(pks):
            for row in db.execute(f"SELECT {chain.COLUMNS[table]} FROM {table} WHERE id IN "
                                  f"({marks(part)})", tuple(part)).fetchall():
                found[(table, row[0])] = row
    return found


@functools.lru_cache(maxsize=64)
def _entries_insert(rows: int) -> str:
    return CHAIN.insert(CHAIN.names, " ON CONFLICT DO NOTHING RETURNING delegation_id, seq",
                        rows=rows)


def _entries(db: Db, plan: Sequence[tuple[Any, ...]]) -> bool:
    """Insert the planned entries; False (and nothing inserted) if any was there already.
    The rows this call inserted are deleted again rather than rolled back to a savepoint:
    two statements fewer (round trips, on PostgreSQL) in the common case."""
    inserted: list[Any] = []
    for part in chunks(plan):
        inserted += db.execute(_entries_insert(len(part)),
                               tuple(v for entry in part for v in entry)).fetchall()
    if len(inserted) == len(plan):
        return True
    for delegation_id, seq in inserted:  # exactly the rows made here (the key is unique)
        db.execute("DELETE FROM chain WHERE delegation_id = ? AND seq = ?", (delegation_id, seq))
    return False


def seal(db: Conn, dirty: Sequence[tuple[str, Any]], sealer: Sealer, now: float) -> None:
    """Chain and seal what this transaction wrote (see the module's docstring)."""
    read: list[Registry] = []

    def registry() -> Registry:  # read once per batch, and only if a foreign head moved
        if not read:
            assert sealer.pins is not None
            read.append(trustops.registry(db, sealer.pins))
        return read[0]

    signer = sealer.signer
    pre: dict[tuple[str, Any], str] = db.pre if isinstance(db, Tx) else {}
    keys = list(dict.fromkeys(dirty))
    rows = _rows(db, keys)
    # delegation -> record -> (content, the row as this transaction found it); last wins
    records: dict[str, dict[str, tuple[str, str]]] = {}
    for table, pk in keys:
        row = rows.get((table, pk))
        if row is None:  # written and removed again in this transaction
            continue
        owner = chain.owner_of(table, row)
        if owner is None and table == "events" and row[2] is not None:
            owner = _action_owner(db, row[2])
        if owner is not None:
            records.setdefault(owner, {})[chain.record(table, pk)] = (
                chain.content_hash(row), pre.get((table, pk), ""))
    ids = sorted(records)
    heads: dict[str, chain.Head] = {}
    found_heads: dict[str, Any] = {}
    for part in chunks(ids):  # locked in id order (PostgreSQL): appenders queue, never fork
        for found_head in db.execute(
                f"SELECT {_OWN}, h.delegation_id FROM chain_heads h WHERE h.delegation_id IN "
                f"({marks(part)}) ORDER BY h.delegation_id /*XLOCK h*/", tuple(part)).fetchall():
            found_heads[str(found_head[9])] = found_head
    # The seals the locked heads name, but for heads this process sealed last (trusted on
    # that alone): none of them can go while its head is locked (a seal goes only with the
    # last head that names it, by its writer or a prune).
    ours = {d for d, f in found_heads.items() if sealer.own.get(d) == (f[0], f[1], bool(f[2]))}
    named = sorted({f[7] for d, f in found_heads.items() if d not in ours and type(f[7]) is int})
    seals: dict[int, Any] = {}
    for few in chunks(named) if named else ():
        seals.update((r[0], r[1:]) for r in db.execute(
            f"SELECT id, seal, signer, signature FROM chain_seals WHERE id IN ({marks(few)})",
            tuple(few)).fetchall())
    for delegation_id, f in found_heads.items():
        heads[delegation_id] = _head((*f[:9], *seals.get(f[7], _UNNAMED)),
                                     sealer.own.get(delegation_id))
    witness = sealer.witness
    if witness is not None and any(h.length for h in heads.values()):
        witness.refresh()  # once a batch: what the configuration's other processes saw
    plan: list[tuple[Any, ...]] = []
    ends: dict[str, tuple[int, str, bool]] = {}
    for delegation_id in ids:
        head = heads.get(delegation_id)
        if head is None:
            # A delegation this transaction created (nobody else can see it yet); or one
            # whose head was deleted by hand, whose entries then refuse the appends below.
            db.execute(_NEW_HEAD, (delegation_id, 0, ""))
            head = chain.Head(0, "", False, None, None)
        if not sealer.trusts(delegation_id, head, registry) or \
                sealer.older(db, delegation_id, head):
            # Its head was rewritten by hand, or rolled back: sealing over it would make that
            # the writer's own. Leave it as it is, for ``tether verify`` to name.
            continue
        length, tip = head.length, head.hash
        for rec, (content, found) in records[delegation_id].items():
            length += 1
            tip = chain.entry_hash(tip, delegation_id, length, rec, content, found)
            plan.append((delegation_id, length, rec, bytes.fromhex(content),
                         bytes.fromhex(found), bytes.fromhex(tip)))
        ends[delegation_id] = (length, tip, head.legacy)
    if plan and not _entries(db, plan):
        # Entries beyond some head: rolled back by hand. Append chain by chain, leaving any
        # such chain as it is.
        for delegation_id in list(ends):
            if not _entries(db, [e for e in plan if e[0] == delegation_id]):
                del ends[delegation_id]
    moved = [(d, *ends[d]) for d in ids if d in ends]
    if not moved:
        return
    # The seals the moved heads named: each goes in this commit if no head names it now.
    was = sorted({s for d, *_ in moved if type(s := found_heads.get(d, _NONE)[7]) is int})
    steps: list[Step] = []
    if signer is None:
        steps.append(("UPDATE chain_heads SET length = ?, hash = ?, path = NULL, seal = NULL, "
                      "signer = NULL, signature = NULL, seal_id = NULL, proof = NULL "
                      "WHERE delegation_id = ?", [(length, tip, d) for d, length, tip, _ in moved],
                      True))
        new = None
    elif len(moved) == 1:
        # One head: its seal kept in its own row (a seal row would be named by it alone),
        # an insert and a delete fewer for a child acting alone.
        ((delegation_id, length, tip, _),) = moved
        signed = signer.sign(ChainSeal(chain.leaf(*moved[0]), 1, now))
        steps.append(("UPDATE chain_heads SET length = ?, hash = ?, path = NULL, seal = ?, "
                      "signer = ?, signature = ?, seal_id = NULL, proof = ? "
                      "WHERE delegation_id = ?", (length, tip, signed.body, signed.key_id,
                                                  signed.signature, b"", delegation_id), False))
        new = None
    else:
        root, proofs = chain.merkle_proofs([chain.leaf(*m) for m in moved])
        signed = signer.sign(ChainSeal(root, len(moved), now))
        # Its id from its signature, not from the database: the seal and its heads go in one
        # round trip. Two seals share an id with odds of 2**-63 (the second insert then fails,
        # and its batch with it, as a JournalError); no counter a lost commit could wind
        # back hands an id out twice.
        new = int.from_bytes(hashlib.sha256(signed.signature).digest()[:8], "big") >> 1
        steps.append(("INSERT INTO chain_seals (id, seal, signer, signature) VALUES (?, ?, ?, ?)",
                      (new, signed.body, signed.key_id, signed.signature), False))
        steps.append((
            "UPDATE chain_heads SET length = ?, hash = ?, path = NULL, seal = NULL, "
            "signer = NULL, signature = NULL, seal_id = ?, proof = ? WHERE delegation_id = ?",
            [(length, tip, new, proof, delegation_id)
             for (delegation_id, length, tip, _), proof in zip(moved, proofs, strict=True)], True))
    for few in chunks(was) if was else ():
        steps.append((_UNNAMED_SEALS.format(marks(few)), tuple(few), False))
    if new is not None:
        sealer.shared += 1
        if sealer.shared % _SWEEP_EVERY == 0:
            # And, now and then, the unnamed seals of a slice of the ids from this one on:
            # those two commits left, each seeing the other's head still naming it, are
            # found without a prune; the seals' ids are spread evenly (hashes).
            steps.append((_UNNAMED_SLICE, (new, min(new + _SLICE, 2**63 - 1)), False))
    db.send(steps, last=True)  # the sealer runs after every operation of the batch
    if isinstance(db, Tx):  # a batch's connection: confirmed after COMMIT
        db.sealed = [(d, length, tip) for d, length, tip, _ in moved]
        # The heads this process sealed are its own once they committed: a batch whose
        # COMMIT fails leaves heads that never were, which an intruder could write in.
        db.after.append(functools.partial(_sealed, sealer, moved, db.relaxed))
    else:
        _sealed(sealer, moved, False)


def _sealed(sealer: Sealer, moved: list[tuple[str, int, str, bool]], relaxed: bool) -> None:
    if not relaxed:
        sealer.synced()  # this batch wrote (its chain entries) and waited for the disk
    for delegation_id, length, tip, legacy in moved:
        sealer.sealed(delegation_id, length, tip, legacy, relaxed)


def _head(found: Any, own: tuple[int, str, bool] | None = None) -> chain.Head:
    """A head from its row (``_HEAD``'s columns): its seal in its own row (sealed alone, or
    by version 6 with its path as text) or the one it names (``seal_id``), with its path as
    bytes (``proof``)."""
    if not (type(found[0]) is int and isinstance(found[1], str)
            and type(found[2]) is int and (found[3] is None or isinstance(found[3], str))
            and (found[5] is None or isinstance(found[5], str))
            and (found[7] is None or type(found[7]) is int)
            and (found[8] is None or isinstance(found[8], bytes | bytearray | memoryview))):
        # SQLite columns take any type: written by hand. Named, never a crash.
        return chain.Head(0, "", False, None, None, problem=(
            "the chain's head row is malformed (a column of the wrong type: written by hand)"))
    length, tip, legacy = int(found[0]), str(found[1]), bool(found[2])
    named = found[7] is not None
    proof = None if found[8] is None else blob(found[8])
    path = None if named or proof is not None or found[3] is None else str(found[3])
    if own == (length, tip, legacy):
        # The head this process sealed last (``Sealer.own``): trusted and extended on that
        # alone, so its seal is not decoded (a head each in every batch of a busy writer).
        return chain.Head(length, tip, legacy, path, None, proof=proof)
    body, signer, signature = found[9:12] if named else found[4:7]
    seal = None
    if body is not None and signer is not None and signature is not None:
        try:
            seal = Signed(blob(body), str(signer), blob(signature))
        except TypeError:  # written by hand as text: verifies under no key
            seal = Signed(b"", str(signer), b"")
    return chain.Head(length, tip, legacy, path, seal, proof=proof)


_SETTLE = 20  # reads of a delegation its writers keep moving, before its head is locked


def _same(a: Any, b: Any) -> bool:
    return (None if a is None else tuple(map(chain.plain, a))) == (
        None if b is None else tuple(map(chain.plain, b)))


def read(db: Db, delegation_id: str
         ) -> tuple[chain.Head | None, list[chain.Entry], dict[str, str]]:
    """One delegation's head, entries, and the hash of every row that is its record now or
    that its chain names: as of one moment. On PostgreSQL a read runs at READ COMMITTED (or
    inside a write batch), where each statement sees what committed before it: a writer that
    commits between the head and the rows would read as entries beyond the head or rows
    newer than their entries, a false alarm. Every commit that writes a record moves its
    head, so the head is read again after the rest: unchanged, the rest is of its moment;
    moved, the read is done again, and at last under a share lock on the head (which a writer
    takes exclusively before it commits). SQLite's read transaction is a snapshot already."""
    for attempt in range(_SETTLE + 1):
        lock = attempt == _SETTLE
        if lock:
            db.execute("SELECT 1 FROM chain_heads h WHERE delegation_id = ? /*LOCK h*/",
                       (delegation_id,)).fetchall()
        found = db.execute(_HEAD, (delegation_id,)).fetchone()
        got = _read_at(db, delegation_id, found)
        if lock or _same(found, db.execute(_HEAD, (delegation_id,)).fetchone()):
            return got
    raise AssertionError("unreachable")


def _read_at(db: Db, delegation_id: str, found: Any
             ) -> tuple[chain.Head | None, list[chain.Entry], dict[str, str]]:
    entries, bad = [], None
    for r in db.execute("SELECT seq, record, content, pre, hash FROM chain "
                        "WHERE delegation_id = ? ORDER BY seq", (delegation_id,)).fetchall():
        if type(r[0]) is int and isinstance(r[1], str) and all(
                isinstance(v, bytes | bytearray | memoryview) for v in r[2:]):
            entries.append(chain.Entry(r[0], r[1], bytes(r[2]).hex(), bytes(r[3]).hex(),
                                       bytes(r[4]).hex()))
        elif bad is None:
            bad = f"chain entry {r[0]!r} is malformed (a column of the wrong type: written by hand)"
    rows: dict[str, str] = {}
    for table, where in _OWN_ROWS.items():
        params = (delegation_id,) * where.count("?")
        for r in db.execute(f"SELECT {chain.COLUMNS[table]} FROM {table} WHERE {where}",
                            params).fetchall():
            rows[chain.record(table, r[0])] = chain.content_hash(r)
    for rec in sorted({e.record for e in entries} - set(rows)):
        # Named by the chain but no longer the delegation's (moved to another by hand), or
        # gone: read it where it is, if anywhere.
        kind, _, pk = rec.partition(" ")
        named = chain.TABLE.get(kind)
        if named is None:
            continue
        if named in ("controls", "documents", "events"):
            if not (pk.isascii() and pk.isdigit() and len(pk) < 19):
                continue  # no such row can exist: it reads as deleted
            elsewhere = _row(db, named, int(pk))
        else:
            elsewhere = _row(db, named, pk)
        if elsewhere is not None:
            rows[rec] = chain.content_hash(elsewhere)
    head = None if found is None else _head(found)
    if head is not None and bad is not None and head.problem is None:
        head = dataclasses.replace(head, problem=bad)
    return head, entries, rows
