"""The PostgreSQL backend: the same operations, for several processes and hosts.

URL: ``postgresql://user@host:5432/db?schema=tether`` (``schema`` is tether's; the rest goes to
psycopg). Every rule stays inside one transaction at READ COMMITTED: compare-and-set updates
check their row count, and the statements that insert behind a fence take a share lock on the
fenced rows (``FOR SHARE``), so a concurrent fence either waits for the insert to commit (and
its drain then sees the action) or commits first (and the insert sees the fence). A deadlock or
serialization failure between processes rolls the whole batch back and runs it again.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import psycopg
from psycopg import errors, sql
from psycopg_pool import ConnectionPool, PoolTimeout

from tether._core.errors import JournalError, NotAJournal, SchemaTooNew, UserError
from tether._journal.runner import Retry, ThreadRunner
from tether._journal.schema import APP, SCHEMA_VERSION, migrate

T = TypeVar("T")
LOCK = re.compile(r"/\*LOCK ([^*]*)\*/")
SKIP = re.compile(r"/\*SKIP ([^*]*)\*/")
XLOCK = re.compile(r"/\*XLOCK ([^*]*)\*/")
LISTEN_TICK = 0.25
IDLE_IN_TRANSACTION_MS = 2000  # how often the listener thread checks that it should stop


@functools.lru_cache(maxsize=1024)
def translate(statement: str) -> str:
    """'?' placeholders to psycopg's; lock markers to FOR SHARE, exclusive ones to FOR UPDATE,
    claim markers to FOR UPDATE ... SKIP LOCKED (workers never wait on each other's claims)."""
    statement = statement.replace("%", "%%").replace("?", "%s")
    statement = XLOCK.sub(r"FOR UPDATE OF \1", statement)
    return SKIP.sub(r"FOR UPDATE OF \1 SKIP LOCKED", LOCK.sub(r"FOR SHARE OF \1", statement))


class PgDb:
    def __init__(self, conn: psycopg.Connection[Any], channel: str) -> None:
        self._conn = conn
        self._channel = channel

    def execute(self, statement: str, params: Any = ()) -> psycopg.Cursor[Any]:
        return self._conn.execute(translate(statement), params)

    def server_time(self) -> float:
        """The database server's clock: one clock that every host's process can read."""
        row = self._conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        return float(row[0])

    def notify(self, payload: str) -> None:
        """Delivered to listeners when the transaction commits, never if it rolls back."""
        self._conn.execute("SELECT pg_notify(%s, %s)", (self._channel, payload))


def split_url(url: str) -> tuple[str, str, str]:
    """(conninfo for psycopg, schema, the URL without its password, for messages)."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    schema = query.pop("schema", "tether")
    query.pop("keys", None)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
        raise UserError(f"schema {schema!r} in the journal URL is not a plain identifier")
    conninfo = urlunparse(parsed._replace(query=urlencode(query)))
    shown = parsed._replace(netloc=parsed.netloc.split("@")[-1] if "@" in parsed.netloc
                            else parsed.netloc, query="")
    return conninfo, schema, urlunparse(shown)


class PostgresRunner(ThreadRunner):
    def __init__(self, url: str, *, create: bool = True) -> None:
        super().__init__()
        self.conninfo, self.schema, self.shown = split_url(url)
        self._create = create
        self.channel = f"tether_{self.schema}"
        self._pool: ConnectionPool[Any] | None = None
        self._pool_lock = threading.Lock()
        self._listening = threading.Event()

    def connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JournalError(f"cannot connect to the journal at {self.shown}: {first}") from None
        try:
            self._check_or_init(conn)
            # A process paused inside a transaction (a stopped VM) would hold its row locks,
            # and every other process's fence or reconciliation would wait on them for as long
            # as it sleeps. tether's transactions never wait between statements, so the server
            # may end any that does; its owner then finds its connection gone.
            conn.execute(f"SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_or_init(self, conn: psycopg.Connection[Any]) -> None:
        names = {r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (self.schema,))}
        if "tether_meta" in names:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            meta = dict(conn.execute("SELECT key, value FROM tether_meta").fetchall())
            if meta.get("app") != APP:
                raise NotAJournal(f"schema {self.schema} at {self.shown} is not a tether journal")
            found = int(meta.get("schema_version", "0"))
            if found > SCHEMA_VERSION:
                raise SchemaTooNew(found, SCHEMA_VERSION)
            if found < SCHEMA_VERSION:
                self._migrate(conn, found)
            return
        if names:
            raise NotAJournal(
                f"schema {self.schema} at {self.shown} holds tables but is not a tether journal")
        if not self._create:
            raise NotAJournal(f"no tether journal in schema {self.schema} at {self.shown}")
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
            sql.Identifier(self.schema)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        self._migrate(conn, 0)

    def _migrate(self, conn: psycopg.Connection[Any], found: int) -> None:
        with conn.transaction():
            migrate(conn, found, "postgresql")

    def begin(self, conn: psycopg.Connection[Any], write: bool) -> None:
        conn.execute("BEGIN")

    def db(self, conn: psycopg.Connection[Any]) -> PgDb:
        return PgDb(conn, self.channel)

    def close(self, conn: Any) -> None:
        conn.close()
        self._listening.clear()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    # -- reads beside the writer ----------------------------------------------------------
    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))

    def read_pooled(self, fn: Callable[[Any], T]) -> T:
        """Run a read on a pooled connection (in a worker thread), so that polling for another
        process's progress never queues behind this process's write batches. It sees only
        committed rows: use it for other processes' work, not to read one's own posted writes."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.conninfo, min_size=1, max_size=4, open=True, name="tether",
                    kwargs={"autocommit": True, "connect_timeout": 5},
                    configure=self._configure)
            pool = self._pool
        try:
            with pool.connection(timeout=10) as conn:
                return fn(PgDb(conn, self.channel))
        except PoolTimeout as exc:
            raise JournalError(f"no connection to the journal at {self.shown}: {exc}") from None
        except psycopg.Error as exc:
            raise self.map_error(exc) from None

    # -- notifications ----------------------------------------------------------------------
    def listen(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(payload)`` from a thread for each NOTIFY on this journal's channel.
        Best effort: if the connection drops, owners still learn of intents by polling."""
        if self._listening.is_set():
            return
        self._listening.set()
        threading.Thread(target=self._listen, args=(callback,), name="tether-listen",
                         daemon=True).start()

    def _listen(self, callback: Callable[[str], None]) -> None:
        with contextlib.suppress(psycopg.Error), psycopg.connect(
                self.conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            while self._listening.is_set():
                for note in conn.notifies(timeout=LISTEN_TICK):
                    callback(note.payload)

    def map_error(self, exc: Exception) -> Exception:
        if isinstance(exc, errors.DeadlockDetected | errors.SerializationFailure):
            return Retry(str(exc))
        if isinstance(exc, psycopg.OperationalError):
            return JournalError(f"lost the journal at {self.shown}: {exc}")
        if isinstance(exc, psycopg.Error):
            return JournalError(f"journal {self.shown}: {exc}")
        return exc
