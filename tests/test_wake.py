"""Wake-ups across processes (``_journal/wake.py`` on SQLite, LISTEN/NOTIFY on PostgreSQL): a
recall from another process reaches a supervisor at once, not at its next poll; a wake-up is a
hint that only ever causes a read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tether
from tether._journal import wake
from tether._journal.journal import Journal

HOUR = 3600.0


async def test_a_recall_from_another_process_wakes_a_supervisor_that_polls_hourly(
        journal_url: str) -> None:
    """The supervisor looks for other processes' intents once an hour here: the recall that
    `tether recall` commits in its own process is acted on because the journal woke it. (On
    SQLite it was not woken before: the recall waited for the hour; the 60 s bound below is
    a hang guard, not a timing goal.)"""
    started = asyncio.Event()

    @tether.tool(dispatch_deadline=0.5)
    async def hang(n: int, *, idempotency_key: str) -> None:
        started.set()
        await asyncio.Event().wait()

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(hang, n=1)

    policy = tether.Policy(ack_timeout=0.2, probe_timeout=0.5, clock_tolerance=0.2)
    async with tether.Supervisor(journal_url, control_poll=HOUR, policy=policy) as sup:
        handle = await sup.delegate(agent, tools=[hang])
        await started.wait()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "recall", handle.id, "--grace", "0.1", "--no-wait",
            "--journal", journal_url, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = await cli.communicate()
        assert cli.returncode == 0, err.decode()
        async with asyncio.timeout(60):
            await handle.wait()
        row = await sup.journal.get(handle.id)
    # Ended by the recall (its hanging call has no probe: in doubt, a person decides).
    assert row.state.terminal and row.state.value != "SUCCEEDED", row.state


async def test_a_committed_notification_reaches_another_journal_on_the_file(
        sqlite_url: str) -> None:
    """A queued task wakes the journal's other processes (an idle worker); here a second
    journal object listens, as another process would, on its own socket."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    @tether.agent()
    async def job(ctx: tether.Context) -> str:
        return "done"

    async with tether.Supervisor(sqlite_url, recover=False) as sup, \
            Journal(sqlite_url, create=False) as other:
        def hear(payload: str) -> None:  # from the listener's thread
            loop.call_soon_threadsafe(heard.put_nowait, payload)

        assert other.on_notify(hear)
        await sup.delegate(job, task_id="t1", remote=True)
        async with asyncio.timeout(60):
            assert await heard.get() == "queued"


def test_a_listener_ignores_what_is_not_its_users_and_stale_sockets_go(tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    where = wake.directory(journal)
    got: list[str] = []
    listener = wake.listen(journal, got.append)
    assert listener is not None
    try:
        assert oct(os.stat(where).st_mode & 0o777) == "0o700"
        # A process that died left its socket: the next send removes it, and still delivers.
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dead.bind(str(where / "0-dead"))
        dead.close()
        wake.send(journal, ["queued", "queued", "x" * 1000])
        assert not (where / "0-dead").exists()
        deadline = 200
        while len(got) < 2 and deadline:
            deadline -= 1
            listener._closed.wait(0.05)
        assert got == ["queued", "x" * wake.MAX_PAYLOAD]  # once each, bounded
    finally:
        listener.close()
    assert not where.exists()  # the last listener out removes the directory


def test_the_place_does_not_depend_on_the_session(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A recall run from cron, ssh or sudo -u has another XDG_RUNTIME_DIR or TMPDIR: it must
    still find the supervisor's socket (a review found it polling instead)."""
    journal = tmp_path / "journal.db"
    before = wake.directory(journal)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "other"))
    assert wake.directory(journal) == before


