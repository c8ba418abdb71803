"""A write batch runs without a savepoint per operation until one of them fails; it is then
rolled back and runs again, each operation undone alone. Nothing its first run read or wrote
may be remembered outside the journal: the configuration's memory of the key registry is
advanced only once the batch committed."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.journal_helpers import writer_held
from tests.test_trust import raw
from tether._core.signing import Signed, TrustedKeys
from tether._core.trust import Registry
from tether._journal.inline import MemorySqlite, shared_database
from tether._journal.journal import Journal
from tether._sim.loop import SimLoop, run
from tether.errors import ControlRefused, JournalError


def _change(journal: Journal, by: tether.KeyRing, op: str,
            key: tether.KeyRing) -> Coroutine[Any, Any, Registry]:
    """``by`` trusts or revokes ``key``'s signing key in ``journal``."""
    return journal.change_trust(by.signer, by.trusted, op, key.signer.key_id,
                                key.signer.public_b64(), "contractor", time.time())


async def _revocation_deleted(j: Journal, pins: TrustedKeys) -> Registry:
    """An intruder with write access deletes the revocation; the registry as ``pins`` root it
    is read then."""
    await raw(j, "DELETE FROM trust WHERE op = 'revoke'")
    return await j.registry(pins)


async def _revoked_once_seen(journal_url: str, tmp_path: Path
                             ) -> tuple[tether.KeyRing, tether.KeyRing]:
    """The deployment trusts key K (``leaked``), an observer's configuration (pinning the
    deployment's root) reads the registry with K trusted, then the deployment revokes K.
    Returns K's ring and the observer's, which has not read the revocation yet."""
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    leaked = tether.KeyRing.init(tmp_path / "leaked")
    observer = tether.KeyRing.init(tmp_path / "observer", pins={
        deployment.signer.key_id: deployment.signer.public_b64()})
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await _change(sup.journal, deployment, "trust", leaked)
    async with Journal(journal_url) as j:
        assert leaked.signer.key_id in (await j.registry(observer.trusted)).keys
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await _change(sup.journal, deployment, "revoke", leaked)
    return leaked, observer


def _full_disk_once(memory: Any) -> Callable[[], None]:
    """The configuration's registry.json cannot be written, once (a full disk). Returns what
    puts the real save back."""
    save = memory._save
    failing = [True]

    def full_disk(marks: Any) -> None:
        if failing[0]:
            failing[0] = False
            raise OSError(28, "No space left on device")
        save(marks)

    memory._save = full_disk

    def undo() -> None:
        memory._save = save

    return undo


async def _batched(sup: tether.Supervisor, *coros: Coroutine[Any, Any, Any]) -> list[Any]:
    """Run ``coros`` so that their operations land in one batch of the writer thread: a first
    operation holds the thread until all of them are queued. Returns their outcomes, and
    checks that the batch failed once and ran again with savepoints."""
    runner: Any = sup.journal._runner
    runs: list[bool] = []
    run_batch = runner._run_batch

    def watched(conn: Any, batch: Any, careful: bool = False) -> Any:
        runs.append(careful)
        return run_batch(conn, batch, careful)

    runner._run_batch = watched
    hold = threading.Event()
    blocker = runner.submit(lambda db: hold.wait(5), write=False)
    submit, submitted, all_queued = runner.submit, [], asyncio.Event()

    def counted(*args: Any, **kw: Any) -> Any:
        submitted.append(args)
        if len(submitted) == len(coros):
            all_queued.set()
        return submit(*args, **kw)

    runner.submit = counted
    tasks = [asyncio.ensure_future(c) for c in coros]
    await all_queued.wait()  # each has queued its operation behind the hold
    hold.set()
    await blocker
    outcomes = list(await asyncio.gather(*tasks, return_exceptions=True))
    runner._run_batch, runner.submit = run_batch, submit
    assert True in runs, runs  # the batch failed once and ran again, each operation alone
    return outcomes


async def test_a_trust_change_batched_with_a_refused_intent_is_not_a_registry_rollback(
        journal_url: str, tmp_path: Path) -> None:
    """The first run of the batch reads the registry with the new grant in it, then another
    operation of the batch is refused: the batch is rolled back and runs again. On PostgreSQL
    the grant's id comes from a sequence a rollback does not give back, so the grant that
    commits has another id: a configuration that remembered the first run's registry would
    read its own journal's registry as rolled back by hand, and go on doing so."""
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    other = tether.KeyRing.init(tmp_path / "other")
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await sup.current_trust()
        bogus = Signed(b'{"type":"control"}', "0000000000000000", b"\0" * 64)
        trusted, refused = await _batched(
            sup,
            _change(sup.journal, deployment, "trust", other),
            sup.journal.accept_control(bogus, deployment.trusted, "mallory", time.time()))
        assert isinstance(refused, ControlRefused), refused
        assert not isinstance(trusted, BaseException), trusted
        assert other.signer.key_id in trusted.keys
        assert not trusted.problems, trusted.problems
        reg = await sup.journal.registry(deployment.trusted)
        assert other.signer.key_id in reg.keys
        assert not reg.problems, reg.problems
    # And a fresh process of the same configuration (registry.json on disk):
    again = tether.KeyRing.load(tmp_path / "deployment")
    async with tether.Supervisor(journal_url, keys=again) as sup:
        reg = await sup.journal.registry(again.trusted)
        assert not reg.problems, reg.problems


