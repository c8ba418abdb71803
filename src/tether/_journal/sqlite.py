"""The embedded SQLite backend: a journal file validated before a byte is written to it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tether._core.errors import (
    JournalCorrupt,
    JournalError,
    JournalLocked,
    NotAJournal,
    SchemaTooNew,
)
from tether._journal import wake
from tether._journal.schema import APP, SCHEMA_VERSION, migrate
from tether._journal.tables import Reply, Step, replies_each, send_each
from tether._journal.writer import ThreadRunner

SIDECARS = ("-wal", "-shm")  # what SQLite keeps beside the journal in WAL mode


def _map_error(exc: sqlite3.Error, path: Path) -> JournalError:
    text = str(exc)
    if "locked" in text or "busy" in text:
        return JournalLocked(f"journal {path} is locked by another writer ({text})")
    if "unable to open" in text:
        return JournalError(f"cannot open the journal {path}: {text} (is its directory "
                            "writable?)")
    if "readonly" in text:
        return JournalError(f"journal {path} is read-only ({text})")
    if "disk is full" in text:
        return JournalError(f"journal {path}: its disk is full ({text}); nothing of this "
                            "operation was written")
    if "disk I/O error" in text:
        return JournalError(f"journal {path}: its disk refused a read or write ({text}); is "
                            "its file system read-only or failing?")
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


def _check_header(conn: sqlite3.Connection, path: Path) -> None:
    """Read the header through SQLite (which writes nothing before a write transaction): a
    file that is no database is refused as such, a database SQLite cannot read as corrupted."""
    try:
        conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc) and _magic(path) != SQLITE_MAGIC:
            raise NotAJournal(
                f"{path} is not a tether journal (not a SQLite database)") from None
        raise


SQLITE_MAGIC = b"SQLite format 3\x00"
# Descriptors kept open for the process's life, by (device, inode): closing one would drop
# every lock this process holds on the file, SQLite's included. One per file SQLite refused.
_KEPT: dict[tuple[int, int], int] = {}


def _magic(path: Path) -> bytes:
    """The first 16 bytes of a file SQLite would not read (which one, says the message)."""
    try:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key not in _KEPT:
            _KEPT[key] = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        return os.pread(_KEPT[key], 16, 0)
    except OSError:
        return b""


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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _oserror(path: Path, exc: OSError, doing: str) -> JournalError:
    return JournalError(f"cannot {doing} the journal {path}: {exc.strerror or exc}")


def _check_file(path: Path, create: bool) -> bool:
    """Whether a file is there to open (False: one is to be created). Looked at with stat,
    never opened: on POSIX, closing any descriptor of a file drops every lock the process
    holds on it, SQLite's included, so a descriptor of tether's own beside a connection of
    this process would let another process delete the write-ahead log under it. Refusing a
    FIFO or a device here keeps SQLite from opening one (and waiting on it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not create:
            raise NotAJournal(f"no journal at {path}") from None
        return False
    except OSError as exc:
        raise _oserror(path, exc, "open") from None
    if stat.S_ISDIR(mode):
        raise NotAJournal(f"{path} is a directory, not a journal file")
    if not stat.S_ISREG(mode):
        raise NotAJournal(f"{path} is {_kind(mode)}, not a journal file")
    return True


def _private_dirs(directory: Path) -> None:
    """Make ``directory`` and any missing parents with mode 0700 (``mkdir(parents=True)``
    gives the parents the umask's mode)."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            made.mkdir(mode=0o700)


def identity(path: str | Path) -> tuple[int, int] | None:
    """The file's device and inode: what tells the journal a process opened from another
    file moved over its path. None: no file there any more."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


OPEN_PATIENCE = 30.0  # seconds


def connect(path: Path, *, create: bool, synchronous: str,
            busy_timeout: float) -> sqlite3.Connection:
    """Open and validate a journal file; raises a JournalError and leaves the file untouched
    if it is not a tether journal."""
    fresh = not _check_file(path, create)
    if fresh:
        try:
            # Private, like the keys: the journal holds every argument and result.
            _private_dirs(path.parent)
        except OSError as exc:
            raise _oserror(path, exc, "create") from None
    try:
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=busy_timeout
        )
    except sqlite3.Error as exc:
        raise _map_error(exc, path) from None
    try:
        # Opening waits longer than an operation does: many processes starting on one fresh
        # journal queue for its exclusive transaction and its switch to WAL one by one.
        conn.execute(f"PRAGMA busy_timeout = {int(max(busy_timeout, OPEN_PATIENCE) * 1000)}")
        _check_header(conn, path)  # SQLite has opened (made) the file now
        if fresh:
            # Before a byte is written: the log and index SQLite makes later take this mode.
            with contextlib.suppress(OSError):  # another process made it (and owns it)
                os.chmod(path, 0o600)
        _check_or_init(conn, path, create)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
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


