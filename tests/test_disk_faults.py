"""A SQLite journal on a disk that fills up or turns read-only (a small file system of its own,
mounted for the test: these tests need root, as the chaos disk faults do).

Write-ahead holds: a call whose intent cannot be written fails with a JournalError before its
tool runs. A receipt that cannot be written leaves its action for reconciliation, never
claimed otherwise, and a fresh supervisor settles it once the disk is back."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import tether
from tether._chaos.disk import JournalDisk

A = tether.ActionState


class Provider:
    """The outside world: what it applied, by key (never deduplicated)."""

    def __init__(self) -> None:
        self.applied: Counter[str] = Counter()
        self.after_apply: list[object] = []

    def tools(self) -> list[tether.Tool]:
        async def lookup(order_id: str, cents: int, *,
                         idempotency_key: str) -> tether.ProbeResult:
            n = self.applied[idempotency_key]
            return tether.ProbeResult(
                tether.ProbeOutcome.COMPLETED if n else tether.ProbeOutcome.NOT_APPLIED, {"n": n})

        @tether.tool(effect=tether.Effect.EXTERNAL, probe=lookup)
        async def pay(order_id: str, cents: int, *, idempotency_key: str) -> str:
            self.applied[idempotency_key] += 1
            while self.after_apply:  # the disk changes just after the payment applied
                hook = self.after_apply.pop()
                assert callable(hook)
                hook()
            return f"ref-{idempotency_key}"

        return [pay]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[JournalDisk]:
    d = JournalDisk(tmp_path, "disk_full").mount()
    try:
        yield d
    finally:
        d.close()


def url_on(disk: JournalDisk) -> str:
    return f"sqlite:///{disk.path / 'journal.db'}"


async def actions(url: str) -> list[tether.ActionRecord]:
    async with tether.Journal(url, create=False) as j:
        return await j.actions([r.id for r in await j.delegations()])


async def test_a_full_disk_fails_the_call_before_its_tool_runs(disk: JournalDisk) -> None:
    provider = Provider()
    [pay] = provider.tools()
    errors: list[str] = []
    sup: tether.Supervisor

    async def child(ctx: tether.Context) -> str:
        await ctx.call(pay, order_id="o", cents=1)
        await sup.journal.flush()  # its receipt is written
        disk.fill()
        try:
            await ctx.call(pay, order_id="o", cents=2)
        except tether.errors.JournalError as exc:
            errors.append(str(exc))
        disk.free()
        ref: str = await ctx.call(pay, order_id="o", cents=3)
        return ref

    async with tether.Supervisor(url_on(disk), keys=tether.KeyRing.ephemeral(),
                                 tools=[pay]) as sup:
        handle = await sup.delegate(child, tools=[pay])
        await handle.result()
    assert len(errors) == 1 and "full" in errors[0], errors
    # The second payment's intent could not be written: it never reached the provider.
    assert sorted(provider.applied) == sorted(
        a.idempotency_key for a in await actions(url_on(disk)) if a.state is A.COMPLETED)
    assert len(provider.applied) == 2 and set(provider.applied.values()) == {1}


async def test_a_receipt_the_full_disk_refused_is_reconciled_never_claimed(
        disk: JournalDisk, tmp_path: Path) -> None:
    provider = Provider()
    [pay] = provider.tools()
    keys = tether.KeyRing.ephemeral()

    async def child(ctx: tether.Context) -> str:
        provider.after_apply.append(disk.fill)  # the first payment's receipt meets a full disk
        first: str = await ctx.call(pay, order_id="o", cents=1)
        with pytest.raises(tether.errors.JournalError):
            await ctx.call(pay, order_id="o", cents=2)
        disk.free()
        await ctx.call(pay, order_id="o", cents=3)
        return first

    async with tether.Supervisor(url_on(disk), keys=keys, tools=[pay]) as sup:
        handle = await sup.delegate(child, tools=[pay])
        await handle.result()
        report = await handle.report()
    first_key = next(iter(provider.applied))
    states = {a.idempotency_key: a.state for a in await actions(url_on(disk))}
    # Never "not applied" or "failed" for the payment that went through.
    assert states[first_key] in (A.PENDING, A.IN_DOUBT, A.COMPLETED), states
    assert first_key not in [a.idempotency_key for a in report.not_applied]
    # A fresh supervisor, the disk back, settles it by asking the provider.
    async with tether.Supervisor(url_on(disk), keys=keys, tools=[pay], recover=False) as sup:
        await sup.recover()
    final = await actions(url_on(disk))
    assert {a.idempotency_key for a in final if a.state is A.COMPLETED} == set(provider.applied)
    assert not [a for a in final if a.state in (A.PENDING, A.IN_DOUBT)]


async def test_a_journal_turned_read_only_fails_the_call_before_its_tool_runs(
        tmp_path: Path) -> None:
    disk = JournalDisk(tmp_path, "journal_readonly").mount()
    try:
        provider = Provider()
        [pay] = provider.tools()
        sup: tether.Supervisor

        async def child(ctx: tether.Context) -> str:
            await ctx.call(pay, order_id="o", cents=1)
            await sup.journal.flush()
            disk.make_readonly()  # the kernel turns the file system read-only, files open
            ref: str = await ctx.call(pay, order_id="o", cents=2)
            return ref

        keys = tether.KeyRing.load_or_init(tmp_path / "keys")
        url = f"{url_on(disk)}?keys={tmp_path / 'keys'}"

        async def run() -> None:
            nonlocal sup
            async with tether.Supervisor(url, keys=keys, tools=[pay]) as sup:
                handle = await sup.delegate(child, tools=[pay])
                await handle.result()

        with pytest.raises(tether.errors.JournalError, match="read-only or failing"):
            await run()
        assert len(provider.applied) == 1  # the second call's intent was never written
        disk.clear()  # unmounted, checked, mounted read-write again
        async with tether.Supervisor(url, keys=keys, tools=[pay], recover=False) as sup:
            await sup.recover()
        final = await actions(url)
        assert {a.idempotency_key for a in final if a.state is A.COMPLETED} == \
            set(provider.applied)
        assert not [a for a in final if a.state in (A.PENDING, A.IN_DOUBT)]
    finally:
        disk.close()




RECORD = 4096


def _synced_writes_until_refused(fd: int, acked: list[int]) -> None:
    """Numbered records, each synced: ``acked`` holds those the kernel acknowledged. Returns
    once the file system refuses."""
    try:
        for n in itertools.count(1):
            os.write(fd, f"{n:08d}".encode().ljust(RECORD, b"."))
            os.fsync(fd)
            acked.append(n)
    except OSError:
        return


def test_the_read_only_fault_keeps_every_write_the_kernel_acknowledged(tmp_path: Path) -> None:
    """The fault's premise: the file system fails, it does not lie. A file-system error that
    strikes during an fsync can lose the writes that fsync reports done (ext4 on this
    machine's kernel: one error in three to one in ten), a disk that breaks every database's
    durability and that a trial would misread as a rollback of the journal. So no write the
    kernel acknowledged may be missing once the disk is back, under a writer that syncs
    record after record, struck after a number of acknowledged records drawn from a seed
    while it goes on writing."""
    rng = random.Random(2026121505)
    for round_ in range(40):
        (tmp_path / str(round_)).mkdir()
        disk = JournalDisk(tmp_path / str(round_), "journal_readonly").mount()
        try:
            acked: list[int] = []
            fd = os.open(disk.path / "log", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                writer = threading.Thread(target=_synced_writes_until_refused,
                                          args=(fd, acked), daemon=True)
                writer.start()
                strike = rng.randint(1, 30)
                while len(acked) < strike and writer.is_alive():
                    time.sleep(0.001)
                disk.make_readonly()
                writer.join(timeout=30)
                assert not writer.is_alive(), "the writer was never refused"
            finally:
                os.close(fd)
            assert len(acked) >= strike, f"round {round_}: refused before the strike"
            disk.clear()  # unmounted, checked, mounted again
            data = (disk.path / "log").read_bytes()
            kept = max((int(data[i:i + 8]) for i in range(0, len(data), RECORD)
                        if data[i:i + 8].isdigit()), default=0)
            assert kept >= acked[-1], f"round {round_}: {acked[-1]} acknowledged, {kept} kept"
        finally:
            disk.close()


# Dies as a harness killed at the worst moments would: while the freeze is under way (as soon as
# the watchdog that makes it is started), or between the freeze and the strike.
_DIES = """
import os, select, signal, sys
from pathlib import Path
from tether._chaos import disk

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2] == "freezing":
    select.select = die
