"""Each table's columns are declared once (``tether._core.columns``): a journal migrated to the
current schema has exactly them, in their order, of their types, on SQLite and PostgreSQL; the
chain's order, the select lists and the inserts are derived from them."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import psycopg
import pytest

from tests.conftest import PG_URL
from tether._core import chain, columns
from tether._core.columns import TABLES
from tether._journal.journal import Journal

_PG_TYPES = {"TEXT": {"text"}, "INTEGER": {"integer", "bigint"}, "REAL": {"double precision"},
             "BLOB": {"bytea"}}


async def test_a_fresh_sqlite_journal_has_exactly_the_declared_columns(sqlite_url: str) -> None:
    async with Journal(sqlite_url) as journal:
        await journal.delegations()  # opened, migrated
    import sqlite3
    conn = sqlite3.connect(urlparse(sqlite_url).path[1:])
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == set(TABLES)
    for name, table in TABLES.items():
        found = [(r[1], r[2], bool(r[3]) or bool(r[5]))
                 for r in conn.execute(f"PRAGMA table_info({name})")]
        assert found == [(c.name, c.type, c.required) for c in table.columns], name
    conn.close()


async def test_a_fresh_postgresql_journal_has_exactly_the_declared_columns(pg_url: str) -> None:
    async with Journal(pg_url) as journal:
        await journal.delegations()
    schema = parse_qs(urlparse(pg_url).query)["schema"][0]
    with psycopg.connect(PG_URL) as conn:
        rows = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable FROM "
            "information_schema.columns WHERE table_schema = %s "
            "ORDER BY table_name, ordinal_position", (schema,)).fetchall()
    found: dict[str, list[tuple[str, str, bool]]] = {}
    for table, column, kind, nullable in rows:
        found.setdefault(table, []).append((column, kind, nullable == "NO"))
    assert set(found) == set(TABLES)
    for name, table in TABLES.items():
        assert [c for c, _, _ in found[name]] == list(table.names), name
        for (column, kind, required), declared in zip(found[name], table.columns, strict=True):
            assert kind in _PG_TYPES[declared.type], (name, column, kind)
            assert required == declared.required, (name, column)


def test_the_chains_column_order_is_the_declared_one_and_never_moves() -> None:
    """A journal's hashes depend on this order: it is the order of the columns as each table
    was first made, and a change to it would make every existing journal fail ``verify``."""
    assert chain.COLUMNS == {
        "delegations": (
            "id, task_id, parent_id, epoch, attempt, agent, surface, args, owner_id, state, "
            "fenced, control_seq, created_at, updated_at, result, error, failure, model, "
            "trace_id, ended_at, work_body, work_key, work_sig"),
        "actions": (
            "id, delegation_id, ordinal, tool, effect, args, args_hash, idem_key, state, "
            "result, error, evidence, late, started_at, ended_at, deadline_at"),
        "controls": "id, delegation_id, seq, kind, body, key_id, signature, accepted_at, issuer",
        "documents": "id, delegation_id, seq, type, body, key_id, signature, recorded_at",
        "events": "id, delegation_id, action_id, at, kind, detail",
    }
    for table, listed in chain.COLUMNS.items():
        assert listed == TABLES[table].select()


def test_an_insert_or_a_pick_names_only_columns() -> None:
    assert columns.OWNERS.insert(("id", "pid")) == "INSERT INTO owners (id, pid) VALUES (?, ?)"
    with pytest.raises(KeyError, match="not columns of owners"):
        columns.OWNERS.insert(("id", "pids"))
    with pytest.raises(KeyError, match="not columns of owners"):
        columns.OWNERS.insert(("id", "id"))
    with pytest.raises(KeyError, match="has no column nope"):
        columns.OWNERS.pick(without=("nope",))