class SqliteDb:
    """What a batch's operations get (``tables.Conn``): the connection, and ``notify`` (as on
    PostgreSQL), whose payloads the runner sends to the journal's other processes once it
    committed (kept, and dropped, by whoever made it without a runner)."""

    __slots__ = ("_notes", "execute", "inner")

    def __init__(self, inner: sqlite3.Connection, notes: list[str] | None = None) -> None:
        self.inner = inner
        self.execute = inner.execute
        self._notes = [] if notes is None else notes

    def notify(self, payload: str) -> None:
        self._notes.append(payload)

    def server_time(self) -> None:  # the processes of a file share their host's clock
        return None

    def send(self, steps: Sequence[Step], *, last: bool = False) -> None:
        send_each(self, steps)

    def replies(self, statements: Sequence[tuple[str, Any]]) -> list[Reply]:
        return replies_each(self, statements)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SqliteRunner(ThreadRunner):
    """The embedded backend: one connection to one file, written by one thread."""

    def __init__(self, path: Path, *, create: bool = True, synchronous: str = "FULL",
                 busy_timeout: float = 5.0) -> None:
        super().__init__()
        self.path = path
        self._create = create
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._identity: tuple[int, int] | None = None
        # The write-ahead log's and shared index's paths, and their identities as found.
        self._sidecars: dict[str, tuple[int, int] | None] = {}
        self._where = path
        self._at = str(path)  # ``_where`` as a string: stat'ed twice a batch, no Path made
        self._level = synchronous  # the connection's synchronous setting now (``relax``)
        # Wake-ups for the journal's other processes (``wake``): what this batch's operations
        # notified, sent once it committed; and this process's own listener.
        self._notes: list[str] = []
        self._listener: wake.Listener | None = None
        # A relaxed commit wrote frames to the log that nothing synced since; and the
        # connection's count of changed rows when the batch on the wire began.
        self._unsynced = False
        self._changes = 0

    def connect(self) -> sqlite3.Connection:
        # Absolute as of now: a process that changes directory later still checks this file.
        self._where = Path(os.path.abspath(self.path))
        self._at = str(self._where)
        before = identity(self._at)
        conn = connect(self.path, create=self._create, synchronous=self._synchronous,
                       busy_timeout=self._busy_timeout)
        self._level = self._synchronous
        self._identity = identity(self._at)
        if before is not None and self._identity != before:
            # Replaced while this connection opened it (opening may wait its turn for the
            # creation lock): the connection may be on the old file, the path on another.
            conn.close()
            raise JournalError(f"journal {self.path} was replaced while this process opened "
                               "it; open it again")
        self._sidecars = {f"{self._at}{suffix}": identity(f"{self._at}{suffix}")
                          for suffix in SIDECARS}
        return conn

    def relax(self, conn: sqlite3.Connection, relaxed: bool) -> None:
        # WAL: NORMAL writes the log without syncing it at commit, which a process crash
        # does not lose; the next FULL commit syncs the log file, earlier frames with it.
        level = "NORMAL" if relaxed and self._synchronous == "FULL" else self._synchronous
        if level != self._level:
            conn.execute(f"PRAGMA synchronous={level}")
            self._level = level

    def db(self, conn: sqlite3.Connection) -> SqliteDb:
        return SqliteDb(conn, self._notes)

    def listen(self, callback: Callable[[str], None]) -> bool:
        if self._listener is None:
            self._listener = wake.listen(self._where, callback)  # as ``landed`` sends
        return self._listener is not None

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()

    def begin(self, conn: sqlite3.Connection, write: bool) -> None:
        self._notes.clear()  # what a batch that did not commit notified is dropped with it
        self._changes = conn.total_changes
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        # A file deleted or moved over the journal's path leaves this connection on the old
        # inode: every commit would land in a file nobody will ever open. Checked once the
        # transaction holds its lock, before any statement of the batch runs, and again once
        # it committed (``landed``): a deletion while the batch ran must not pass for a commit.
        try:
            self._same_files()
        except JournalError:
            conn.execute("ROLLBACK")
            raise

    def op_mark(self) -> int:
        return len(self._notes)

    def op_undone(self, mark: int) -> None:
        del self._notes[mark:]

    def landed(self, conn: sqlite3.Connection, sync: bool = False) -> None:
        self._same_files()
        if self._synchronous == "FULL":
            self._sync(wrote=conn.total_changes != self._changes, force=sync)
        if self._notes:
            notes = list(self._notes)
            self._notes.clear()
            # Committed: a wake-up that cannot be sent (no descriptor left) is a missed hint,
            # never the batch's failure.
            with contextlib.suppress(Exception):
                wake.send(self._where, notes)

    def _sync(self, wrote: bool, force: bool = False) -> None:
        """After a commit of a durable journal: a relaxed one leaves the log unsynced, and a
        durable one that wrote syncs it (SQLite does, at its commit). A durable one that wrote
        nothing (a flush) syncs nothing, so it syncs the log itself: what was relaxed before
        it then survives the machine, as ``flush`` says; and so when ``force``d (what other
        processes committed relaxed, read since: ``Tx.sync_log``)."""
        if self._level != "FULL":
            self._unsynced = self._unsynced or wrote
            return
        if (self._unsynced or force) and not wrote:
            try:
                self._fsync_log()
            except OSError as exc:
                raise JournalError(f"could not sync the journal's write-ahead log "
                                   f"{self.path}-wal: {exc}") from None
        self._unsynced = False

    def sync_log(self) -> bool:
        """Sync the write-ahead log (every connection's frames in it) from outside any
        transaction: what is committed is then on disk. False if the file refuses."""
        try:
            self._fsync_log()
        except OSError:
            return False
        return True

    def _fsync_log(self) -> None:
        try:
            fd = os.open(f"{self._at}-wal", os.O_RDONLY)
        except FileNotFoundError:  # checkpointed into the file: synced by the checkpoint
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _same_files(self) -> None:
        now = identity(self._at)
        if now != self._identity:
            what = "deleted" if now is None else "replaced by another file"
            raise JournalError(
                f"journal {self.path} was {what} while this process had it open; "
                "stopping instead of writing to a file nobody can read")
        # Its write-ahead log and shared index likewise: SQLite keeps neither away from a
        # connection that is open, so one deleted or replaced under it was removed by hand, and
        # every commit since lands in a log that no other process reads and that a crash loses
        # (with what it held before).
        for side_path, known in self._sidecars.items():
            side = identity(side_path)
            if known is None:  # not made yet when the connection opened
                self._sidecars[side_path] = side
            elif side != known:
                what = "deleted" if side is None else "replaced by another file"
                suffix = side_path[len(self._at):]
                raise JournalError(
                    f"the journal's {'write-ahead log' if suffix == '-wal' else 'shared index'}"
                    f" {self.path}{suffix} was {what} while this process had it open: what "
                    "it committed since is in no file another process reads; stopping")

    def map_error(self, exc: Exception) -> Exception:
        return _map_error(exc, self.path) if isinstance(exc, sqlite3.Error) else exc