async def _beside_a_posted_write(j: Journal, read: Coroutine[Any, Any, Any]) -> Any:
    """Run ``read`` (a journal read) in one batch of the writer thread with a posted write (an
    event nobody waits for) and nothing else."""
    runner: Any = j._runner
    blocker, hold = await writer_held(runner)
    submit, run_batch, queued, sizes = runner.submit, runner._run_batch, asyncio.Event(), []

    def counted(fn: Any, *, write: bool, wait: bool = True, **kw: Any) -> Any:
        future = submit(fn, write=write, wait=wait, **kw)
        if not write:
            queued.set()
        return future

    def watched(conn: Any, batch: Any, careful: bool = False) -> Any:
        sizes.append(len(batch))
        return run_batch(conn, batch, careful)

    runner.submit, runner._run_batch = counted, watched
    j.event(time.time(), "note")  # posted: rides the next batch
    task = asyncio.ensure_future(read)
    await queued.wait()  # the read is queued behind the posted write
    hold.set()
    await blocker
    value = await task
    runner.submit, runner._run_batch = submit, run_batch
    assert 2 in sizes, sizes  # the posted write and the read: one batch
    return value


async def test_a_revocation_read_beside_a_posted_write_is_remembered(
        journal_url: str, tmp_path: Path) -> None:
    """A registry read inside a write batch is remembered once the batch committed, whoever
    waits on it: here a read (``chain_verdicts``: what `tether verify`, reconciliation and
    re-delegation decide by) shares its batch with a posted write alone. Forgotten, the
    revocation it read would let an intruder delete it, and the configuration would trust
    the revoked key again with no rollback named."""
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    leaked = tether.KeyRing.init(tmp_path / "leaked")
    observer = tether.KeyRing.init(tmp_path / "observer", pins={
        deployment.signer.key_id: deployment.signer.public_b64()})
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        for op in ("trust", "revoke"):
            await _change(sup.journal, deployment, op, leaked)
    async with Journal(journal_url) as j:
        # The observer's configuration makes a trust decision: it reads the registry, with
        # the revocation, at a chain verification.
        assert await _beside_a_posted_write(j, j.chain_verdicts([], observer.trusted)) == []
        await j.flush()
        # An intruder with write access deletes the revocation.
        again = await _revocation_deleted(j, observer.trusted)
        assert leaked.signer.key_id not in again.keys, "a revoked key is trusted again"
        assert any("rolled back" in p for p in again.problems), again.problems


async def test_a_revocation_read_by_a_refused_write_is_remembered(
        journal_url: str, tmp_path: Path) -> None:
    """A configuration that saw key K trusted is handed a control intent signed by K after
    another configuration revoked K. The write that judges it reads the registry (with the
    revocation: committed, by someone else), refuses the intent, and is rolled back. The
    revocation it read is genuine and committed; forgetting it with the rolled-back batch
    lets an intruder delete the revocation row and have K trusted again, no rollback named.
    """
    leaked, observer = await _revoked_once_seen(journal_url, tmp_path)
    async with Journal(journal_url) as j:
        # The revoked key's holder tries a control: the observer's journal refuses it (a
        # lone write batch: it reads the registry, refuses, rolls back).
        forged = Signed(b'{"type":"control"}', leaked.signer.key_id, b"\0" * 64)
        with pytest.raises(ControlRefused):
            await j.accept_control(forged, observer.trusted, "mallory", time.time())
        # An intruder with write access deletes the revocation.
        again = await _revocation_deleted(j, observer.trusted)
        assert leaked.signer.key_id not in again.keys, "a revoked key is trusted again"
        assert any("rolled back" in p for p in again.problems), again.problems


