"""The PostgreSQL backend: the same operations, for several processes and hosts.

URL: ``postgresql://user@host:5432/db?schema=tether`` (``schema`` is tether's; the rest goes to
psycopg). Every rule stays inside one transaction at READ COMMITTED: compare-and-set updates
check their row count, and the statements that insert behind a fence take a share lock on the
fenced rows (``FOR SHARE``), so a concurrent fence either waits for the insert to commit (and
its drain then sees the action) or commits first (and the insert sees the fence). A deadlock or
serialization failure between processes rolls the whole batch back and runs it again.
"""

from __future__ import annotations

import functools
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import psycopg
from psycopg import errors, sql

from tether._core.errors import JournalError, NotAJournal, SchemaTooNew, UserError
from tether._journal.runner import Retry, ThreadRunner
from tether._journal.schema import APP, SCHEMA_VERSION, migrate

LOCK = re.compile(r"/\*LOCK ([^*]*)\*/")


@functools.lru_cache(maxsize=1024)
def translate(statement: str) -> str:
    """'?' placeholders to psycopg's; lock markers to FOR SHARE clauses."""
    return LOCK.sub(r"FOR SHARE OF \1", statement.replace("%", "%%").replace("?", "%s"))


class PgDb:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, statement: str, params: Any = ()) -> psycopg.Cursor[Any]:
        return self._conn.execute(translate(statement), params)


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

    def connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise JournalError(f"cannot connect to the journal at {self.shown}: {first}") from None
        try:
            self._check_or_init(conn)
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
        return PgDb(conn)

    def map_error(self, exc: Exception) -> Exception:
        if isinstance(exc, errors.DeadlockDetected | errors.SerializationFailure):
            return Retry(str(exc))
        if isinstance(exc, psycopg.OperationalError):
            return JournalError(f"lost the journal at {self.shown}: {exc}")
        if isinstance(exc, psycopg.Error):
            return JournalError(f"journal {self.shown}: {exc}")
        return exc
