"""The journal's tables, and the path from one schema version to the next.

The SQL is kept portable (SQLite and PostgreSQL): TEXT ids, REAL seconds, INTEGER flags,
recursive CTEs for subtrees and a partial unique index for live idempotency keys.
"""

from __future__ import annotations

import re
from typing import Any

SCHEMA_VERSION = 7
APP = "tether"

# MIGRATIONS[n] brings a journal from version n-1 to n. Each runs in one transaction.
# A step is portable SQL (``ddl`` adapts it), or its statements for each dialect.
MIGRATIONS: dict[int, tuple[str | dict[str, tuple[str, ...]], ...]] = {
    1: (
        """CREATE TABLE tether_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
        """CREATE TABLE owners (
            id TEXT PRIMARY KEY, pid INTEGER NOT NULL, host TEXT NOT NULL,
            started_at REAL NOT NULL, heartbeat_at REAL NOT NULL)""",
        # cancel_gen: bumped by every cancel, recall or terminate of the task, even between
        # attempts, so a re-dispatch can tell that somebody asked it to stop (I6).
        """CREATE TABLE tasks (id TEXT PRIMARY KEY, epoch INTEGER NOT NULL,
            cancel_gen INTEGER NOT NULL DEFAULT 0)""",
        """CREATE TABLE delegations (
            id TEXT PRIMARY KEY,
            task_id TEXT NOT NULL REFERENCES tasks(id),
            parent_id TEXT REFERENCES delegations(id),
            epoch INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            agent TEXT NOT NULL,
            surface TEXT NOT NULL,
            args TEXT NOT NULL,
            owner_id TEXT NOT NULL,
            state TEXT NOT NULL,
            fenced INTEGER NOT NULL DEFAULT 0,
            control_seq INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            result TEXT,
            error TEXT,
            failure TEXT,
            model TEXT,
            trace_id TEXT,
            ended_at REAL)""",
        """CREATE INDEX delegations_parent ON delegations(parent_id)""",
        """CREATE INDEX delegations_task ON delegations(task_id)""",
        """CREATE INDEX delegations_state ON delegations(state)""",
        """CREATE TABLE actions (
            id TEXT PRIMARY KEY,
            delegation_id TEXT NOT NULL REFERENCES delegations(id),
            ordinal INTEGER NOT NULL,
            tool TEXT NOT NULL,
            effect TEXT NOT NULL,
            args TEXT NOT NULL,
            args_hash TEXT NOT NULL,
            idem_key TEXT NOT NULL,
            state TEXT NOT NULL,
            result TEXT,
            error TEXT,
            evidence TEXT,
            late INTEGER NOT NULL DEFAULT 0,
            started_at REAL NOT NULL,
            ended_at REAL)""",
        """CREATE INDEX actions_delegation ON actions(delegation_id, state)""",
        """CREATE INDEX actions_key ON actions(idem_key)""",
        # A key may be reused only after an outcome that proves nothing was applied.
        """CREATE UNIQUE INDEX actions_live_key ON actions(idem_key)
            WHERE state NOT IN ('FAILED', 'NOT_APPLIED')""",
        """CREATE TABLE controls (
            id INTEGER PRIMARY KEY,
            delegation_id TEXT NOT NULL REFERENCES delegations(id),
            seq INTEGER NOT NULL,
            kind TEXT NOT NULL,
            body BLOB NOT NULL,
            key_id TEXT NOT NULL,
            signature BLOB NOT NULL,
            accepted_at REAL NOT NULL,
            issuer TEXT NOT NULL,
            UNIQUE (delegation_id, seq))""",
        """CREATE TABLE documents (
            id INTEGER PRIMARY KEY,
            delegation_id TEXT NOT NULL REFERENCES delegations(id),
            seq INTEGER NOT NULL,
            type TEXT NOT NULL,
            body BLOB NOT NULL,
            key_id TEXT NOT NULL,
            signature BLOB NOT NULL,
            recorded_at REAL NOT NULL,
            UNIQUE (delegation_id, seq, type))""",
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            delegation_id TEXT,
            action_id TEXT,
            at REAL NOT NULL,
            kind TEXT NOT NULL,
            detail TEXT NOT NULL)""",
        """CREATE INDEX events_delegation ON events(delegation_id, kind)""",
        """CREATE INDEX events_action ON events(action_id)""",
    ),
    # Workers: delegations queued for another process, and leases on the owners that claim
    # them. An owner whose lease_until has passed is fenced by the journal (NULL: no lease).
    2: (
        """ALTER TABLE owners ADD COLUMN lease_until REAL""",
        """CREATE TABLE queue (
            delegation_id TEXT PRIMARY KEY REFERENCES delegations(id),
            task_id TEXT NOT NULL,
            agent TEXT NOT NULL,
            enqueued_at REAL NOT NULL,
            claimed_by TEXT,
            claimed_at REAL,
            done_at REAL)""",
        """CREATE INDEX queue_waiting ON queue(agent, enqueued_at) WHERE claimed_by IS NULL""",
        """CREATE INDEX delegations_owner ON delegations(owner_id, state)""",
    ),
    # The outcome model: each intent carries the time after which its call can no longer
    # apply (the tool's dispatch deadline), so that any process can tell when a probe's
    # "not applied" is final. NULL (older rows): started_at plus the default deadline.
    3: (
        """ALTER TABLE actions ADD COLUMN deadline_at REAL""",
    ),
    # Authentic control: the deployment's key registry (signed entries, one root), and the
    # delegating orchestrator's signature over each delegation's work (docs/security.md).
    4: (
        """CREATE TABLE trust (
            id INTEGER PRIMARY KEY,
            op TEXT NOT NULL,
            key_id TEXT NOT NULL,
            body BLOB NOT NULL,
            signer TEXT NOT NULL,
            signature BLOB NOT NULL,
            recorded_at REAL NOT NULL)""",
        """CREATE UNIQUE INDEX trust_one_root ON trust(op) WHERE op = 'root'""",
        """ALTER TABLE delegations ADD COLUMN work_body BLOB""",
        """ALTER TABLE delegations ADD COLUMN work_key TEXT""",
        """ALTER TABLE delegations ADD COLUMN work_sig BLOB""",
    ),
    # The operator's triage (``tether ls`` filters, ``tether actions``): newest first, by
    # state or agent, read through an index at any journal size.
    5: (
        """CREATE INDEX delegations_created ON delegations(created_at, id)""",
        """CREATE INDEX delegations_state_created ON delegations(state, created_at, id)""",
        """CREATE INDEX delegations_agent_created ON delegations(agent, created_at, id)""",
        """CREATE INDEX actions_state_started ON actions(state, started_at, id)""",
    ),
    # The tamper-evident journal (``_core.chain``): each delegation's chain of entries, one
    # per record a commit wrote, and its head, sealed by the writer's signature over a Merkle
    # root of the heads that commit moved. Delegations older than this version get a head
    # marked legacy: their records written before it are "unchained", not failures.
    6: (
        """CREATE TABLE chain (
            delegation_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            record TEXT NOT NULL,
            content TEXT NOT NULL,
            pre TEXT NOT NULL,
            hash TEXT NOT NULL,
            PRIMARY KEY (delegation_id, seq))""",
        """CREATE TABLE chain_heads (
            delegation_id TEXT PRIMARY KEY,
            length INTEGER NOT NULL,
            hash TEXT NOT NULL,
            legacy INTEGER NOT NULL DEFAULT 0,
            path TEXT,
            seal BLOB,
            signer TEXT,
            signature BLOB)""",
        """INSERT INTO chain_heads (delegation_id, length, hash, legacy)
            SELECT id, 0, '', 1 FROM delegations""",
    ),
    # A commit's seal written once (``chain_seals``), its heads naming it with a binary path
    # to its root, where each head held its own copy of the seal and a path as text (about
    # 900 of the 1,250 bytes a head took). Heads sealed before keep their form until their
    # next commit. The chain's hashes as their 32 bytes, not 64 hex characters (the table
    # keeps its rowid on SQLite: WITHOUT ROWID took 200 bytes less a delegation, and its
    # scattered inserts of whole rows 15 us more CPU an action). A value that is not
    # lowercase hex (written by hand) is kept as its bytes, for verify to name.
    7: (
        """CREATE TABLE chain_seals (
            id INTEGER PRIMARY KEY,
            seal BLOB NOT NULL,
            signer TEXT NOT NULL,
            signature BLOB NOT NULL)""",
        {"sqlite": ("ALTER TABLE chain_heads ADD COLUMN seal_id INTEGER",),
         "postgresql": ("ALTER TABLE chain_heads ADD COLUMN seal_id BIGINT",)},
        """ALTER TABLE chain_heads ADD COLUMN proof BLOB""",
        # Whether a head still names a seal, asked when one moves off it and by a prune.
        """CREATE INDEX chain_heads_seal ON chain_heads(seal_id) WHERE seal_id IS NOT NULL""",
        {"sqlite": (
            """CREATE TABLE chain_next (
                delegation_id TEXT NOT NULL,
                seq INTEGER NOT NULL,
                record TEXT NOT NULL,
                content BLOB NOT NULL,
                pre BLOB NOT NULL,
                hash BLOB NOT NULL,
                PRIMARY KEY (delegation_id, seq))""",
            """INSERT INTO chain_next SELECT delegation_id, seq, record,
                tether_unhex(CAST(content AS BLOB)), tether_unhex(CAST(pre AS BLOB)),
                tether_unhex(CAST(hash AS BLOB)) FROM chain""",
            "DROP TABLE chain",
            "ALTER TABLE chain_next RENAME TO chain"),
         "postgresql": (
            "ALTER TABLE chain " + ", ".join(
                f"ALTER COLUMN {c} TYPE BYTEA USING CASE WHEN {c} ~ '^([0-9a-f][0-9a-f])*$' "
                f"THEN decode({c}, 'hex') ELSE convert_to({c}, 'UTF8') END"
                for c in ("content", "pre", "hash")),)},
    ),
}


