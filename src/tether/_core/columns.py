"""The journal's tables as data: each table's columns, in their order, declared once.

The schema's migrations (``_journal/schema.py``) are frozen history: they say how a journal of
each version was made, and a test checks that a journal migrated to the current version has
exactly these columns, in this order, of these types, on SQLite and on PostgreSQL. Everything
else is derived from here: the chain's order of a record's columns (``chain.COLUMNS``, which a
journal's hashes depend on), the select lists and the positions the row decoders read by name,
and the column lists of inserts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

TYPES = frozenset({"TEXT", "INTEGER", "REAL", "BLOB"})


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str  # one of TYPES (PostgreSQL: text, integer or bigint, double precision, bytea)
    required: bool  # NOT NULL


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    names: tuple[str, ...] = field(init=False)  # the columns' names, in order

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(c.name for c in self.columns))

    def pick(self, without: Collection[str] = ()) -> tuple[str, ...]:
        """The columns in their order, less ``without`` (each of which must be one)."""
        unknown = set(without) - set(self.names)
        if unknown:
            raise KeyError(f"{self.name} has no column {', '.join(sorted(unknown))}")
        return tuple(n for n in self.names if n not in without)

    def select(self, without: Collection[str] = (), alias: str = "") -> str:
        """``a, b, c`` (``x.a, x.b, x.c`` with an alias): a select list in the table's order."""
        prefix = f"{alias}." if alias else ""
        return ", ".join(prefix + n for n in self.pick(without))

    def insert(self, names: Iterable[str], tail: str = "", rows: int = 1) -> str:
        """``INSERT INTO t (a, b) VALUES (?, ?)`` (``rows`` rows of them), then ``tail``:
        every name checked to be a column."""
        chosen = self.named(names)
        one = f"({', '.join('?' * len(chosen))})"
        return f"{self.into(chosen)} VALUES {', '.join([one] * rows)}{tail}"

    def into(self, names: Iterable[str]) -> str:
        """``INSERT INTO t (a, b)``, for an ``INSERT ... SELECT``."""
        return f"INSERT INTO {self.name} ({', '.join(self.named(names))})"

    def named(self, names: Iterable[str]) -> tuple[str, ...]:
        chosen = tuple(names)
        unknown = [n for n in chosen if n not in self.names]
        if unknown or len(set(chosen)) != len(chosen):
            raise KeyError(f"not columns of {self.name} (or given twice): {chosen}")
        return chosen


def positions(names: tuple[str, ...]) -> dict[str, int]:
    """Where each column of a select list is in its rows: decoders read a row by name."""
    return {n: i for i, n in enumerate(names)}


def _table(name: str, spec: str) -> Table:
    """``"id TEXT!, note TEXT"``: name, type, ``!`` for NOT NULL."""
    columns = []
    for item in spec.split(","):
        col, kind = item.split()
        required = kind.endswith("!")
        kind = kind.rstrip("!")
        assert kind in TYPES, kind
        columns.append(Column(col, kind, required))
    return Table(name, tuple(columns))


META = _table("tether_meta", "key TEXT!, value TEXT!")
OWNERS = _table("owners", "id TEXT!, pid INTEGER!, host TEXT!, started_at REAL!, "
                "heartbeat_at REAL!, lease_until REAL")
TASKS = _table("tasks", "id TEXT!, epoch INTEGER!, cancel_gen INTEGER!")
DELEGATIONS = _table(
    "delegations",
    "id TEXT!, task_id TEXT!, parent_id TEXT, epoch INTEGER!, attempt INTEGER!, agent TEXT!, "
    "surface TEXT!, args TEXT!, owner_id TEXT!, state TEXT!, fenced INTEGER!, "
    "control_seq INTEGER!, created_at REAL!, updated_at REAL!, result TEXT, error TEXT, "
    "failure TEXT, model TEXT, trace_id TEXT, ended_at REAL, work_body BLOB, work_key TEXT, "
    "work_sig BLOB")
ACTIONS = _table(
    "actions",
    "id TEXT!, delegation_id TEXT!, ordinal INTEGER!, tool TEXT!, effect TEXT!, args TEXT!, "
    "args_hash TEXT!, idem_key TEXT!, state TEXT!, result TEXT, error TEXT, evidence TEXT, "
    "late INTEGER!, started_at REAL!, ended_at REAL, deadline_at REAL")
CONTROLS = _table(
    "controls",
    "id INTEGER!, delegation_id TEXT!, seq INTEGER!, kind TEXT!, body BLOB!, key_id TEXT!, "
    "signature BLOB!, accepted_at REAL!, issuer TEXT!")
DOCUMENTS = _table(
    "documents",
    "id INTEGER!, delegation_id TEXT!, seq INTEGER!, type TEXT!, body BLOB!, key_id TEXT!, "
    "signature BLOB!, recorded_at REAL!")
EVENTS = _table("events", "id INTEGER!, delegation_id TEXT, action_id TEXT, at REAL!, "
                "kind TEXT!, detail TEXT!")
QUEUE = _table("queue", "delegation_id TEXT!, task_id TEXT!, agent TEXT!, enqueued_at REAL!, "
               "claimed_by TEXT, claimed_at REAL, done_at REAL")
TRUST = _table("trust", "id INTEGER!, op TEXT!, key_id TEXT!, body BLOB!, signer TEXT!, "
               "signature BLOB!, recorded_at REAL!")
CHAIN = _table("chain", "delegation_id TEXT!, seq INTEGER!, record TEXT!, content BLOB!, "
               "pre BLOB!, hash BLOB!")
# A head's seal: in the head (``path``, ``seal``, ``signer``, ``signature``: version 6), or
# once per commit in ``chain_seals``, the head keeping its binary path to it (``proof``).
CHAIN_HEADS = _table("chain_heads", "delegation_id TEXT!, length INTEGER!, hash TEXT!, "
                     "legacy INTEGER!, path TEXT, seal BLOB, signer TEXT, signature BLOB, "
                     "seal_id INTEGER, proof BLOB")
CHAIN_SEALS = _table("chain_seals", "id INTEGER!, seal BLOB!, signer TEXT!, signature BLOB!")

TABLES: dict[str, Table] = {t.name: t for t in (
    META, OWNERS, TASKS, DELEGATIONS, ACTIONS, CONTROLS, DOCUMENTS, EVENTS, QUEUE, TRUST, CHAIN,
    CHAIN_HEADS, CHAIN_SEALS)}

__all__ = ["ACTIONS", "CHAIN", "CHAIN_HEADS", "CHAIN_SEALS", "CONTROLS", "DELEGATIONS",
           "DOCUMENTS", "EVENTS", "META", "OWNERS", "QUEUE", "TABLES", "TASKS", "TRUST", "Column",
           "Table", "positions"]
