"""The outside world's own record: every application of a side effect, one row each.

It deliberately does not deduplicate by idempotency key, so a double-fire shows up as two rows.
It is a SQLite file the orchestrator's process writes and the harness reads after a kill."""

from __future__ import annotations

import sqlite3
from pathlib import Path


class Ledger:
    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS applied (n INTEGER PRIMARY KEY, "
                         "key TEXT NOT NULL, order_id TEXT NOT NULL, cents INTEGER NOT NULL)")

    def apply(self, key: str, order_id: str, cents: int) -> str:
        cur = self._db.execute("INSERT INTO applied (key, order_id, cents) VALUES (?, ?, ?)",
                               (key, order_id, cents))
        return f"ref-{cur.lastrowid}"

    def count(self, key: str) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM applied WHERE key = ?",
                                    (key,)).fetchone()[0])

    def keys(self) -> dict[str, int]:
        return {k: n for k, n in self._db.execute(
            "SELECT key, COUNT(*) FROM applied GROUP BY key")}

    def close(self) -> None:
        self._db.close()