def ddl(statement: str, dialect: str) -> str:
    if dialect == "sqlite":
        return statement
    return (statement
            .replace("INTEGER PRIMARY KEY", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
            .replace(" REAL", " DOUBLE PRECISION")
            .replace(" BLOB", " BYTEA"))


def statements(step: str | dict[str, tuple[str, ...]], dialect: str) -> tuple[str, ...]:
    """What one step of a migration runs on ``dialect``."""
    return step[dialect] if isinstance(step, dict) else (ddl(step, dialect),)


_HEX = re.compile(rb"(?:[0-9a-f]{2})*")


def _unhex(value: object) -> object:
    """A hash as its bytes (version 7); anything else as its own bytes, named by verify.
    Given as bytes (``CAST(.. AS BLOB)``): a TEXT value written by hand need not be UTF-8."""
    if isinstance(value, bytes) and _HEX.fullmatch(value):
        return bytes.fromhex(value.decode("ascii"))
    return value


META_SET = ("DELETE FROM tether_meta WHERE key = ?",
            "INSERT INTO tether_meta (key, value) VALUES (?, ?)")


def migrate(conn: Any, found: int, dialect: str) -> None:
    """Apply each migration after ``found`` in order, inside the caller's transaction."""
    if dialect == "sqlite":
        conn.create_function("tether_unhex", 1, _unhex, deterministic=True)
    for version in range(found + 1, SCHEMA_VERSION + 1):
        for step in MIGRATIONS[version]:
            for statement in statements(step, dialect):
                conn.execute(statement)
    for key, value in (("app", APP), ("schema_version", str(SCHEMA_VERSION))):
        mark = "?" if dialect == "sqlite" else "%s"
        conn.execute(META_SET[0].replace("?", mark), (key,))
        conn.execute(META_SET[1].replace("?", mark), (key, value))
