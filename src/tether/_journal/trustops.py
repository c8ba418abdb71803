"""The key registry's operations, each run inside one transaction by a backend."""

from __future__ import annotations

from typing import Any

from tether._core.columns import TRUST
from tether._core.documents import KeyGrant
from tether._core.errors import UserError
from tether._core.signing import Signed, SigningKey, TrustedKeys
from tether._core.trust import Registry, effective
from tether._journal.tables import Db, Tx, event, signed_of


def entries(db: Db) -> list[tuple[int, Signed]]:
    rows = db.execute("SELECT id, body, signer, signature FROM trust ORDER BY id").fetchall()
    return [(int(r[0]), _entry(r)) for r in rows]


def _entry(r: Any) -> Signed:
    """An entry whose columns are not even bytes (written by hand) verifies under no key: it
    is ignored and listed like any other entry that does not verify, never a crash."""
    try:
        return signed_of(r[1], r[2], r[3])
    except TypeError:
        return Signed(b"", str(r[2]), b"")


# Replaying the registry checks every entry's signature; it changes rarely, so the result is
# remembered per (pins, entries): one small read per acceptance, no signature re-checked.
_MEMO: dict[tuple[tuple[str, ...], tuple[tuple[int, Signed], ...], object], Registry] = {}


def registry(db: Db, pins: TrustedKeys) -> Registry:
    """The registry as ``pins`` root it, checked against what their configuration remembers
    of it (``pins.memory``), which a registry read whole and genuine then advances."""
    rows = tuple(entries(db))
    memory = pins.memory
    if memory is not None:
        memory.refresh()  # another process of the configuration may have seen more
    seen = None if memory is None else memory.seen
    key = (tuple(pins.ids()), rows, None if memory is None else (memory.token, memory.version))
    found = _MEMO.get(key)
    if found is None:
        if len(_MEMO) > 64:
            _MEMO.clear()
        found = _MEMO[key] = effective(pins, rows, seen)
    anchor, mark = found.anchor, found.mark
    if memory is not None and anchor is not None and mark is not None and \
            memory.news(anchor, mark):
        if isinstance(db, Tx) and db.trust_written:
            # Read after this batch wrote an entry: remembered once the batch committed. One
            # rolled back (and run again, on PostgreSQL with another id for the entry) must
            # leave no mark of a registry that never was. Any other read holds committed
            # entries alone and is remembered at once, whatever becomes of its batch: a
            # revocation read by a write that then fails is not forgotten.
            db.after.append(lambda: memory.advance(anchor, mark))
        else:
            memory.advance(anchor, mark)
    return found


def _insert(db: Db, grant: KeyGrant, signed: Signed, now: float, conflict: str = "") -> int:
    if isinstance(db, Tx):
        db.trust_written = True
    cur = db.execute(
        TRUST.insert(TRUST.pick(without=("id",)), conflict),
        (grant.op, grant.key_id, signed.body, signed.key_id, signed.signature, now))
    return int(cur.rowcount)


def genesis(db: Db, signer: SigningKey, now: float) -> None:
    """Record the journal's root key, unless one is recorded already (first writer wins).
    A journal with no delegation older than its chain says so in its signed root entry
    (``chained``): a chain head marked legacy is then never believed (``_core.chain``)."""
    if db.execute("SELECT 1 FROM trust WHERE op = 'root'").fetchone() is not None:
        return
    legacy = db.execute("SELECT 1 FROM chain_heads WHERE legacy = 1 LIMIT 1").fetchone()
    grant = KeyGrant("root", signer.key_id, signer.public_b64(), signer.label, now,
                     extra={} if legacy else {"chained": True})
    if _insert(db, grant, signer.sign(grant), now, " ON CONFLICT DO NOTHING") == 1:
        event(db, now, "key_root", None, None, key=grant.key_id, label=grant.label)


def add(db: Db, signed: Signed, grant: KeyGrant, pins: TrustedKeys, now: float) -> Registry:
    """A ``trust`` or ``revoke`` entry, accepted only if its signer is trusted now."""
    current = registry(db, pins)
    current.verify(signed, KeyGrant)
    if grant.op == "revoke" and grant.key_id == current.root:
        raise UserError(f"key {grant.key_id} is this journal's root; it cannot be revoked")
    if grant.op == "trust" and grant.key_id in current.revoked:
        raise UserError(f"key {grant.key_id} was revoked in this journal; a revoked key is "
                        "never trusted again: make a new key ('tether keys init') and trust it")
    if grant.op == "revoke" and grant.key_id not in current.keys:
        raise UserError(f"key {grant.key_id} is not trusted by this journal; nothing to revoke")
    _insert(db, grant, signed, now)
    event(db, now, f"key_{grant.op}", None, None, key=grant.key_id, by=signed.key_id)
    return registry(db, pins)