async def test_a_wake_up_that_cannot_be_sent_never_fails_the_committed_batch(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors when the hint is sent, after the COMMIT: the delegation is queued all
    the same (a review saw 'journal write failed', and the retry found the task existing)."""
    @tether.agent()
    async def job(ctx: tether.Context) -> str:
        return "done"

    async with tether.Supervisor(sqlite_url, recover=False) as sup:
        def no_descriptors(*_: Any, **__: Any) -> socket.socket:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(socket, "socket", no_descriptors)  # wake imports the module
        handle = await sup.delegate(job, task_id="t1", remote=True)
        monkeypatch.undo()
        assert (await sup.journal.get(handle.id)).task_id == "t1"


def test_a_directory_others_may_write_to_is_not_used(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wake, "BASE", tmp_path)
    journal = tmp_path / "journal.db"
    where = wake.directory(journal)
    where.mkdir()
    where.chmod(0o777)  # planted: anyone could bind there, or read the hints
    assert wake.listen(journal, lambda _p: None) is None
    wake.send(journal, ["queued"])  # nothing to send to, and nothing raised


@pytest.mark.parametrize("payload", [b"\xff\xfe", b""])
def test_a_forged_datagram_costs_a_read_never_an_error(tmp_path: Path, payload: bytes) -> None:
    journal = tmp_path / "journal.db"
    got: list[Any] = []
    listener = wake.listen(journal, got.append)
    assert listener is not None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(payload, str(next(wake.directory(journal).iterdir())))
        for _ in range(200):
            if got:
                break
            listener._closed.wait(0.05)
        assert len(got) == 1 and isinstance(got[0], str)
    finally:
        listener.close()


async def test_what_a_rolled_back_operation_notified_is_never_sent(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two operations share a batch; the first notifies, then fails, and is rolled back to its
    savepoint: only the second's wake-up is sent once the batch commits (as a NOTIFY inside a
    rolled-back savepoint is never delivered on PostgreSQL)."""
    sent: list[list[str]] = []
    monkeypatch.setattr(wake, "send", lambda where, notes: sent.append(list(notes)))
    gate = threading.Event()

    def hold(db: Any) -> None:  # keeps the writer busy while the batch under test is queued
        gate.wait(10)

    def refused(db: Any) -> None:
        db.notify("refused")
        raise ValueError("this operation fails")

    def kept(db: Any) -> None:
        db.notify("kept")

    async with Journal(sqlite_url) as journal:
        held = asyncio.ensure_future(journal._write(hold))
        await asyncio.sleep(0)  # (queued first: the writer takes it alone)
        failing = asyncio.ensure_future(journal._write(refused))
        passing = asyncio.ensure_future(journal._write(kept))
        await asyncio.sleep(0)
        gate.set()
        await held
        with pytest.raises(ValueError, match="this operation fails"):
            await failing
        await passing
    assert ["kept"] in sent and not any("refused" in notes for notes in sent), sent


def test_a_forked_process_closing_what_it_inherited_leaves_its_parent_listening(
        tmp_path: Path) -> None:
    """A worker pool forked after the journal opened closes its copy of the journal: the
    parent's socket stays where senders find it, and its wake-ups still arrive."""
    journal = tmp_path / "journal.db"
    got: list[str] = []
    listener = wake.listen(journal, got.append)
    assert listener is not None
    try:
        pid = os.fork()
        if pid == 0:  # the child: close the inherited listener, and go
            try:
                listener.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert listener._path.exists()
        wake.send(journal, ["queued"])
        for _ in range(200):
            if got:
                break
            listener._closed.wait(0.05)
        assert got == ["queued"]
    finally:
        listener.close()


# -- which loop a wake-up reaches ---------------------------------------------------------------

async def _turns(n: int = 50) -> None:
    """Let every ready callback run, ``n`` turns of the event loop (a woken loop reaches its
    next read within a few: nothing between the two waits on I/O)."""
    for _ in range(n):
        await asyncio.sleep(0)


class _Reads:
    """The adoption watch's reads of intents, counted; each waits for ``gate`` if given."""

    def __init__(self, sup: tether.Supervisor, gate: asyncio.Event | None = None) -> None:
        self.count = 0
        self._more = asyncio.Event()
        read = sup.journal.controls_to_adopt

        async def counted(owner_id: str, after_id: int) -> Any:
            self.count += 1
            self._more.set()
            if gate is not None:
                await gate.wait()
            return await read(owner_id, after_id)

        sup.journal.controls_to_adopt = counted  # type: ignore[method-assign]

    async def reach(self, n: int) -> None:
        async with asyncio.timeout(60):  # a hang guard, not a timing goal
            while self.count < n:
                self._more.clear()
                await self._more.wait()


async def test_a_busy_queue_does_not_make_a_supervisor_read_its_intents_again(
        sqlite_url: str) -> None:
    """Tasks queued and done by other processes wake the workers and whoever waits on them,
    not every supervisor's watch for intents: that one reads when an intent names its owner
    (before, each "queued" and "done" cost every supervisor a read)."""
    async with tether.Supervisor(sqlite_url, control_poll=HOUR) as sup:
        await _turns()
        reads = _Reads(sup)
        for payload in ("queued", "done", "queued", "someone-else"):
            sup._notified(payload)
            await _turns()
        assert reads.count == 0
        sup._notified(sup.owner_id)
        await reads.reach(1)
        await _turns()
        assert reads.count == 1


async def test_an_intent_notified_while_the_watch_reads_is_read_at_once(
        sqlite_url: str) -> None:
    """A recall commits just after the watch began a read that cannot see it, and its wake-up
    arrives during that read: the watch reads again at once (before, the wake-up was dropped
    and the intent waited for the next poll, an hour here)."""
    async with tether.Supervisor(sqlite_url, control_poll=HOUR) as sup:
        await _turns()
        gate = asyncio.Event()
        reads = _Reads(sup, gate)
        sup._notified(sup.owner_id)
        await reads.reach(1)
        sup._notified(sup.owner_id)  # during the first read
        await _turns()
        gate.set()
        await reads.reach(2)


async def test_a_worker_whose_slot_frees_claims_the_next_task_without_a_notification(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One slot, two tasks queued, a poll once an hour and no notifications: the second task
    is claimed as soon as the first ends, because the slot freed wakes the worker."""
    keys = tether.KeyRing.ephemeral()
    monkeypatch.setattr(wake, "listen", lambda where, callback: None)  # nobody is notified

    @tether.agent()
    async def double(ctx: tether.Context, n: int) -> int:
        return n * 2

    async with tether.Supervisor(sqlite_url, keys=keys) as sup:
        children = [await sup.delegate(double, i, remote=True) for i in (1, 2)]
        async with tether.Worker(sqlite_url, [double], keys=keys, poll=HOUR,
                                 concurrency=1) as worker:
            serving = asyncio.create_task(worker.run())
            async with asyncio.timeout(60):  # a hang guard, not a timing goal
                assert [await c.result() for c in children] == [2, 4]
            worker.stop()
            await serving


async def test_an_unclaimed_task_settled_by_its_owner_wakes_whoever_awaits_its_result(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process recalls a queued task no worker claimed and dies before it takes the
    task off the queue; the owner's watch settles it. That settlement says "done", as a
    worker's end does: the owner's ``result()`` hears it, not the next poll (an hour here;
    before, nothing was said and the wait took the whole poll)."""
    from tether._runtime import issuing

    class Died(Exception):
        pass

    async def dies(*args: Any, **kwargs: Any) -> None:
        raise Died  # the issuer, right after its intent committed

    @tether.agent()
    async def job(ctx: tether.Context) -> str:
        return "ran"

    async with tether.Supervisor(sqlite_url, control_poll=HOUR) as owner:
        handle = await owner.delegate(job, remote=True)
        waiting = asyncio.ensure_future(handle.result())
        monkeypatch.setattr(issuing, "settle_unclaimed", dies)
        async with tether.Supervisor(sqlite_url, recover=False) as issuer:
            with pytest.raises(Died):
                await issuer.handle_for(handle.id).recall(0.1)
        monkeypatch.undo()
        async with asyncio.timeout(60):  # a hang guard, not a timing goal
            with pytest.raises(tether.DelegationError):
                await waiting
    assert (await _state(sqlite_url, handle.id)) == "RECALLED"


async def _state(url: str, delegation_id: str) -> str:
    async with Journal(url) as journal:
        return (await journal.get(delegation_id)).state.value


async def test_a_done_heard_while_the_waiter_reads_is_not_lost(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker ends the task just after the waiter's read of its progress began, and the
    "done" reaches the waiter before that read answers: the waiter reads again at once
    (before, the ring fell between two waits and the result waited for the next poll)."""
    from tether._runtime.supervisor import Supervisor

    keys = tether.KeyRing.ephemeral()
    release, running, done = asyncio.Event(), asyncio.Event(), threading.Event()
    original = Supervisor._notified

    def notified(self: Supervisor, payload: str) -> None:
        original(self, payload)
        if payload == "done":
            done.set()

    monkeypatch.setattr(Supervisor, "_notified", notified)

    @tether.agent()
    async def job(ctx: tether.Context) -> str:
        running.set()
        await release.wait()
        return "ran"

    async with tether.Supervisor(sqlite_url, control_poll=HOUR, keys=keys) as sup, \
            tether.Worker(sqlite_url, [job], keys=keys, poll=0.05) as worker:
        serving = asyncio.create_task(worker.run())
        handle = await sup.delegate(job, remote=True)
        await running.wait()
        real = sup.journal.queue_progress

        async def progress(queued_id: str) -> Any:
            found = await real(queued_id)
            if not release.is_set():
                release.set()  # the task ends after this read
                assert await asyncio.to_thread(done.wait, 60)  # its "done" arrives
                await _turns()  # and is handed to the loop, before this read answers
            return found

        sup.journal.queue_progress = progress  # type: ignore[method-assign,assignment]
        async with asyncio.timeout(60):  # a hang guard, not a timing goal
            assert await handle.result() == "ran"
        worker.stop()
        await serving


async def test_a_worker_run_cancelled_leaves_no_wake_up_behind(sqlite_url: str) -> None:
    """A ``run()`` cancelled (a timeout around it) forgets its claim loop's wake-up: a process
    that runs its worker again and again keeps one, not one per run."""
    keys = tether.KeyRing.ephemeral()

    @tether.agent()
    async def job(ctx: tether.Context) -> str:
        return "ran"

    async with tether.Worker(sqlite_url, [job], keys=keys, poll=HOUR) as worker:
        bells = worker.supervisor.bells._bells
        before = len(bells)
        for _ in range(20):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.01):
                    await worker.run()
        assert len(bells) == before


async def test_a_worker_stopped_from_another_thread_stops_at_once(sqlite_url: str) -> None:
    """``stop()`` from another thread (a UI's, an exit hook's) is handed to the worker's loop:
    no error, even in asyncio's debug mode, and the claim loop wakes now, not at its next
    poll (an hour here)."""
    keys = tether.KeyRing.ephemeral()
    asyncio.get_running_loop().set_debug(True)

    @tether.agent()
    async def job(ctx: tether.Context) -> str:
        return "ran"

    async with tether.Worker(sqlite_url, [job], keys=keys, poll=HOUR) as worker:
        serving = asyncio.create_task(worker.run())
        await _turns()
        errors: list[BaseException] = []

        def stop() -> None:
            try:
                worker.stop()
            except BaseException as exc:  # reported below
                errors.append(exc)

        await asyncio.to_thread(stop)
        async with asyncio.timeout(60):  # a hang guard, not a timing goal
            await serving
    assert errors == []
