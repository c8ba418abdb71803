"""The PostgreSQL backend: the same operations, for several processes and hosts.

URL: ``postgresql://user@host:5432/db?schema=tether`` (``schema`` is tether's; the rest goes to
psycopg). Every rule stays inside one transaction at READ COMMITTED: compare-and-set updates
check their row count, and the statements that insert behind a fence take a share lock on the
fenced rows (``FOR SHARE``), so a concurrent fence either waits for the insert to commit (and
its drain then sees the action) or commits first (and the insert sees the fence). A deadlock or
serialization failure between processes rolls the whole batch back and runs it again.

A lost connection (a restart, a failover, a terminated backend) is ridden through: the writer,
the listener and the pooled reads reconnect with bounded backoff (``reconnect_within``). Each
write batch first stamps a row of its own in ``tether_meta`` (``commit:<runner id>`` = the
batch's number); a batch lost around its COMMIT is settled by reading that row back, locking it
so that a transaction the server still runs is waited for, never by guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import psycopg
from psycopg import errors, pq, sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from tether._core.errors import JournalError, NotAJournal, SchemaTooNew, UserError
from tether._journal.runner import BACKOFF_FIRST, Retry
from tether._journal.schema import APP, SCHEMA_VERSION, migrate
from tether._journal.tables import Reply, Step, replies_each
from tether._journal.wire import Wire
from tether._journal.writer import ThreadRunner

T = TypeVar("T")
LIVE_KEY = "actions_live_key"  # the partial unique index on live idempotency keys
LOCK = re.compile(r"/\*LOCK ([^*]*)\*/")
SKIP = re.compile(r"/\*SKIP ([^*]*)\*/")
XLOCK = re.compile(r"/\*XLOCK ([^*]*)\*/")
CHANNEL = "tether_"  # the journal's notification channel: this, then its schema
MAX_NAME = 63  # PostgreSQL's identifiers, a channel's name among them, in bytes
LISTEN_TICK = 0.25
CONNECT_TIMEOUT = 5  # seconds
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

    def executemany(self, statement: str, params: Any) -> None:
        """One statement for many rows: one round trip (``send``)."""
        self.send([(statement, params, True)])

    def send(self, steps: Sequence[Step], *, last: bool = False) -> None:
        """One query message (the simple protocol, values bound here): the server has all of
        it before it runs any, and is idle in the transaction once it ran, where the idle
        timeout ends a session whose process was paused. Pipelined statements (psycopg's
        pipeline mode, and ``executemany``, which uses it) reach the server one by one with
        no Sync between: a process paused between two of them left its session waiting,
        with no timeout, holding its locks until the process woke."""
        cur = psycopg.ClientCursor(self._conn)
        text = "; ".join(cur.mogrify(translate(sql), row)
                         for sql, params, many in steps for row in (params if many else (params,)))
        if last and isinstance(self._conn, Wire):
            self._conn.later(text)  # with the COMMIT
        else:
            self._conn.execute(text)

    def replies(self, statements: Sequence[tuple[str, Any]]) -> list[Reply]:
        """(Their values are identifiers and hashes: ``wire.Wire``.)"""
        if not isinstance(self._conn, Wire):  # a pooled read's connection
            return replies_each(self, statements)
        cur = psycopg.ClientCursor(self._conn)
        return self._conn.replies([cur.mogrify(translate(sql), params)
                                   for sql, params in statements])

    def server_time(self) -> float:
        """The database server's clock: one clock that every host's process can read."""
        row = self._conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        return float(row[0])

    def log_position(self, flushed: bool) -> tuple[str, int] | None:
        """(this server session, a position in the server's write-ahead log): where the log is
        on disk up to (``flushed``), or where it was inserted up to, past the commit record of
        every transaction this connection saw so far. None on a standby, which cannot say.
        The session is the backend's own (its process and start): a crash of any backend
        ends every session, even when the server restarts from it by itself."""
        which = "pg_current_wal_flush_lsn()" if flushed else "pg_current_wal_insert_lsn()"
        # In a savepoint: a server that refuses it (a pooler, a role, a version) costs the
        # witness, never the read it follows.
        try:
            self._conn.execute("SAVEPOINT log_position")
            row = self._conn.execute(
                "SELECT CASE WHEN pg_is_in_recovery() THEN NULL "
                f"ELSE ({which} - '0/0'::pg_lsn)::bigint END, "
                "pg_postmaster_start_time()::text || ' ' || pg_backend_pid()::text || ' ' || "
                "(SELECT backend_start FROM pg_stat_get_activity(pg_backend_pid()))::text"
            ).fetchone()
            self._conn.execute("RELEASE SAVEPOINT log_position")
        except psycopg.Error:
            if self._conn.closed or self._conn.broken:
                raise
            with contextlib.suppress(psycopg.Error):
                self._conn.execute("ROLLBACK TO SAVEPOINT log_position")
            return None
        if row is None or row[0] is None or row[1] is None:
            return None
        return str(row[1]), int(row[0])

    def notify(self, payload: str) -> None:
        """Delivered to listeners when the transaction commits, never if it rolls back."""
        self._conn.execute("SELECT pg_notify(%s, %s)", (self._channel, payload))


def _deliver(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def split_url(url: str) -> tuple[str, str, str]:
    """(conninfo for psycopg, schema, the URL without its password, for messages)."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    schema = query.pop("schema", "tether")
    query.pop("keys", None)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
        raise UserError(f"schema {schema!r} in the journal URL is not a plain identifier")
    if len(CHANNEL + schema) > MAX_NAME:
        # The journal's notification channel is named after it: a longer name is cut short
        # by LISTEN and refused by pg_notify, and no process would ever be woken.
        raise UserError(f"schema {schema!r} in the journal URL is longer than "
                        f"{MAX_NAME - len(CHANNEL)} characters")
    conninfo = urlunparse(parsed._replace(query=urlencode(query)))
    try:
        conninfo_to_dict(conninfo)  # libpq's own parser: an unknown parameter is named here
    except psycopg.ProgrammingError as exc:
        raise UserError(f"journal URL: {str(exc).strip()} (tether takes schema= and keys=; "
                        "the rest are libpq connection parameters)") from None
    # No user or password (the query's other parameters may hold one too); the schema kept,
    # so that the URL shown is one that opens this journal (a server holds many).
    shown = parsed._replace(netloc=parsed.netloc.split("@")[-1] if "@" in parsed.netloc
                            else parsed.netloc, query=urlencode({"schema": schema}))
    return conninfo, schema, urlunparse(shown)


class PostgresRunner(ThreadRunner):
    reconnect_within = 30.0
    watched = True

    def __init__(self, url: str, *, create: bool = True) -> None:
        super().__init__()
        self._mark_key = f"commit:{uuid.uuid4().hex}"  # this runner's commit marker
        self._relaxed = False  # the next write batch commits asynchronously (``relax``)
        self._mark = 0
        self._marked = False
        self.conninfo, self.schema, self.shown = split_url(url)
        self._create = create
        self.channel = CHANNEL + self.schema
        self._pool: ConnectionPool[Any] | None = None
        self._pool_lock = threading.Lock()
        self._listening = threading.Event()

    def connect(self) -> Wire:
        try:
            conn = Wire.connect(self.conninfo, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JournalError(f"cannot connect to the journal at {self.shown}: {first}") from None
        try:
            self._check_or_init(conn)
            # A process paused inside a transaction (a stopped VM) would hold its row locks,
            # and every other process's fence or reconciliation would wait on them for as long
            # as it sleeps. tether's transactions never wait between statements, so the server
            # may end any that does; its owner then finds its connection gone.
            self._bounded(conn, lambda: conn.execute(
                f"SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}"))
        except psycopg.Error as exc:  # lost while opening (a restart), or refused
            conn.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JournalError(f"journal at {self.shown}, while opening it: {first}") from None
        except BaseException:
            conn.close()
            raise
        # A new connection may reach a server that lacks the marker (a failover to a standby
        # it had not reached yet, a restore): it is made again before the next batch, whose
        # stamp would otherwise update nothing and leave a lost COMMIT nothing to read back.
        self._marked = False
        return conn

    def _bounded(self, conn: psycopg.Connection[Any], fn: Callable[[], T]) -> T:
        """``fn()``, its connection cut if the server has not answered within the stall bound
        (a paused host): the writer's watchdog only sees batches, not a connection being set
        up, and a reconnection stuck here would leave every operation waiting for ever."""
        timer = threading.Timer(self.stall_after(), lambda: self._cut(conn))
        timer.daemon = True
        timer.start()
        try:
            return fn()
        finally:
            timer.cancel()

    def _cut(self, conn: psycopg.Connection[Any]) -> None:
        with contextlib.suppress(Exception):
            self.interrupt(conn)

    def _check_or_init(self, conn: psycopg.Connection[Any]) -> None:
        """Check, create or migrate the schema in one transaction under an advisory lock held
        per schema, so any number of processes starting at once on a fresh journal agree: the
        first creates it, the others wait for its commit and find it made. A journal already
        at this version (every reconnection) takes no lock: a process holding it for long (a
        migration elsewhere, a process stopped in its first start) must not hold up every
        reconnection of the fleet, which would wait on it with no bound."""
        # Bounded: quick reads. The lock below is not: it may wait on another process's
        # creation or migration for as long as that takes.
        if self._bounded(conn, lambda: self._current(conn)):
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                         (f"tether.schema.{self.schema}",))
            self._check_or_init_locked(conn)

    def _current(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the schema holds a tether journal at this version (then search_path is
        set to it); anything else is decided under the lock."""
        found = conn.execute(
            "SELECT 1 FROM information_schema.tables WHERE table_schema = %s "
            "AND table_name = 'tether_meta'", (self.schema,)).fetchone()
        if found is None:
            return False
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        meta = dict(conn.execute("SELECT key, value FROM tether_meta "
                                 "WHERE key IN ('app', 'schema_version')").fetchall())
        return meta.get("app") == APP and meta.get("schema_version") == str(SCHEMA_VERSION)

    def _check_or_init_locked(self, conn: psycopg.Connection[Any]) -> None:
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
                migrate(conn, found, "postgresql")
            return
        if names:
            raise NotAJournal(
                f"schema {self.schema} at {self.shown} holds tables but is not a tether journal")
        if not self._create:
            raise NotAJournal(f"no tether journal in schema {self.schema} at {self.shown}")
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
            sql.Identifier(self.schema)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        migrate(conn, 0, "postgresql")

    def relax(self, conn: psycopg.Connection[Any], relaxed: bool) -> None:
        self._relaxed = relaxed

    def begin(self, conn: Wire, write: bool) -> None:
        if not write:
            conn.later("BEGIN")  # with the batch's first statement
            return
        if not self._marked:  # committed before any batch updates it, so that a read-back
            conn.execute(       # can wait on the row's lock
                "INSERT INTO tether_meta (key, value) VALUES (%s, '0') "
                "ON CONFLICT (key) DO NOTHING", (self._mark_key,))
            self._marked = True
        self._mark += 1
        # No round trip of its own: it goes with the batch's first statement (``Wire``;
        # literals: a hex id and an integer).
        # A relaxed commit returns before its WAL is flushed: the server has it (a crash of
        # this process loses nothing); the next synchronous commit flushes it with its own.
        relax = "; SET LOCAL synchronous_commit TO off" if self._relaxed else ""
        conn.later(f"BEGIN; UPDATE tether_meta SET value = '{self._mark}' "
                   f"WHERE key = '{self._mark_key}'{relax}")

    def after_op(self, conn: Wire) -> None:
        conn.check()

    def before_commit(self, conn: Wire) -> None:
        # A batch that ran no statement of its own (a flush): its BEGIN and marker go now, a
        # round trip of their own, so that a server down all along is told as such rather
        # than as a commit whose outcome must be read back.
        conn.reach()

    def committed(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute("SELECT value FROM tether_meta WHERE key = %s FOR UPDATE",
                           (self._mark_key,)).fetchone()
        if row is None:  # never guessed: without its marker, a batch cannot be told apart
            raise JournalError(f"the commit marker {self._mark_key} is missing from the "
                               f"journal at {self.shown}")
        return bool(row[0] == str(self._mark))

    def is_lost(self, conn: Any, exc: BaseException) -> bool:
        if conn is None or conn.closed or conn.broken:
            return True
        return (isinstance(exc, psycopg.OperationalError)
                and conn.pgconn.status != pq.ConnStatus.OK)

    def where(self) -> str:
        return f"journal at {self.shown}"

    def interrupt(self, conn: psycopg.Connection[Any]) -> None:
        """Shut the socket down under libpq (on a duplicate of its descriptor): its wait
        ends at once with "server closed the connection", and the connection is broken."""
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    def db(self, conn: psycopg.Connection[Any]) -> PgDb:
        return PgDb(conn, self.channel)

    def close(self, conn: Any) -> None:
        if conn is not None:
            if self._marked and not conn.broken:  # a clean end leaves no marker behind
                with contextlib.suppress(psycopg.Error):
                    conn.execute("DELETE FROM tether_meta WHERE key = %s", (self._mark_key,))
            conn.close()
        self._marked = False
        self._listening.clear()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    # -- reads beside the writer ----------------------------------------------------------
    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))

    async def read_beside(self, fn: Callable[[Any], T]) -> T:
        """``read_pooled`` on a thread of its own rather than the loop's executor: a read
        stuck on a server that answers nothing must neither keep the process from exiting
        nor its caller waiting for ever (it fails after the stall bound and a connect)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                outcome: tuple[Any, BaseException | None] = (self.read_pooled(fn), None)
            except BaseException as exc:
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(_deliver, future, *outcome)
            with self._lock:
                self.outstanding -= 1

        with self._lock:
            self.outstanding += 1
        threading.Thread(target=run, name="tether-read", daemon=True).start()
        bound = self.stall_after() + CONNECT_TIMEOUT
        try:
            async with asyncio.timeout(bound):  # (wait_for on 3.11 can swallow a cancel)
                return await future
        except TimeoutError:
            raise JournalError(f"the journal at {self.shown} did not answer a read within "
                               f"{bound:g} s") from None

    def read_pooled(self, fn: Callable[[Any], T]) -> T:
        """Run a read on a pooled connection (in a worker thread), so that polling for another
        process's progress never queues behind this process's write batches. It sees only
        committed rows: use it for other processes' work, not to read one's own posted writes."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.conninfo, min_size=1, max_size=4, open=True, name="tether",
                    kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT},
                    configure=self._configure)
            pool = self._pool
        deadline = time.monotonic() + self.reconnect_within
        delay = BACKOFF_FIRST
        # Once a connection was lost, the read runs on one of its own: the pool reconnects in
        # the background with steps of 1, 2, 4 s..., which would outlast a worker's lease.
        direct = False
        while True:  # a read is safe to run again on another connection
            conn: psycopg.Connection[Any] | None = None
            left = deadline - time.monotonic()
            try:
                if direct:
                    with psycopg.connect(self.conninfo, autocommit=True,
                                         connect_timeout=CONNECT_TIMEOUT) as conn:
                        self._configure(conn)
                        return fn(PgDb(conn, self.channel))
                with pool.connection(timeout=max(0.1, min(10.0, left))) as conn:
                    return fn(PgDb(conn, self.channel))
            except PoolTimeout as exc:
                if time.monotonic() >= deadline or self._closing.is_set():
                    raise JournalError(
                        f"no connection to the journal at {self.shown}: {exc}") from None
                direct = True
            except psycopg.Error as exc:
                if (conn is not None and not self.is_lost(conn, exc)) or \
                        time.monotonic() >= deadline or self._closing.is_set():
                    raise self.map_error(exc) from None
                direct = True
                self._closing.wait(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, self.backoff_cap())

    # -- notifications ----------------------------------------------------------------------
    def listen(self, callback: Callable[[str], None]) -> bool:
        """Call ``callback(payload)`` from a thread for each NOTIFY on this journal's channel.
        Best effort: while the connection is down owners learn of intents by polling; once it
        is up, ``callback("reconnected")`` tells them that notifications may have been lost
        (also the first time: between the journal's opening and the LISTEN)."""
        if self._listening.is_set():
            return True
        self._listening.set()
        threading.Thread(target=self._listen, args=(callback,), name="tether-listen",
                         daemon=True).start()
        return True

    def _listen(self, callback: Callable[[str], None]) -> None:
        delay = BACKOFF_FIRST
        while self._listening.is_set() and not self._closing.is_set():
            with contextlib.suppress(psycopg.Error), psycopg.connect(
                    self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                delay = BACKOFF_FIRST
                # Listening now (again, or for the first time: the thread connects a moment
                # after the journal opened): what committed before is for a read, not a wake-up.
                callback("reconnected")
                while self._listening.is_set():
                    for note in conn.notifies(timeout=LISTEN_TICK):
                        callback(note.payload)
            self._closing.wait(delay)  # lost: try again, with bounded backoff
            delay = min(delay * 2, self.backoff_cap())

    def map_error(self, exc: Exception) -> Exception:
        if isinstance(exc, errors.DeadlockDetected | errors.SerializationFailure):
            return Retry(str(exc))
        if isinstance(exc, errors.UniqueViolation) and exc.diag.constraint_name == LIVE_KEY:
            # Another process's intent took the key after this one read it free (its insert
            # was not committed yet): run again, and the key's rule (wait, replay) decides.
            return Retry(str(exc))
        if isinstance(exc, psycopg.OperationalError):
            return JournalError(f"lost the journal at {self.shown}: {exc}")
        if isinstance(exc, psycopg.Error):
            return JournalError(f"journal {self.shown}: {exc}")
        return exc
