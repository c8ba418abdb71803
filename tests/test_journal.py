"""The journal enforces I1, I2, I4, I7 and I10 itself, atomically; bad journals are refused."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import tether
from tether._journal import schema
from tether._journal import sqlite as sqlite_backend
from tether._journal.journal import Journal
from tether._journal.ops import FenceRefused
from tether._journal.rows import Begin, NewAction, NewDelegation
from tether.errors import (
    AlreadyFinished,
    BadSignature,
    IdempotencyConflict,
    JournalCorrupt,
    JournalLocked,
    KeyInUse,
    NotAJournal,
    NotFound,
    SchemaTooNew,
    StaleEpoch,
    StaleSequence,
    UnknownKey,
)
from tether.protocol import ControlIntent, ControlKind, Signed, SigningKey, TrustedKeys

KEY = SigningKey.generate()
TRUSTED = TrustedKeys([KEY.public])


@pytest.fixture
async def journal(journal_url: str) -> AsyncIterator[Journal]:
    async with Journal(journal_url) as j:
        await j.genesis(KEY, 0.0)  # KEY roots the journal's key registry
        yield j


def new_delegation(did: str = "d1", task: str = "t1", parent: str | None = None,
                   parent_epoch: int | None = None,
                   redelegate: int | None = None) -> NewDelegation:
    return NewDelegation(id=did, task_id=task, parent_id=parent, attempt=1, agent="agent",
                         surface=("pay",), args={}, owner_id="o", now=1.0,
                         redelegate_from_epoch=redelegate, parent_epoch=parent_epoch)


def new_action(aid: str = "a1", did: str = "d1", key: str = "k1", args: str = '{"x":1}',
               epoch: int = 0) -> NewAction:
    return NewAction(id=aid, delegation_id=did, epoch=epoch, ordinal=0, tool="pay",
                     effect=tether.Effect.EXTERNAL, args_json=args,
                     args_hash=hashlib.sha256(args.encode()).hexdigest(), idem_key=key, now=2.0,
                     deadline_at=32.0)


def control(seq: int = 1, did: str = "d1", kind: ControlKind = ControlKind.RECALL,
            epoch: int = 0) -> Signed:
    grace = 5.0 if kind is ControlKind.RECALL else None
    return KEY.sign(ControlIntent(kind, did, epoch, seq, grace, "r", 3.0))


async def test_intent_is_durable_before_started_is_returned(journal: Journal,
                                                           journal_url: str) -> None:
    """I1: STARTED means the row is committed; another connection sees it PENDING."""
    await journal.create_delegation(new_delegation())
    assert (await journal.begin_action(new_action())).status is Begin.STARTED
    async with Journal(journal_url, create=False) as other:
        assert [a.state for a in await other.actions(["d1"])] == [tether.ActionState.PENDING]


async def test_fence_refuses_new_actions_after_recall(journal: Journal) -> None:
    """I2: the refusal comes from the journal, with nothing written."""
    await journal.create_delegation(new_delegation())
    await journal.accept_control(control(), TRUSTED, "me", 3.0)
    assert (await journal.begin_action(new_action())).status is Begin.FENCED
    assert await journal.actions(["d1"]) == []


async def test_stale_epoch_is_fenced(journal: Journal) -> None:
    await journal.create_delegation(new_delegation())
    await journal.accept_control(control(), TRUSTED, "me", 3.0)
    await journal.create_delegation(new_delegation("d2", redelegate=0))
    assert (await journal.begin_action(new_action(did="d1"))).status is Begin.FENCED
    assert (await journal.begin_action(new_action(did="d2", epoch=0))).status is Begin.STALE_EPOCH
    assert (await journal.begin_action(new_action(did="d2", epoch=1))).status is Begin.STARTED


async def test_sequence_must_be_last_plus_one(journal: Journal) -> None:
    """I4: a gap or a duplicate is refused, naming the current sequence, and changes nothing."""
    await journal.create_delegation(new_delegation())
    with pytest.raises(StaleSequence) as gap:
        await journal.accept_control(control(seq=2), TRUSTED, "me", 3.0)
    assert gap.value.current == 0 and "current sequence is 0" in str(gap.value)
    row = await journal.get("d1")
    assert (row.state, row.fenced, row.control_seq) == (tether.DelegationState.RUNNING, False, 0)
    await journal.accept_control(control(seq=1), TRUSTED, "me", 3.0)
    with pytest.raises(StaleSequence) as dup:
        await journal.accept_control(control(seq=1), TRUSTED, "me", 3.0)
    assert dup.value.current == 1
    assert len(await journal.controls("d1")) == 1


async def test_racing_intents_exactly_one_wins(journal: Journal) -> None:
    await journal.create_delegation(new_delegation())
    results = await asyncio.gather(
        *(journal.accept_control(control(seq=1), TRUSTED, f"w{i}", 3.0) for i in range(5)),
        return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, StaleSequence) for r in results
               if isinstance(r, BaseException))


async def test_racing_redelegations_exactly_one_wins(journal: Journal) -> None:
    await journal.create_delegation(new_delegation())
    results = await asyncio.gather(
        *(journal.create_delegation(new_delegation(f"n{i}", redelegate=0)) for i in range(4)),
        return_exceptions=True)
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1 and winners[0].epoch == 1
    errors = [r for r in results if isinstance(r, StaleEpoch)]
    assert len(errors) == 3 and all(e.current == 1 for e in errors)


async def test_bad_signature_and_unknown_key_change_nothing(journal: Journal) -> None:
    """I5 at the journal: refused before the transaction."""
    await journal.create_delegation(new_delegation())
    good = control()
    with pytest.raises(BadSignature):
        await journal.accept_control(Signed(good.body, good.key_id, b"\0" * 64), TRUSTED,
                                     "me", 3.0)
    with pytest.raises(UnknownKey):
        await journal.accept_control(SigningKey.generate().sign(
            ControlIntent(ControlKind.RECALL, "d1", 0, 1, 5.0, "r", 3.0)),
            TRUSTED, "me", 3.0)
    row = await journal.get("d1")
    assert row.control_seq == 0 and not row.fenced and await journal.controls("d1") == []


async def test_terminal_delegation_refuses_control(journal: Journal) -> None:
    await journal.create_delegation(new_delegation())
    await journal.set_state("d1", tether.DelegationState.SUCCEEDED, 2.0)
    with pytest.raises(AlreadyFinished):
        await journal.accept_control(control(), TRUSTED, "me", 3.0)
    assert (await journal.get("d1")).control_seq == 0


async def test_subtree_is_fenced_in_the_same_transaction(journal: Journal) -> None:
    """I10: recalling the root fences every descendant; none can start an action or a child."""
    await journal.create_delegation(new_delegation("root", "t"))
    await journal.create_delegation(new_delegation("kid", "t/k", parent="root", parent_epoch=0))
    await journal.create_delegation(new_delegation("gk", "t/k/g", parent="kid", parent_epoch=0))
    await journal.accept_control(control(did="root"), TRUSTED, "me", 3.0)
    for did in ("root", "kid", "gk"):
        row = await journal.get(did)
        assert row.fenced and row.state is tether.DelegationState.RECALLING
        assert (await journal.begin_action(new_action(f"a-{did}", did, key=did))).status \
            is Begin.FENCED
    with pytest.raises(FenceRefused):
        await journal.create_delegation(new_delegation("new", "t/k/h", parent="gk",
                                                       parent_epoch=0))
    with pytest.raises(NotFound):
        await journal.get("new")


async def test_idempotency_key_rules(journal: Journal) -> None:
    """I7: the same key with other arguments is an error; a live key makes the caller wait for
    its outcome; an UNKNOWN one is in use until a person decides; a completed one replays; a
    key whose action provably did not apply may be used again."""
    await journal.create_delegation(new_delegation())
    assert (await journal.begin_action(new_action("a1"))).status is Begin.STARTED
    with pytest.raises(IdempotencyConflict):
        await journal.begin_action(new_action("a2", args='{"x":2}'))
    waiting = await journal.begin_action(new_action("a3"))
    assert (waiting.status, waiting.action_id) == (Begin.WAIT, "a1")
    journal.finish_action("a1", tether.ActionState.COMPLETED, 3.0, result="r1")
    replay = await journal.begin_action(new_action("a4"))
    assert (replay.status, replay.action_id, replay.result) == (Begin.REPLAY, "a1", "r1")
    assert [a.id for a in await journal.actions(["d1"])] == ["a1"]
    await journal.begin_action(new_action("b1", key="k2"))
    journal.finish_action("b1", tether.ActionState.FAILED, 3.0, error="declined")
    assert (await journal.begin_action(new_action("b2", key="k2"))).status is Begin.STARTED
    await journal.mark_in_doubt("d1", 4.0)
    await journal.settle_action("b2", tether.ActionState.UNKNOWN, 4.0, {"probe": "UNKNOWN"})
    # Until its deadline an UNKNOWN call may still land (its receipt would replay): wait.
    assert (await journal.begin_action(new_action("b3", key="k2"))).status is Begin.WAIT
    with pytest.raises(KeyInUse):  # past it, a person must decide
        await journal.begin_action(dataclasses.replace(new_action("b4", key="k2"), now=40.0))


async def test_late_receipt_is_kept_and_wins(journal: Journal) -> None:
    """I3: a completion after the action was declared in doubt is recorded, flagged late."""
    await journal.create_delegation(new_delegation())
    await journal.begin_action(new_action())
    assert await journal.mark_in_doubt("d1", 3.0) == ["a1"]
    await journal.settle_action("a1", tether.ActionState.NOT_APPLIED, 4.0, {"probe": "x"})
    journal.finish_action("a1", tether.ActionState.COMPLETED, 5.0, result="late")
    (action,) = await journal.actions(["d1"])
    assert (action.state, action.late, action.result) == (tether.ActionState.COMPLETED, True,
                                                          "late")


# -- journals that are not what they should be -----------------------------------------------

def snapshot(path: Path) -> bytes:
    return path.read_bytes()


async def test_text_file_is_not_a_journal(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("hello")
    with pytest.raises(NotAJournal, match="not a SQLite database"):
        await Journal(f"sqlite:///{path}").open()
    assert path.read_text() == "hello"


async def test_other_sqlite_database_is_not_a_journal(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    before = snapshot(path)
    with pytest.raises(NotAJournal, match="not a tether journal"):
        await Journal(f"sqlite:///{path}").open()
    assert snapshot(path) == before


async def test_missing_journal_is_not_created_when_asked_not_to(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    with pytest.raises(NotAJournal, match="no journal"):
        await Journal(f"sqlite:///{path}", create=False).open()
    assert not path.exists()


async def seeded(path: Path) -> None:
    async with Journal(f"sqlite:///{path}") as j:
        await j.create_delegation(new_delegation())
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await seeded(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE tether_meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    before = snapshot(path)
    with pytest.raises(SchemaTooNew) as info:
        await Journal(f"sqlite:///{path}").open()
    assert info.value.found == 99 and "upgrade tether" in str(info.value)
    assert snapshot(path) == before


async def test_corrupted_journal_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await seeded(path)
    data = bytearray(path.read_bytes())
    data[16:24] = b"\xff" * 8  # page size and format bytes of the header
    data[4096:4200] = b"\x00\xff" * 52
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt):
        async with Journal(f"sqlite:///{path}") as j:
            await j.delegations()


async def test_journal_locked_by_another_writer(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    await seeded(path)
    async with Journal(f"sqlite:///{path}?busy_timeout=0.05") as j:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(JournalLocked):
                await j.create_delegation(new_delegation("d2", "t2"))
        finally:
            other.execute("ROLLBACK")
            other.close()
        with pytest.raises(NotFound):
            await j.get("d2")


async def test_migration_path_runs_each_step_once(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "j.db"
    await seeded(path)
    steps = dict(schema.MIGRATIONS)
    nxt = schema.SCHEMA_VERSION + 1
    steps[nxt] = ("ALTER TABLE delegations ADD COLUMN note TEXT",)
    monkeypatch.setattr(schema, "MIGRATIONS", steps)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", nxt)
    monkeypatch.setattr(sqlite_backend, "SCHEMA_VERSION", nxt)
    async with Journal(f"sqlite:///{path}") as j:
        assert (await j.get("d1")).task_id == "t1"
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM tether_meta WHERE key='schema_version'").fetchone() \
        == (str(nxt),)
    assert "note" in [r[1] for r in conn.execute("PRAGMA table_info(delegations)")]
    conn.close()


@pytest.mark.parametrize("url", ["mysql://x", "postgresql://h/db?schema=no-pe",
                                 "sqlite://host/x.db", "sqlite:///", "journal.db",
                                 "sqlite:///j.db?synchronous=sometimes"])
def test_bad_url_is_a_user_error(url: str) -> None:
    with pytest.raises(tether.errors.UserError):
        Journal(url)


@pytest.mark.parametrize(("durable", "query", "level"), [
    (True, "", 2), (False, "", 1), (True, "?synchronous=off", 0)])
async def test_durability_setting(tmp_path: Path, durable: bool, query: str, level: int) -> None:
    """FULL survives power loss; durable=False (NORMAL) survives a process crash."""
    async with Journal(f"sqlite:///{tmp_path / 'j.db'}{query}", durable=durable) as j:
        assert await j._read(lambda db: db.execute("PRAGMA synchronous").fetchone()[0]) == level


async def test_a_connection_lost_inside_a_batch_fails_its_operations_never_hangs(
        sqlite_url: str) -> None:
    """The writer thread must never die with operations waiting: a connection that breaks
    between two operations of one batch (here, closed by the first) fails the batch with a
    clear error, and the thread still answers what comes next."""
    journal = Journal(sqlite_url)
    await journal.open()
    try:
        runner = journal._runner

        def lose_the_connection(db: sqlite3.Connection) -> None:
            db.close()  # gone before the batch's SAVEPOINT bookkeeping and its COMMIT

        first = runner.submit(lose_the_connection, write=True)
        second = runner.submit(lambda db: None, write=True)
        assert first is not None and second is not None
        results = await asyncio.wait_for(
            asyncio.gather(first, second, return_exceptions=True), 10.0)
        assert all(isinstance(r, Exception) for r in results), results
        third = runner.submit(lambda db: None, write=True)
        assert third is not None
        done, _ = await asyncio.wait([third], timeout=10.0)
        assert done, "the writer left an operation waiting"  # answered (an error), not hung
        assert isinstance(third.exception(), Exception)
    finally:
        await asyncio.wait_for(journal.close(), 10.0)
