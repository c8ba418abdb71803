"""The outside world's own record: every application of a side effect, one row each.

It deliberately does not deduplicate by idempotency key, so a double-fire shows up as two rows.
It is a SQLite file every process of a trial writes (the orchestrator, its workers, the
harness) and the harness reads after a kill. Beside it:

- ``requests``, the network: a request a tool sent and the provider has not applied yet. The
  harness's ``Network`` thread applies each when it is due, or drops it once it is past its
  deadline, whatever became of the process that sent it (killed, paused, gone).
- ``trace``, what each process saw and did, with wall-clock times: the observed schedule of a
  trial (signals sent, probes answered, controls issued), kept with a failing trial's record.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS applied (n INTEGER PRIMARY KEY, key TEXT NOT NULL, "
    "order_id TEXT NOT NULL, cents INTEGER NOT NULL, at REAL NOT NULL DEFAULT 0, "
    "by TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS requests (n INTEGER PRIMARY KEY, key TEXT NOT NULL, "
    "order_id TEXT NOT NULL, cents INTEGER NOT NULL, sent_at REAL NOT NULL, "
    "due_at REAL NOT NULL, expires_at REAL NOT NULL, state TEXT NOT NULL DEFAULT 'sent', "
    "ref TEXT, by TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS trace (n INTEGER PRIMARY KEY, at REAL NOT NULL, "
    "who TEXT NOT NULL, what TEXT NOT NULL, key TEXT NOT NULL DEFAULT '', "
    "detail TEXT NOT NULL DEFAULT '{}')",
)


class Ledger:
    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        for statement in SCHEMA:
            self._db.execute(statement)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def apply(self, key: str, order_id: str, cents: int, by: str = "") -> str:
        cur = self._db.execute(
            "INSERT INTO applied (key, order_id, cents, at, by) VALUES (?, ?, ?, ?, ?)",
            (key, order_id, cents, time.time(), by))
        return f"ref-{cur.lastrowid}"

    def count(self, key: str) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM applied WHERE key = ?",
                                    (key,)).fetchone()[0])

    def keys(self) -> dict[str, int]:
        return {k: n for k, n in self._db.execute(
            "SELECT key, COUNT(*) FROM applied GROUP BY key")}

    def applications(self) -> list[tuple[str, float, str]]:
        """(key, when, by) in the order the provider applied them."""
        return [(k, at, by) for k, at, by in self._db.execute(
            "SELECT key, at, by FROM applied ORDER BY n")]

    # -- the network ----------------------------------------------------------------------------
    def send(self, key: str, order_id: str, cents: int, *, delay: float, expires_at: float,
             by: str) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO requests (key, order_id, cents, sent_at, due_at, expires_at, by) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, order_id, cents, now, now + delay, expires_at,
                                             by))
        assert cur.lastrowid is not None
        return cur.lastrowid

    def request(self, n: int) -> tuple[str, str | None]:
        state, ref = self._db.execute("SELECT state, ref FROM requests WHERE n = ?",
                                      (n,)).fetchone()
        return str(state), ref

    def deliver(self, now: float, *, twice: bool = False, overdue: bool = False) -> int:
        """Apply the requests that are due, at most once each (twice with the double_apply
        bug); drop those past their deadline (applied anyway with the overdue_apply bug)."""
        with self._transaction() as db:
            due = db.execute("SELECT n, key, order_id, cents, expires_at FROM requests "
                             "WHERE state = 'sent' AND due_at <= ? ORDER BY due_at, n",
                             (now,)).fetchall()
            for n, key, order_id, cents, expires_at in due:
                if now > expires_at and not overdue:
                    db.execute("UPDATE requests SET state = 'dropped' WHERE n = ?", (n,))
                    continue
                ref = ""
                for _ in range(2 if twice else 1):
                    cur = db.execute("INSERT INTO applied (key, order_id, cents, at, by) "
                                     "VALUES (?, ?, ?, ?, 'network')",
                                     (key, order_id, cents, now))
                    ref = f"ref-{cur.lastrowid}"
                db.execute("UPDATE requests SET state = 'applied', ref = ? WHERE n = ?",
                           (ref, n))
        return len(due)

    def in_network(self) -> int:
        return int(self._db.execute(
            "SELECT COUNT(*) FROM requests WHERE state = 'sent'").fetchone()[0])

    def requests(self) -> list[tuple[str, float, float, str, str]]:
        """(key, sent_at, due_at, state, by) of every request, in the order they were sent."""
        return [(str(k), float(s), float(d), str(st), str(by)) for k, s, d, st, by in
                self._db.execute("SELECT key, sent_at, due_at, state, by FROM requests "
                                 "ORDER BY n")]

    # -- the trace ------------------------------------------------------------------------------
    def note(self, who: str, what: str, key: str = "", at: float | None = None,
             **detail: Any) -> None:
        self._db.execute("INSERT INTO trace (at, who, what, key, detail) VALUES (?, ?, ?, ?, ?)",
                         (time.time() if at is None else at, who, what, key,
                          json.dumps(detail, default=str)))

    def notes(self) -> list[tuple[float, str, str, str, dict[str, Any]]]:
        return [(at, who, what, key, json.loads(detail)) for at, who, what, key, detail in
                self._db.execute("SELECT at, who, what, key, detail FROM trace ORDER BY n")]

    def first_note(self, what: str) -> float | None:
        row = self._db.execute("SELECT at FROM trace WHERE what = ? ORDER BY n LIMIT 1",
                               (what,)).fetchone()
        return None if row is None else float(row[0])

    def close(self) -> None:
        self._db.close()


class Network(threading.Thread):
    """The requests in transit: applied when due by the provider, in the harness's process so
    that they land whatever became of their sender. Polls every two milliseconds."""

    def __init__(self, path: Path, *, twice: bool = False, overdue: bool = False) -> None:
        super().__init__(name="chaos-network", daemon=True)
        self._path = path
        self._twice = twice
        self._overdue = overdue
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        ledger = Ledger(self._path)
        try:
            while not self._halt.wait(0.002):
                try:
                    ledger.deliver(time.time(), twice=self._twice, overdue=self._overdue)
                except sqlite3.OperationalError:  # a process stopped inside a write: retry
                    continue
        except BaseException as exc:  # reported by the harness, never lost
            self.error = exc
        finally:
            ledger.close()

    def drain(self, ledger: Ledger, timeout: float) -> bool:
        """Wait until nothing is in transit any more (every request applied or dropped)."""
        deadline = time.monotonic() + timeout
        while ledger.in_network() and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.01)
        return ledger.in_network() == 0

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=5.0)
