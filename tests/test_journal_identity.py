"""A SQLite journal deleted or replaced under a running process, or only its -wal or -shm file
deleted, is noticed at the next commit: the process stops with a clear error instead of writing
to a file nobody will read. Another process opening and closing the journal is no false
alarm."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import tether
from tether._core.errors import JournalError
from tether._journal.journal import Journal
from tether._journal.rows import OwnerRow
from tether.testing import PaymentService, VirtualClock

from .conftest import Shop
from .test_cli import tether_cli

ROOT = Path(__file__).resolve().parent.parent


def file_of(sqlite_url: str) -> Path:
    return Path(sqlite_url.removeprefix("sqlite:///"))


async def make_journal(url: str) -> None:
    async with tether.Supervisor(url, keys=tether.KeyRing.ephemeral()):
        pass


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_journal_gone_under_a_supervisor_stops_its_writes(
        sqlite_url: str, tmp_path: Path, clock: VirtualClock, shop: Shop,
        pay: PaymentService, how: str) -> None:
    path = file_of(sqlite_url)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    await make_journal(other)
    started, go = asyncio.Event(), asyncio.Event()

    async def agent(ctx: tether.Context) -> str:
        started.set()
        await go.wait()
        ref: str = await ctx.call(shop.refund, order_id="J-1", cents=5)
        return ref

    async with tether.Supervisor(sqlite_url, clock=clock, keys=tether.KeyRing.ephemeral(),
                                 tools=shop.tools) as sup:
        child = await sup.delegate(agent, tools=shop.tools)
        await started.wait()
        if how == "deleted":
            for sidecar in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                sidecar.unlink(missing_ok=True)
        else:
            shutil.copy(file_of(other), tmp_path / "moved.db")
            os.replace(tmp_path / "moved.db", path)
        go.set()
        with pytest.raises(tether.errors.JournalError, match=how):
            await child.result()  # neither the intent nor the failure can be recorded
        assert pay.requests == 0  # the refund's intent could not be recorded: never sent
        with pytest.raises(tether.errors.JournalError, match=how):
            await sup.delegate(shop.refund_agent, "J-2", tools=shop.tools)
        clock.autojump()


async def test_a_journal_moved_back_is_used_again(sqlite_url: str, tmp_path: Path) -> None:
    """The check is of the file itself, not a latch: the same file back in place works."""
    path = file_of(sqlite_url)
    async with tether.Supervisor(sqlite_url, keys=tether.KeyRing.ephemeral()) as sup:
        os.replace(path, tmp_path / "aside.db")
        with pytest.raises(tether.errors.JournalError, match="deleted"):
            await sup.journal.delegations()
        os.replace(tmp_path / "aside.db", path)
        assert await sup.journal.delegations() == []


@pytest.mark.parametrize("damage", ["overwritten", "truncated"])
async def test_ls_on_a_corrupt_journal_is_one_error_line(sqlite_url: str, damage: str) -> None:
    async def agent(ctx: tether.Context, n: int) -> str:
        return "x" * n

    async with tether.Supervisor(sqlite_url, keys=tether.KeyRing.ephemeral()) as sup:
        for i in range(60):
            await (await sup.delegate(agent, 500 + i, tools=[])).result()
    path = file_of(sqlite_url)
    data = bytearray(path.read_bytes())
    if damage == "overwritten":
        data[4096:len(data) - 4096] = bytes(range(256)) * ((len(data) - 8192) // 256) + bytes(
            (len(data) - 8192) % 256)
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    code, out, err = await tether_cli("ls", "--journal", sqlite_url)
    assert code == 2, out
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert "corrupt" in err and "Traceback" not in err + out


async def test_a_relative_journal_survives_a_change_of_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    async with tether.Supervisor("sqlite:///state/journal.db",
                                 keys=tether.KeyRing.ephemeral()) as sup:
        monkeypatch.chdir(tmp_path / "elsewhere")
        assert await sup.journal.delegations() == []
        os.replace(tmp_path / "state" / "journal.db", tmp_path / "aside.db")
        with pytest.raises(tether.errors.JournalError, match="deleted"):
            await sup.journal.delegations()
        os.replace(tmp_path / "aside.db", tmp_path / "state" / "journal.db")


async def test_a_worker_whose_journal_is_deleted_stops_with_the_reason(
        sqlite_url: str, tmp_path: Path) -> None:
    # Made with the keys the worker loads: a journal is rooted in the first key it sees.
    async with tether.Supervisor(sqlite_url, keys=tether.KeyRing.load_or_init(tmp_path / "keys")):
        pass
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "worker", "--journal", sqlite_url, "--agents",
        "tests.remote_agents:AGENTS", "--lease", "1", "--keys", str(tmp_path / "keys"),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert line.startswith("worker "), line
    file_of(sqlite_url).unlink()
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)  # its next renewal fails
    finally:
        if proc.returncode is None:  # it went on writing to the deleted file
            proc.kill()
            await proc.wait()
    lines = [ln for ln in err.decode().splitlines() if ln.strip() and " INFO " not in ln]
    assert proc.returncode == 3 and len(lines) == 1 and lines[0].startswith("error:"), lines
    assert "deleted" in lines[0]


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
async def test_a_journal_whose_write_ahead_log_is_deleted_stops_its_writes(
        tmp_path: Path, suffix: str) -> None:
    """Only the journal's -wal (or -shm) file removed under a running process (a clean-up by
    hand): the file check saw the journal itself unchanged, and the process went on committing
    into a log no other process reads, which a crash then lost along with everything it held
    (the journal read back empty). Now the next transaction stops with a clear error."""
    path = tmp_path / "j.db"
    async with Journal(f"sqlite:///{path}") as journal:
        await journal.register_owner(OwnerRow("before", 1, "host", 1.0, 1.0))
        os.unlink(f"{path}{suffix}")
        with pytest.raises(JournalError, match=f"{suffix} was deleted"):
            await journal.register_owner(OwnerRow("after", 1, "host", 1.0, 1.0))


async def test_a_second_process_opening_the_journal_leaves_its_sidecars_alone(
        tmp_path: Path) -> None:
    """No false alarm: another connection opening and closing the journal while this one
    has it open (``tether ls`` beside a supervisor) keeps its -wal and -shm."""
    path = tmp_path / "j.db"
    async with Journal(f"sqlite:///{path}") as journal:
        await journal.register_owner(OwnerRow("first", 1, "host", 1.0, 1.0))
        for n in range(3):
            async with Journal(f"sqlite:///{path}", create=False) as other:
                await other.register_owner(OwnerRow(f"other-{n}", 1, "host", 1.0, 1.0))
        await journal.register_owner(OwnerRow("last", 1, "host", 1.0, 1.0))
        assert len(await journal.owners()) == 5


@pytest.mark.parametrize("what", ["journal", "-wal"])
async def test_a_journal_deleted_while_a_batch_runs_fails_that_batch(
        tmp_path: Path, what: str) -> None:
    """The file checks at the start of a batch saw the journal in place; it went while the
    batch ran (another process's unlink, at any instant): the batch committed into a file
    nobody reads. Its operations must fail, not pass for journaled (an intent in that batch
    would otherwise dispatch its tool with no durable record of it)."""
    path = tmp_path / "j.db"
    async with Journal(f"sqlite:///{path}") as journal:
        await journal.register_owner(OwnerRow("before", 1, "host", 1.0, 1.0))

        def write_while_deleted(db: object) -> str:
            os.unlink(path if what == "journal" else f"{path}{what}")
            journal_db: Any = db
            journal_db.execute("INSERT INTO tether_meta (key, value) VALUES ('mid', 'batch')")
            return "committed"

        future = journal._runner.submit(write_while_deleted, write=True)
        assert future is not None
        with pytest.raises(JournalError, match="was deleted"):
            await future
