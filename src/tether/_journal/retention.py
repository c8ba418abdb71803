"""Journal operations for retention: the records of whole delegation trees (for ``tether
export``), and pruning the trees ``_core.retention`` allows (for ``tether prune``)."""

from __future__ import annotations

import base64
from typing import Any

from tether._core.model import ActionState, DelegationState
from tether._core.retention import AWAITING_PERSON, CallFacts, NodeFacts, prunable
from tether._journal.ops import actions, controls, documents, events, subtree
from tether._journal.tables import MAX_DEPTH, SUBTREE, Db, chunks, event, marks

_SETTLED = tuple(s.value for s in DelegationState if s.terminal and s not in AWAITING_PERSON)


def roots(db: Db, *, since: float | None, until: float | None, after: str | None,
          limit: int, settled_only: bool = False) -> list[str]:
    """Root delegations created in [since, until), oldest first, a page after ``after``."""
    where: list[str] = ["parent_id IS NULL"]
    params: list[Any] = []
    if since is not None:
        where.append("created_at >= ?")
        params.append(since)
    if until is not None:
        where.append("created_at < ?")
        params.append(until)
    if settled_only:
        where.append(f"state IN ({', '.join('?' * len(_SETTLED))})")
        params.extend(_SETTLED)
    if after is not None:
        where.append("(created_at > (SELECT created_at FROM delegations WHERE id = ?) OR "
                     "(created_at = (SELECT created_at FROM delegations WHERE id = ?) "
                     "AND id > ?))")
        params.extend((after, after, after))
    rows = db.execute(f"SELECT id FROM delegations WHERE {' AND '.join(where)} "
                      "ORDER BY created_at, id LIMIT ?", (*params, limit)).fetchall()
    return [r[0] for r in rows]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def tree_records(db: Db, root_id: str) -> list[dict[str, Any]]:
    """Every record of one tree, JSON-ready; signed ones with their exact bytes (body as
    text, signature in base64) so that an archive can be verified on its own."""
    rows = subtree(db, root_id)
    ids = [r.id for r in rows]
    out: list[dict[str, Any]] = [{"record": "delegation", **r.to_json()} for r in rows]
    out += [{"record": "action", **a.to_json()} for a in actions(db, ids)]
    for d in ids:
        for c in controls(db, d):
            out.append({"record": "control", "id": c.id, "delegation": d, "seq": c.seq,
                        "kind": c.kind.value, "issuer": c.issuer, "accepted_at": c.accepted_at,
                        "key_id": c.signed.key_id, "body": c.signed.body.decode("utf-8"),
                        "signature": _b64(c.signed.signature)})
        for doc in documents(db, d):
            out.append({"record": "document", "id": doc.id, "delegation": d, "seq": doc.seq,
                        "type": doc.type, "recorded_at": doc.recorded_at,
                        "key_id": doc.signed.key_id, "body": doc.signed.body.decode("utf-8"),
                        "signature": _b64(doc.signed.signature)})
    out += [{"record": "event", "id": e.id, "at": e.at, "kind": e.kind,
             "delegation": e.delegation_id, "action": e.action_id, "detail": e.detail}
            for e in events(db, ids)]
    return out


def roots_of(db: Db, ids: list[str]) -> set[str]:
    """The roots among ``ids``."""
    return {r[0] for part in chunks(ids) for r in db.execute(
        f"SELECT id FROM delegations WHERE parent_id IS NULL AND id IN ({marks(part)})",
        part).fetchall()}


# Trees judged together at most (a task shared by more trees than this: kept, as it stands).
_TOGETHER = 1000


def _trees(db: Db, roots: set[str], group: set[str] | None = None
           ) -> tuple[list[str], dict[str, bool]] | None:
    """The trees of ``roots``, grown until no task of theirs has a delegation in a tree left
    out: their ids (each tree parents first) and whether each node's tree is superseded (its
    root's epoch was re-delegated since; a node's own epoch counts its own task's moves).
    ``group`` gets every id read, also when there are too many trees to judge together."""
    superseded = {} if group is None else _Noting(group)
    read: set[str] = set()  # roots whose trees are read already
    new = set(roots)
    while new:
        if len(read) + len(new) > _TOGETHER:
            return None
        for root in sorted(new):
            found = db.execute("SELECT d.epoch, t.epoch FROM delegations d JOIN tasks t ON "
                               "t.id = d.task_id WHERE d.id = ?", (root,)).fetchone()
            later = found is not None and found[0] < found[1]
            for n in db.execute(f"{SUBTREE} SELECT d.id FROM delegations d JOIN sub "
                                "ON sub.id = d.id ORDER BY sub.depth", (root,)).fetchall():
                superseded[n[0]] = later
        read |= new
        more: set[str] = set()
        for part in chunks(list(superseded)):
            more.update(r[0] for r in db.execute(
                "WITH RECURSIVE up(id, parent_id, depth) AS (SELECT d.id, d.parent_id, 0 "
                "FROM delegations d WHERE d.task_id IN (SELECT task_id FROM delegations WHERE "
                f"id IN ({marks(part)})) UNION ALL SELECT p.id, p.parent_id, up.depth + 1 "
                f"FROM delegations p JOIN up ON p.id = up.parent_id WHERE up.depth < "
                f"{MAX_DEPTH}) SELECT DISTINCT id FROM up WHERE parent_id IS NULL",
                part).fetchall())
        new = more - read
    return list(superseded), superseded


class _Noting(dict[str, bool]):
    """A dict that notes each key set in ``into`` as well."""

    def __init__(self, into: set[str]) -> None:
        super().__init__()
        self.into = into

    def __setitem__(self, key: str, value: bool) -> None:
        self.into.add(key)
        super().__setitem__(key, value)


