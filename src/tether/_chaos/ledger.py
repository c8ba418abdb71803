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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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


# How long one attempt waits for a lock (SQLite's busy handler), and how long an operation
# keeps trying: a process of the trial may be stopped (SIGSTOP) inside a write for a few leases.
BUSY_TIMEOUT = 10.0
BUSY_GIVE_UP = 120.0

T = TypeVar("T")


def _busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text


class Ledger:
    """One connection per thread (the orchestrator notes from a timer thread too): a statement
    of one thread never runs inside another thread's read transaction, where SQLite answers
    "database is locked" at once instead of waiting. An operation that meets a lock anyway
    (SQLite does not wait where waiting could deadlock) is retried from the start."""

    def __init__(self, path: Path, *, busy_timeout: float = BUSY_TIMEOUT,
                 give_up: float = BUSY_GIVE_UP) -> None:
        self._path = path
        self._timeout = busy_timeout
        self._give_up = give_up
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self.retries = 0  # operations that met a lock and ran again
        self._run(lambda db: [db.execute(statement) for statement in SCHEMA])

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False,
                                   timeout=self._timeout)
            with self._lock:
                self._all.append(conn)
            self._local.conn = conn
            self._run(lambda db: db.execute("PRAGMA journal_mode=WAL"), conn)
        return conn

    def _run(self, fn: Callable[[sqlite3.Connection], T],
             conn: sqlite3.Connection | None = None) -> T:
        db = conn if conn is not None else self._conn()
        deadline = time.monotonic() + self._give_up
        while True:
            try:
                return fn(db)
            except sqlite3.OperationalError as exc:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                if not _busy(exc) or time.monotonic() > deadline:
                    raise
                self.retries += 1
                time.sleep(0.01)

    def _all_rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        return self._run(lambda db: db.execute(sql, params).fetchall())

    def _insert(self, sql: str, params: tuple[Any, ...]) -> int:
        def write(db: sqlite3.Connection) -> int:
            n = db.execute(sql, params).lastrowid
            assert n is not None
            return n
        return self._run(write)

    @contextlib.contextmanager
    def _transaction(self, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def apply(self, key: str, order_id: str, cents: int, by: str = "") -> str:
        n = self._insert(
            "INSERT INTO applied (key, order_id, cents, at, by) VALUES (?, ?, ?, ?, ?)",
            (key, order_id, cents, time.time(), by))
        return f"ref-{n}"

    def count(self, key: str) -> int:
        return int(self._all_rows("SELECT COUNT(*) FROM applied WHERE key = ?", (key,))[0][0])

    def keys(self) -> dict[str, int]:
        return {k: n for k, n in self._all_rows(
            "SELECT key, COUNT(*) FROM applied GROUP BY key")}

    def applications(self) -> list[tuple[str, float, str]]:
        """(key, when, by) in the order the provider applied them."""
        return [(k, at, by) for k, at, by in self._all_rows(
            "SELECT key, at, by FROM applied ORDER BY n")]

    # -- the network ----------------------------------------------------------------------------
    def send(self, key: str, order_id: str, cents: int, *, delay: float, expires_at: float,
             by: str) -> int:
        now = time.time()
        return self._insert(
            "INSERT INTO requests (key, order_id, cents, sent_at, due_at, expires_at, by) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", (key, order_id, cents, now, now + delay, expires_at,
                                             by))

    def request(self, n: int) -> tuple[str, str | None]:
        state, ref = self._all_rows("SELECT state, ref FROM requests WHERE n = ?", (n,))[0]
        return str(state), ref

    def deliver(self, now: float, *, twice: bool = False, overdue: bool = False) -> int:
        """Apply the requests that are due, at most once each (twice with the double_apply
        bug); drop those past their deadline (applied anyway with the overdue_apply bug)."""
        return self._run(lambda db: self._deliver(db, now, twice, overdue))

    def _deliver(self, conn: sqlite3.Connection, now: float, twice: bool, overdue: bool) -> int:
        with self._transaction(conn) as db:
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
        return int(self._all_rows("SELECT COUNT(*) FROM requests WHERE state = 'sent'")[0][0])

    def requests(self) -> list[tuple[str, float, float, str, str]]:
        """(key, sent_at, due_at, state, by) of every request, in the order they were sent."""
        return [(str(k), float(s), float(d), str(st), str(by)) for k, s, d, st, by in
                self._all_rows("SELECT key, sent_at, due_at, state, by FROM requests "
                               "ORDER BY n")]

    # -- the trace ------------------------------------------------------------------------------
    def note(self, who: str, what: str, key: str = "", at: float | None = None,
             **detail: Any) -> None:
        self._insert("INSERT INTO trace (at, who, what, key, detail) VALUES (?, ?, ?, ?, ?)",
                     (time.time() if at is None else at, who, what, key,
                      json.dumps(detail, default=str)))

    def notes(self) -> list[tuple[float, str, str, str, dict[str, Any]]]:
        return [(at, who, what, key, json.loads(detail)) for at, who, what, key, detail in
                self._all_rows("SELECT at, who, what, key, detail FROM trace ORDER BY n")]

    def first_note(self, what: str) -> float | None:
        rows = self._all_rows("SELECT at FROM trace WHERE what = ? ORDER BY n LIMIT 1", (what,))
        return None if not rows else float(rows[0][0])

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


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
                ledger.deliver(time.time(), twice=self._twice, overdue=self._overdue)
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
