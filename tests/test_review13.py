"""Faults and inputs beyond those the reconnection and input work chose (issue 13's review):
each test here failed before its fix."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import parse_qsl, urlparse

import psycopg

from tests.conftest import PG_URL
from tether._chaos.pgserver import terminate
from tether._journal.journal import Journal
from tether._journal.rows import OwnerRow

WITHIN = 20.0  # seconds: a test that has not ended by then hangs, and fails


def named(url: str) -> tuple[str, str]:
    name = f"tether-test-{uuid.uuid4().hex[:12]}"
    return f"{url}&application_name={name}", name


def schema_of(url: str) -> str:
    return dict(parse_qsl(urlparse(url).query))["schema"]


async def test_a_reconnection_does_not_wait_on_the_schema_lock(pg_url: str) -> None:
    """Another process holds the schema's startup lock for as long as it likes (a process
    stopped in the middle of its first start, a long migration on another host). A journal
    already open whose connection is cut must reconnect to its existing schema without waiting
    on that lock: before, every reconnection took the lock, so the write hung for as long as
    the lock was held, far past the reconnection window, instead of committing or failing."""
    url, name = named(pg_url)
    async with Journal(url) as journal:
        await journal.flush()
        journal.reconnect_within = 2.0
        with psycopg.connect(PG_URL, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                           (f"tether.schema.{schema_of(pg_url)}",))
            try:
                with psycopg.connect(PG_URL, autocommit=True) as conn:
                    assert terminate(conn, name) >= 1
                owner = OwnerRow("o-locked", 1, "host", 1.0, 1.0)
                await asyncio.wait_for(journal.register_owner(owner), WITHIN)
            finally:
                holder.execute("ROLLBACK")
        assert "o-locked" in {o.id for o in await journal.owners()}
