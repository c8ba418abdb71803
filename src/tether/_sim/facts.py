"""What the judge reads of a production-engine trial: the journal's rows, ordered by commit.

Every write batch that commits on the shared journal is numbered here (``Commits.landed``,
called by the runner right after its COMMIT), with the records it wrote (the batch's chain
records, handed to the sealer). From that the judge gets what it compares with the ledger:
the commit at which each intent landed, the commit of the first recall or terminate accepted
on each delegation (its fence), every stop that settled a delegation while one of its
calls could still apply, and every delegation that ended while a child it started was still
RUNNING. The rows themselves are read from the journal at the end.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any

from tether._core.model import ActionState, DelegationState
from tether._journal.inline import MemorySqlite

_STOPPING = (DelegationState.RECALLING.value, DelegationState.TERMINATING.value)
_FENCING = ("RECALL", "TERMINATE")


@dataclass(slots=True)
class DelegationFact:
    id: str
    task_id: str
    parent_id: str | None
    epoch: int
    attempt: int
    state: DelegationState
    fence_seq: int | None = None


@dataclass(slots=True)
class ActionFact:
    id: str
    delegation_id: str
    key: str
    state: ActionState
    seq: int


@dataclass
class View:
    """The judge's facts (``judge.Facts``)."""

    rows: dict[str, DelegationFact]
    actions: dict[str, ActionFact]
    by_key: dict[str, list[ActionFact]]
    early: list[tuple[str, str, str]] = field(default_factory=list)
    orphans: list[tuple[str, str, str]] = field(default_factory=list)


def one(cursor: sqlite3.Cursor) -> Any:
    """The first row, read to the end: a statement left unfinished holds its table's
    shared-cache read lock, and the simulated processes' next write would find it locked
    (when it is finished then depends on when the cursor is freed, which is no part of a
    seed)."""
    rows = cursor.fetchall()
    return rows[0] if rows else None


class Commits:
    def __init__(self, anchor: sqlite3.Connection) -> None:
        self.anchor = anchor
        self.seq = 0
        self.intents: dict[str, int] = {}  # action id -> the commit of its intent
        self.fences: dict[str, int] = {}  # delegation id -> its first fencing control's commit
        self.states: dict[str, str] = {}  # delegation id -> its state as last committed
        self.early: list[tuple[str, str, str]] = []
        self.orphans: list[tuple[str, str, str]] = []  # ended while a child still ran

    def watch(self, runner: MemorySqlite) -> None:
        """Keep, for each batch of ``runner``, the records it hands its sealer."""
        inner = runner.sealer

        def sealer(db: Any, dirty: list[tuple[str, Any]]) -> None:
            runner.staged = list(dirty)
            if inner is not None:
                inner(db, dirty)

        runner.sealer = sealer

    def landed(self, runner: MemorySqlite) -> None:
        staged, runner.staged = runner.staged, []
        if not staged:
            return
        self.seq += 1
        db = self.anchor
        for table, pk in staged:
            if table == "actions":
                self.intents.setdefault(pk, self.seq)
            elif table == "controls":
                row = one(db.execute("SELECT delegation_id, kind FROM controls WHERE id = ?",
                                     (pk,)))
                if row is not None and row[1] in _FENCING:
                    self.fences.setdefault(row[0], self.seq)
            elif table == "delegations":
                row = one(db.execute("SELECT state FROM delegations WHERE id = ?", (pk,)))
                if row is None:
                    continue
                before, now = self.states.get(pk), row[0]
                self.states[pk] = now
                if DelegationState(now).terminal and (before is None or not
                                                       DelegationState(before).terminal):
                    # Ended: no child it started may still run (its code could still pay).
                    running = [r[0] for r in db.execute(
                        "SELECT id FROM delegations WHERE parent_id = ? AND state = ?",
                        (pk, DelegationState.RUNNING.value))]
                    if running:
                        self.orphans.append((pk, now, ", ".join(running)))
                if before in _STOPPING and DelegationState(now).terminal:
                    # A stop's report is final: none of the node's calls may still apply.
                    open_calls = [r[0] for r in db.execute(
                        "SELECT id FROM actions WHERE delegation_id = ? AND state IN (?, ?)",
                        (pk, ActionState.PENDING.value, ActionState.IN_DOUBT.value))]
                    if open_calls:
                        self.early.append((pk, now, ", ".join(open_calls)))

    def remember(self) -> Any:
        """What ``landed`` recorded so far, for a lost server to put back (``Server``): the
        commits it loses never happened. What was judged meanwhile (``early``, ``orphans``)
        stays: a report made from a lost commit was made all the same."""
        return dict(self.intents), dict(self.fences), dict(self.states)

    def restore(self, memo: Any) -> None:
        self.intents, self.fences, self.states = (dict(m) for m in memo)

    def view(self) -> View:
        db = self.anchor
        rows = {r[0]: DelegationFact(r[0], r[1], r[2], int(r[3]), int(r[4]),
                                     DelegationState(r[5]), self.fences.get(r[0]))
                for r in db.execute("SELECT id, task_id, parent_id, epoch, attempt, state "
                                    "FROM delegations ORDER BY id")}
        actions = {r[0]: ActionFact(r[0], r[1], r[2], ActionState(r[3]),
                                    self.intents.get(r[0], 0))
                   for r in db.execute("SELECT id, delegation_id, idem_key, state FROM actions "
                                       "ORDER BY id")}
        by_key: dict[str, list[ActionFact]] = {}
        for a in actions.values():
            by_key.setdefault(a.key, []).append(a)
        return View(rows, actions, by_key, list(self.early), list(self.orphans))


__all__ = ["ActionFact", "Commits", "DelegationFact", "View", "one"]