async def test_a_write_reported_failed_did_not_commit_when_the_registry_memory_cannot_be_saved(
        journal_url: str, tmp_path: Path) -> None:
    """The configuration's registry.json cannot be written (a full disk) when a trust change
    commits. Its caller must not be told it failed while it committed (it would make the
    change again, or act on a refusal that is not one)."""
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    other = tether.KeyRing.init(tmp_path / "other")
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await sup.current_trust()
    undo = _full_disk_once(deployment.trusted.memory)
    async with Journal(journal_url) as j:
        try:
            await _change(j, deployment, "trust", other)
        except Exception as exc:  # reported failed: then it must not have committed
            failed: BaseException | None = exc
        else:
            failed = None
        undo()
        reg = await j.registry(deployment.trusted)
    if failed is not None:
        assert other.signer.key_id not in reg.keys, (
            f"reported failed ({failed!r}) but the grant committed")


def test_a_registry_memory_that_cannot_be_saved_after_a_lost_commit_fails_only_its_batch(
        tmp_path: Path) -> None:
    """The same full disk when the batch's COMMIT reply was lost and the read-back says it
    committed (the simulator's runner: PostgreSQL's ``Lost`` path). Every caller must get an
    answer and the journal must go on working."""
    anchor = shared_database("after-lost")
    lose = [False]

    def lose_commit(wrote: bool) -> Any:
        if wrote and lose[0]:
            lose[0] = False
            return "after"
        return None

    runner = MemorySqlite("after-lost", lose_commit=lose_commit)
    journal = Journal("sqlite:///sim/journal.db", runner=runner)
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    other = tether.KeyRing.init(tmp_path / "other")

    async def main() -> tuple[Any, Any]:
        await journal.open()
        await journal.genesis(deployment.signer, 1.0)
        await journal.registry(deployment.trusted)
        undo = _full_disk_once(deployment.trusted.memory)
        lose[0] = True
        try:
            first: Any = await asyncio.wait_for(journal.change_trust(
                deployment.signer, deployment.trusted, "trust", other.signer.key_id,
                other.signer.public_b64(), "contractor", 2.0), 30)
        except TimeoutError:
            first = "no answer"
        except Exception as exc:
            first = exc
        undo()
        try:
            journal.event(3.0, "note")
            later: Any = await asyncio.wait_for(journal.flush(), 30)
        except TimeoutError:
            later = "no answer"
        except Exception as exc:
            later = exc
        await journal.close()
        return first, later

    first, later = run(SimLoop(random.Random(0)), main())
    anchor.close()
    assert first != "no answer", "the caller of a committed batch waits for ever"
    assert later is None, f"the journal stopped working after it: {later!r}"


def test_a_key_remembered_revoked_stays_revoked_when_a_longer_registry_is_remembered() -> None:
    """The configuration's memory of a registry keeps every key it saw revoked: a longer mark
    read later (from a registry that no longer says so) adds to it, never replaces it."""
    from tether._core.registrymark import RegistryMark, RegistryMemory

    memory = RegistryMemory({"root": RegistryMark(3, "d3", ("k-leaked",))})
    memory.advance("root", RegistryMark(5, "d5", ("k-other",)))
    seen = memory.seen("root")
    assert seen is not None and seen.length == 5
    assert set(seen.revoked) == {"k-leaked", "k-other"}


async def test_a_revocation_whose_mark_could_not_be_saved_is_not_lost_silently_at_close(
        journal_url: str, tmp_path: Path) -> None:
    """A revocation commits, but the configuration's registry.json cannot be saved then (a
    full disk, once). A process that ends right after (``tether keys revoke``) must not leave
    its configuration without the mark: closing saves what is unsaved (or says it could not).
    Otherwise an intruder who deletes the revocation row has the revoked key trusted again by
    that configuration, no rollback named."""
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    leaked = tether.KeyRing.init(tmp_path / "leaked")
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await _change(sup.journal, deployment, "trust", leaked)
    _full_disk_once(deployment.trusted.memory)
    async with Journal(journal_url) as j:  # committed: its caller is told it is done
        await _change(j, deployment, "revoke", leaked)
    # (the disk had room again when it closed; this process ends here: no further look)
    later = tether.KeyRing.load(tmp_path / "deployment")  # the next process of the config
    async with Journal(journal_url) as j:
        again = await _revocation_deleted(j, later.trusted)
    assert leaked.signer.key_id not in again.keys, (
        "a revocation reported done was never remembered; deleted by hand, the key is "
        "trusted again")


async def test_a_key_change_its_configuration_cannot_record_is_named_when_the_journal_closes(
        journal_url: str, tmp_path: Path) -> None:
    """registry.json cannot be written at all: the trust change commits (its caller is told
    so), and the process's journal says, as it closes, that its configuration does not hold
    it, rather than ending quietly."""
    deployment = tether.KeyRing.init(tmp_path / "deployment")
    other = tether.KeyRing.init(tmp_path / "other")
    async with tether.Supervisor(journal_url, keys=deployment) as sup:
        await sup.current_trust()
    memory: Any = deployment.trusted.memory

    def full_disk(marks: Any) -> None:
        raise OSError(28, "No space left on device")

    memory._save = full_disk
    journal = Journal(journal_url)
    await journal.open()
    trusted = await _change(journal, deployment, "trust", other)
    assert other.signer.key_id in trusted.keys
    with pytest.raises(JournalError, match=r"registry\.json"):
        await journal.close()


