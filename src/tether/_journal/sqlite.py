"""The embedded SQLite backend: a journal file validated before a byte is written to it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tether._core.errors import (
    JournalCorrupt,
    JournalError,
    JournalLocked,
    NotAJournal,
    SchemaTooNew,
)
from tether._journal.runner import ThreadRunner
from tether._journal.schema import APP, SCHEMA_VERSION, migrate

SQLITE_MAGIC = b"SQLite format 3\x00"


def _map_error(exc: sqlite3.Error, path: Path) -> JournalError:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return JournalLocked(f"journal {path} is locked by another writer ({text})")
    if "malformed" in text or "not a database" in text or "corrupt" in text:
        return JournalCorrupt(f"journal {path} is corrupted ({text})")
    return JournalError(f"journal {path}: {text}")


def _check_or_init(conn: sqlite3.Connection, path: Path, create: bool) -> None:
    """Refuse anything that is not a tether journal before writing a single byte to it.

    A journal to create or migrate is re-checked inside an exclusive transaction, so any number
    of processes opening a fresh file at once agree: the first creates, the others wait for its
    commit and find the journal made."""
    if _inspect(conn, path, create):
        conn.execute("BEGIN EXCLUSIVE")
        try:
            if _inspect(conn, path, create):
                found = _version(conn)
                migrate(conn, found, "sqlite")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def _version(conn: sqlite3.Connection) -> int:
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    if "tether_meta" not in names:
        return 0
    return int(conn.execute(
        "SELECT value FROM tether_meta WHERE key = 'schema_version'").fetchone()[0])


def _inspect(conn: sqlite3.Connection, path: Path, create: bool) -> bool:
    """True when the journal must be created or migrated; raises if it is not a journal."""
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    except sqlite3.DatabaseError as exc:
        raise _map_error(exc, path) from None
    if "tether_meta" in names:
        row = conn.execute("SELECT value FROM tether_meta WHERE key = 'app'").fetchone()
        if row is None or row[0] != APP:
            raise NotAJournal(f"{path} is not a tether journal")
        found = _version(conn)
        if found > SCHEMA_VERSION:
            raise SchemaTooNew(found, SCHEMA_VERSION)
        return found < SCHEMA_VERSION
    if names:
        raise NotAJournal(f"{path} is a SQLite database but not a tether journal")
    if not create:
        raise NotAJournal(f"{path} is empty, not a tether journal")
    return True


def connect(path: Path, *, create: bool, synchronous: str,
            busy_timeout: float) -> sqlite3.Connection:
    """Open and validate a journal file; raises a JournalError and leaves the file untouched
    if it is not a tether journal."""
    if path.exists():
        with path.open("rb") as fh:
            head = fh.read(16)
        if head and head != SQLITE_MAGIC:
            raise NotAJournal(f"{path} is not a tether journal (not a SQLite database)")
    elif not create:
        raise NotAJournal(f"no journal at {path}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=busy_timeout
    )
    try:
        _check_or_init(conn, path, create)
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss. NORMAL (durable=False) survives a process crash.
        # OFF is for measuring CPU cost only.
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
    except sqlite3.Error as exc:
        conn.close()
        raise _map_error(exc, path) from None
    except BaseException:
        conn.close()
        raise
    return conn


class SqliteRunner(ThreadRunner):
    """The embedded backend: one connection to one file, written by one thread."""

    def __init__(self, path: Path, *, create: bool = True, synchronous: str = "FULL",
                 busy_timeout: float = 5.0) -> None:
        super().__init__()
        self.path = path
        self._create = create
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout

    def connect(self) -> sqlite3.Connection:
        return connect(self.path, create=self._create, synchronous=self._synchronous,
                       busy_timeout=self._busy_timeout)

    def begin(self, conn: sqlite3.Connection, write: bool) -> None:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def map_error(self, exc: Exception) -> Exception:
        return _map_error(exc, self.path) if isinstance(exc, sqlite3.Error) else exc
