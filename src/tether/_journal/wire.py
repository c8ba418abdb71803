"""The PostgreSQL writer's connection: fewer round trips a batch, the same batch.

What a batch sends without reading a reply (BEGIN with the commit marker, a savepoint's start
and release, the seal's last statements: ``Wire.later``) waits for the next message: a read of
ids, keys and hashes (``Wire.replies``: the row a write is about to change, an intent's gate
and its key's earlier uses) or the COMMIT. Only statements that cannot fail but by a lost
connection or a server that refuses every write (a standby, a revoked grant) wait, and an
operation that ends with its transaction aborted fails then (``Wire.check``): an error is
never met by another operation's statement, whose savepoint would be undone in its place.

A merged message is one simple query, as ``PgDb.send``'s: the server has all of it before it
runs any, and waits idle in the transaction once it ran, where the idle timeout still ends a
session whose process was paused (a pipeline's statements reach the server before their
Sync, and a process paused in between leaves it active, holding its locks). Its values are
bound as literals, which the server's log shows with any error: ids, keys and hashes go in
one, never a call's arguments, results or errors; any other statement is sent after what
waited, bound by the server. A rollback takes back what waited with it, unsent.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors, pq

from tether._journal.tables import Reply

# Transaction control whose reply nobody reads, as the runner writes it.
CONTROL = re.compile(r"(SAVEPOINT|RELEASE SAVEPOINT|ROLLBACK TO SAVEPOINT) (\w+)|(ROLLBACK)")
_IDLE, _FAILED = pq.TransactionStatus.IDLE, pq.TransactionStatus.INERROR


class Wire(psycopg.Connection[Any]):
    """See the module's docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._later: list[str] = []  # statement texts, values bound
        self._first: str | None = None  # the error that aborted this transaction

    def later(self, text: str) -> None:
        if text.startswith("BEGIN"):
            if self.info.transaction_status != _IDLE or self._later:
                # A batch that failed past the runner's rollback (it fails whole, and the
                # thread goes on) must not leave its transaction to the next one.
                self._later = []
                super().execute("ROLLBACK")
            self._first = None
        self._later.append(text)

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool = False) -> psycopg.Cursor[Any]:
        if isinstance(query, str):
            if (control := CONTROL.fullmatch(query)) is not None \
                    and self._control(query, control[1] or control[3], control[2]):
                return self.cursor()
            if query == "COMMIT":
                return self._commit()
        if self._later:
            self._simple(self._later)
        try:
            cur = super().execute(query, params, prepare=prepare, binary=binary)
        except psycopg.Error as exc:
            self._failed(exc)
            raise
        if isinstance(query, str) and query.startswith("ROLLBACK"):
            self._first = None  # the server is past the error
        return cur

    def replies(self, texts: Sequence[str]) -> list[Reply]:
        """Statements whose values are ids, keys and hashes (bound as literals), in one
        message with what waited; each one's reply."""
        cur = self._simple([*self._later, *texts])
        out: list[Reply] = []
        while True:
            out.append(Reply(cur.fetchall() if cur.description is not None else [],
                             cur.rowcount))
            if not cur.nextset():
                return out[len(out) - len(texts):]

    def check(self) -> None:
        """After an operation: raise if its transaction is aborted (it caught a statement's
        error and went on), so that it fails, and it alone, before what waits for the next
        operation's message meets the error in its place."""
        if self.info.transaction_status == _FAILED:
            raise self._aborted()

    def reach(self) -> None:
        """If the transaction has not reached the server yet (nothing but what waited was
        run in it), send what waited now, on its own. Then a loss with the COMMIT that
        follows is the only one that leaves the transaction in doubt."""
        if any(t.startswith("BEGIN") for t in self._later):
            self._simple(self._later)

    def _commit(self) -> psycopg.Cursor[Any]:
        """COMMIT, with what waited for it. A transaction an error aborted is refused here:
        PostgreSQL answers its COMMIT with ROLLBACK and no error, which would pass for a
        commit of work that never was."""
        if self.info.transaction_status == _FAILED:
            raise self._aborted()
        cur = self._simple([*self._later, "COMMIT"])
        while cur.nextset():  # the COMMIT's answer is the last
            pass
        if cur.statusmessage != "COMMIT":
            raise errors.InFailedSqlTransaction(
                f"the COMMIT was answered {cur.statusmessage!r}: nothing of it committed")
        return cur

    def _simple(self, texts: list[str]) -> psycopg.ClientCursor[Any]:
        """``texts`` in one simple query; what waited is taken (it is in them, or was sent)."""
        self._later = []
        cur = psycopg.ClientCursor(self)
        try:
            cur.execute("; ".join(texts))
        except psycopg.Error as exc:
            self._failed(exc)
            raise
        return cur

    def _failed(self, exc: psycopg.Error) -> None:
        if self._first is None and not self.closed and self.info.transaction_status == _FAILED:
            self._first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]

    def _aborted(self) -> errors.InFailedSqlTransaction:
        why = f": {self._first}" if self._first else ""
        return errors.InFailedSqlTransaction(f"the transaction was aborted by an error{why}")

    def _control(self, text: str, kind: str, name: str | None) -> bool:
        """Whether ``text`` is settled without a message of its own (waits, or cancels what
        waited); False: send it now."""
        later = self._later
        opened = f"SAVEPOINT {name}"
        if kind == "SAVEPOINT":
            later.append(text)
        elif kind == "RELEASE SAVEPOINT":
            if later and later[-1] == opened:
                later.pop()  # made and let go with nothing in between: never sent
            else:
                later.append(text)
        elif kind == "ROLLBACK TO SAVEPOINT":
            at = max((i for i, t in enumerate(later) if t == opened), default=None)
            if at is None:  # the savepoint is on the server: what waited after it goes too
                later.clear()
                return False
            del later[at + 1:]  # still to be made, with nothing after it
        else:  # ROLLBACK
            begun = any(t.startswith("BEGIN") for t in later)
            later.clear()
            # Nothing to undo on the server if the transaction never reached it.
            return begun and self.info.transaction_status == _IDLE
        return True


__all__ = ["CONTROL", "Wire"]