def tree_prunable(db: Db, root_id: str, before: float, now: float,
                  tolerance: float, group: set[str] | None = None) -> list[str] | None:
    """The ids of the trees that go with ``root_id``'s if they may all be pruned, else None.

    A task's idempotency keys (``task:tool:n``) are shared by all its attempts and epochs: a
    later one replays the receipts its predecessors recorded (I7), and may be a root of its
    own or a child in another tree (a Temporal workflow id that runs on its own and as a
    child workflow). So a tree goes only with every tree that holds a delegation of one of its
    tasks (all roots of its task, each with its subtree, and so on), and only if all of them
    may go: pruning one while another may still call would have the journal forget a payment
    and run it again. ``group`` gets the ids of every tree judged with it (whatever the
    verdict: the same for each root among them), so a caller judges a group once."""
    if db.execute("SELECT 1 FROM delegations WHERE id = ? AND parent_id IS NULL",
                  (root_id,)).fetchone() is None:
        return None
    found = _trees(db, {root_id}, group)
    if found is None or not found[0]:
        return None
    ids, superseded = found
    # Locked (PostgreSQL) before they are judged, actions first as a receipt locks them (its
    # action, then its delegations): a receipt that commits first is read here, and one that
    # comes later waits for the prune and finds its action gone (``finish_action``). Unlocked,
    # a receipt committed between this check and the delete went with the tree.
    marks = ", ".join("?" * len(ids))
    calls = db.execute(f"SELECT state, deadline_at FROM actions a WHERE delegation_id IN "
                       f"({marks}) ORDER BY id /*XLOCK a*/", ids).fetchall()
    states = {r[0]: (r[1], r[2]) for r in db.execute(
        f"SELECT id, state, ended_at FROM delegations d WHERE id IN ({marks}) "
        "ORDER BY id /*XLOCK d*/", ids).fetchall()}
    nodes = [(i, *states[i]) for i in ids if i in states]
    # Read again under those locks: the same trees. A writer that moves a task to a new epoch
    # locks a delegation of the epoch it moves from first (``ops.create_delegation``): one
    # that committed before the locks is read here and keeps the trees; a later one waits,
    # and finds its epoch gone.
    again = _trees(db, {root_id})
    if again is None or set(again[0]) != set(ids):
        return None
    ok = prunable([NodeFacts(DelegationState(n[1]), n[2], superseded=superseded[n[0]])
                   for n in nodes],
                  [CallFacts(ActionState(c[0]), c[1]) for c in calls], before=before, now=now,
                  tolerance=tolerance)
    return ids if ok and len(nodes) == len(ids) else None


def prune(db: Db, root_ids: list[str], before: float, now: float,
          archive: dict[str, Any] | None, tolerance: float) -> dict[str, Any]:
    """Delete the trees that may still be pruned (each re-checked here, in the transaction),
    and record what went, and where its archive is, as a ``pruned`` event that stays."""
    gone: list[str] = []
    kept: list[str] = []
    listed = set(root_ids)
    judged: dict[str, bool] = {}  # each id of a group judged, and whether the group goes
    for root in root_ids:
        if root in judged:  # with a root listed before it (a task's other attempts)
            if not judged[root]:
                kept.append(root)
            continue
        group: set[str] = set()
        ids = tree_prunable(db, root, before, now, tolerance, group)
        goes = ids is not None and roots_of(db, ids) <= listed
        judged.update(dict.fromkeys(group | {root}, goes))
        if not goes:
            # Not prunable, or it goes only with a tree the caller did not list (and so did
            # not archive): kept. ``Journal.prunable`` lists every root that goes with each.
            kept.append(root)
        else:
            gone.extend(ids or ())
    n_actions = 0
    for part in chunks(gone):
        marks = ", ".join("?" * len(part))
        acts = [r[0] for r in db.execute(
            f"SELECT id FROM actions WHERE delegation_id IN ({marks})", part).fetchall()]
        n_actions += len(acts)
        for apart in chunks(acts):
            db.execute(f"DELETE FROM events WHERE action_id IN ({', '.join('?' * len(apart))})",
                       apart)
        db.execute(f"DELETE FROM events WHERE delegation_id IN ({marks})", part)
        # A pruned delegation goes with its chain (docs/security.md: prune is a trusted
        # operation; the `pruned` event says what went).
        for table in ("actions", "controls", "documents", "queue", "chain", "chain_heads"):
            db.execute(f"DELETE FROM {table} WHERE delegation_id IN ({marks})", part)
    # Deepest first (each tree's ids are parents before children), so that no row is ever
    # left pointing at a deleted parent; the tasks stay (their ids are never handed out again).
    for part in chunks(gone[::-1], 10_000):
        db.execute(f"DELETE FROM delegations WHERE id IN ({', '.join('?' * len(part))})", part)
    # The seals no head names any more: their heads pruned, or moved on by commits that could
    # not tell (a rival deleting it meanwhile). A seal still being written has no committed
    # row yet; one a writer is deleting now is skipped.
    db.execute("DELETE FROM chain_seals WHERE id IN (SELECT id FROM chain_seals s WHERE NOT "
               "EXISTS (SELECT 1 FROM chain_heads h WHERE h.seal_id = s.id) /*SKIP s*/)")
    summary = {"before": before, "roots": len(root_ids) - len(kept), "delegations": len(gone),
               "actions": n_actions, "kept": kept, **({"archive": archive} if archive else {})}
    event(db, now, "pruned", None, None, **summary)
    return summary