async def test_a_revocation_read_after_an_undone_trust_write_is_remembered_at_once(
        journal_url: str, tmp_path: Path) -> None:
    """In one batch, an operation writes a key registry entry and then fails (undone alone,
    on the batch's careful run); another reads the registry, with a revocation someone else
    committed. The entry that was written is gone: the read holds committed entries alone and
    is remembered at once. Deferred to the batch's commit as if the entry were still there,
    it is forgotten when that COMMIT fails (a full disk), and an intruder who then deletes the
    revocation row has the revoked key trusted again by that configuration."""
    from tests.test_chain import CommitFails
    from tether._core.documents import KeyGrant
    from tether._journal import trustops

    leaked, observer = await _revoked_once_seen(journal_url, tmp_path)

    def written_then_failed(db: Any) -> None:
        grant = KeyGrant("trust", "0000000000000000", "", "never", time.time())
        trustops._insert(db, grant, Signed(b"{}", "0000000000000000", b"\0" * 64), time.time())
        raise ValueError("refused after its entry was written")

    async with Journal(journal_url) as j:
        runner: Any = j._runner
        blocker, hold = await writer_held(runner)
        runs, run_batch = [], runner._run_batch

        def watched(conn: Any, batch: Any, careful: bool = False) -> Any:
            runs.append((len(batch), careful))
            return run_batch(conn, batch, careful)

        runner._run_batch = watched
        real = runner._conn
        runner._conn = CommitFails(real)
        failed = runner.submit(written_then_failed, write=True)
        read = runner.submit(lambda db: trustops.registry(db, observer.trusted), write=False)
        hold.set()
        await blocker
        outcomes = await asyncio.gather(failed, read, return_exceptions=True)
        runner._run_batch, runner._conn = run_batch, real
        assert runs == [(2, False), (2, True)], runs  # one batch, run again with savepoints
        assert all(isinstance(o, BaseException) for o in outcomes), outcomes  # COMMIT failed
        again = await _revocation_deleted(j, observer.trusted)
        assert leaked.signer.key_id not in again.keys, "a revoked key is trusted again"
        assert any("rolled back" in p for p in again.problems), again.problems


@pytest.mark.parametrize("writes", [True, False], ids=["undone-after-it-wrote", "before"])
async def test_a_row_found_by_an_undone_operation_is_found_again_by_the_next(
        pg_url: str, keys: tether.KeyRing, writes: bool) -> None:
    """On a batch's careful run, one operation reads an action's row as committed (its
    pre-image, under the row's lock), updates it, and fails: undone to its savepoint, with
    the lock. Another process then updates that row, sealed. A later operation of the batch
    that updates it must chain the row it found (the other process's), not the first one's
    forgotten read: that names the other process's update as tampering (PostgreSQL alone:
    SQLite's one writer keeps the other out until the batch commits)."""
    from tests.test_chain import one_refund, refund
    from tether._journal.tables import before, touch

    _, once = one_refund("PRE")
    async with tether.Supervisor(pg_url, tools=[refund], keys=keys) as sup:
        journal: Any = sup.journal
        child = await sup.delegate(once)
        await child.result()
        await journal.flush()
        (action,) = await journal.actions([child.id])

        def update(note: str, fail: bool = False) -> Callable[[Any], None]:
            def op(db: Any) -> None:
                if fail and not writes:
                    raise ValueError("refused before it wrote")
                before(db, "actions", action.id)
                db.execute("UPDATE actions SET error = ? WHERE id = ?", (note, action.id))
                touch(db, "actions", action.id)
                if fail:
                    raise ValueError("refused after it wrote")
            return op

        async with Journal(pg_url) as other:
            other.seal_with(keys.signer, keys.trusted)
            runner: Any = journal._runner
            between, go_on = threading.Event(), threading.Event()

            def pause(db: Any) -> None:  # on the careful run: the other process writes now
                between.set()
                assert go_on.wait(10)

            blocker, hold = await writer_held(runner)
            first = runner.submit(update("first", fail=True), write=True)
            paused = runner.submit(pause, write=True)
            later = runner.submit(update("later"), write=True)
            hold.set()
            await blocker
            await asyncio.to_thread(between.wait, 10)
            await other._write(update("other"))
            go_on.set()
            outcomes = await asyncio.gather(first, paused, later, return_exceptions=True)
            assert isinstance(outcomes[0], ValueError) and outcomes[2] is None, outcomes
        await journal.untampered([child.id], keys.trusted, "no false alarm")