else:
    class Struck(type(Path())):
        def write_text(self, *args, **kwargs):
            if self.name == "trigger_fs_error":
                die()
            return super().write_text(*args, **kwargs)
    disk.Path = Struck
disk.JournalDisk(Path(sys.argv[1]), "journal_readonly").make_readonly()
"""


@pytest.mark.parametrize("when", ["freezing", "frozen"])
def test_a_harness_killed_while_the_disk_is_frozen_leaves_it_thawed(
        tmp_path: Path, when: str) -> None:
    """Killed while its freeze is under way or done, before the strike, the process that
    struck leaves no file system frozen: a write to it completes within moments, and nothing
    struck it."""
    disk = JournalDisk(tmp_path, "journal_readonly").mount()
    writer: subprocess.Popen[bytes] | None = None
    try:
        struck = subprocess.run([sys.executable, "-c", _DIES, str(tmp_path), when],
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                capture_output=True, timeout=60, check=False)
        assert struck.returncode == -signal.SIGKILL, struck.stderr.decode()[-500:]
        # A frozen file system holds this write (in uninterruptible sleep) until it is thawed.
        writer = subprocess.Popen(["sh", "-c", 'echo after > "$0" && sync "$0"',
                                   str(disk.path / "after")])
        waited = time.monotonic() + 30.0
        while writer.poll() is None and time.monotonic() < waited:
            time.sleep(0.05)
        assert writer.returncode == 0, "a write to the disk was still held 30 s after the kill"
        assert (disk.path / "after").read_text() == "after\n"
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(disk.path)], capture_output=True,
                       check=False)  # a disk left frozen, thawed before it is unmounted
        if writer is not None:
            writer.wait()
        disk.close()
