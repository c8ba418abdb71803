"""Any number of processes starting at once on a fresh journal all succeed (no startup race)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import tether
from tether._journal import schema as journal_schema

from .conftest import PG_URL, need_pg

PROCESSES = 6
ROUNDS = 2

# Each process imports tether, says it is ready, and waits for the word to open the journal:
# all of them open it within a few milliseconds of each other.
OPENER = """
import asyncio, sys, tether
print("ready", flush=True)
sys.stdin.readline()
async def main():
    async with tether.Supervisor(sys.argv[1], keys=tether.KeyRing.ephemeral()):
        pass
asyncio.run(main())
"""


def open_at_once(url: str) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(PROCESSES)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        results.append((proc.returncode, err.strip()[-300:]))
    return results


@pytest.fixture
def fresh_schemas() -> Iterator[list[str]]:
    need_pg()
    names = [f"t_{uuid.uuid4().hex[:16]}" for _ in range(ROUNDS)]
    yield names
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(name)))


async def check_opens(url: str) -> None:
    async with tether.Supervisor(url, keys=tether.KeyRing.ephemeral()) as sup:
        assert await sup.journal.delegations() == []


async def test_concurrent_first_starts_on_sqlite(tmp_path: Path) -> None:
    for round_ in range(ROUNDS):
        url = f"sqlite:///{tmp_path / f'journal-{round_}.db'}"
        assert open_at_once(url) == [(0, "")] * PROCESSES
        await check_opens(url)


async def test_concurrent_first_starts_on_postgresql(fresh_schemas: list[str],
                                                     tmp_path: Path) -> None:
    for schema in fresh_schemas:
        url = f"{PG_URL}?schema={schema}&keys={tmp_path / 'keys'}"
        assert open_at_once(url) == [(0, "")] * PROCESSES
        await check_opens(url)


def version_1_statements(dialect: str) -> list[str]:
    return [t for s in journal_schema.MIGRATIONS[1] for t in journal_schema.statements(s, dialect)]


async def test_concurrent_migrations_on_sqlite(tmp_path: Path) -> None:
    """Six processes opening a version 1 journal at once: one migrates, none fails."""
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    for statement in version_1_statements("sqlite"):
        conn.execute(statement)
    conn.executemany("INSERT INTO tether_meta VALUES (?, ?)",
                     [("app", "tether"), ("schema_version", "1")])
    conn.commit()
    conn.close()
    url = f"sqlite:///{path}"
    assert open_at_once(url) == [(0, "")] * PROCESSES
    await check_opens(url)


async def test_concurrent_migrations_on_postgresql(fresh_schemas: list[str],
                                                   tmp_path: Path) -> None:
    name = fresh_schemas[0]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(name)))
        for statement in version_1_statements("postgresql"):
            conn.execute(statement)
        conn.execute("INSERT INTO tether_meta VALUES ('app', 'tether'), ('schema_version', '1')")
    url = f"{PG_URL}?schema={name}&keys={tmp_path / 'keys'}"
    assert open_at_once(url) == [(0, "")] * PROCESSES
    await check_opens(url)
