"""The chaos harness's simulated provider (its ledger, a SQLite file every process of a trial
writes) waits out a process stopped inside a write, however long: a trial never ends with a raw
``sqlite3.OperationalError: database is locked`` of the harness's own file."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tether._chaos.ledger import Ledger

HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO trace (at, who, what) VALUES (0, 'holder', 'held')")
print("locked", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
"""


def wait_for(check: object, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_writer_stopped_holding_the_lock_longer_than_a_busy_timeout(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, busy_timeout=0.05)  # one attempt gives up after 50 ms
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    errors: list[BaseException] = []

    def note() -> None:  # from another thread, as the orchestrator's timer does
        try:
            ledger.note("orchestrator", "signal", "worker", sig="SIGCONT")
        except BaseException as exc:
            errors.append(exc)

    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGSTOP)  # a worker paused inside its write
        writer = threading.Thread(target=note)
        writer.start()
        # Several busy timeouts pass while the holder is stopped.
        wait_for(lambda: ledger.retries >= 3)
        holder.send_signal(signal.SIGCONT)
        holder.stdin.write("\n")
        holder.stdin.flush()
        writer.join(10.0)
        assert not writer.is_alive()
        assert errors == []
        assert [what for _, _, what, _, _ in ledger.notes()] == ["held", "signal"]
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.communicate()
        ledger.close()


def test_every_thread_writes_through_its_own_connection(tmp_path: Path) -> None:
    """A statement of one thread never lands inside another thread's read transaction."""
    ledger = Ledger(tmp_path / "ledger.db")
    seen: list[int] = []

    def conn_id() -> None:
        seen.append(id(ledger._conn()))

    try:
        t = threading.Thread(target=conn_id)
        t.start()
        t.join()
        conn_id()
        assert len(set(seen)) == 2
        ledger.note("a", "b")
        assert ledger.first_note("b") is not None
    finally:
        ledger.close()


SLOW_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("CREATE TABLE IF NOT EXISTS trace (n INTEGER PRIMARY KEY, at REAL NOT NULL, "
           "who TEXT NOT NULL, what TEXT NOT NULL, key TEXT NOT NULL DEFAULT '', "
           "detail TEXT NOT NULL DEFAULT '{}')")
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO trace (at, who, what) VALUES (0, 'worker', 'writing')")
print("locked", flush=True)
time.sleep(0.2)  # the write is still open when the SIGSTOP comes
db.execute("COMMIT")
"""


async def test_a_worker_paused_inside_a_ledger_write_is_resumed(tmp_path: Path) -> None:
    """``pause_worker``: the worker may be stopped inside its write to the ledger. Noting the
    SIGSTOP then waits for that lock, which only the SIGCONT releases: the SIGCONT must not
    wait behind the note (a trial once hung there until the harness gave up on it)."""
    import asyncio

    from tether._chaos.orchestrator import Helpers
    from tether._chaos.plan import Plan
    from tether._chaos.world import Trial

    plan = Plan(seed=1, fault="pause_worker", children=1, refunds=1, latency=0.0, reply=0.0,
                control_after=0.0, grace=0.5, kill_after=0.0, kill_nth=0, probe_mode="ok")
    trial = Trial(tmp_path, plan, "orchestrator")
    # A stopped writer is waited for this long, then the note fails: short, so that a SIGCONT
    # that never comes fails the test instead of hanging it.
    trial.ledger.close()
    trial.ledger = Ledger(tmp_path / "ledger.db", give_up=5.0)
    helpers = Helpers(trial, "sqlite:///unused")
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SLOW_HOLDER, str(tmp_path / "ledger.db"),
        stdout=asyncio.subprocess.PIPE)
    try:
        assert worker.stdout is not None
        assert (await worker.stdout.readline()).strip() == b"locked"
        timer = helpers.pause(worker, 0.3)
        await asyncio.to_thread(timer.join)
        assert await asyncio.wait_for(worker.wait(), 10.0) == 0
        # Both are noted, in the order they were sent (the trace sorts by time: the SIGSTOP's
        # note may commit after the SIGCONT's, having waited for the worker's lock).
        assert [detail.get("sig") for _, _, what, _, detail in sorted(trial.ledger.notes())
                if what == "signal"] == ["SIGSTOP", "SIGCONT"]
        assert helpers.paused == set()
    finally:
        if worker.returncode is None:
            worker.send_signal(signal.SIGCONT)
            worker.kill()
            await worker.wait()
        trial.ledger.close()


EXCLUSIVE_HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA locking_mode=EXCLUSIVE")  # kept after the write: no other reader either
db.execute("INSERT INTO trace (at, who, what) VALUES (0, 'orchestrator', 'writing')")
print("locked", flush=True)
release = time.time() + float(sys.argv[2])
while time.time() < release:  # wall time: a SIGSTOP before it holds the lock until SIGCONT
    time.sleep(0.01)
db.close()
"""


def test_a_paused_orchestrator_is_resumed_while_the_reconciler_waits_for_its_lock(
        tmp_path: Path) -> None:
    """``pause_orchestrator``: the orchestrator may be stopped holding a lock of the ledger
    that the reconciler (run meanwhile) waits for. The SIGCONT must come when the pause ends,
    not once the reconciler is done: a trial once waited 120 s there (the ledger gave up)."""
    import asyncio

    import tether
    from tether._chaos.harness import pause_orchestrator
    from tether._chaos.plan import Plan

    keys = tether.KeyRing.load_or_init(tmp_path / "keys")
    url = f"sqlite:///{tmp_path / 'journal.db'}"

    async def make_journal() -> None:
        async with tether.Supervisor(url, keys=keys, recover=False):
            pass

    asyncio.run(make_journal())
    Ledger(tmp_path / "ledger.db").close()  # the trial's ledger, its tables made
    harness = Ledger(tmp_path / "harness.db")  # the harness's own notes, never locked here
    harness.note("orchestrator", "delegated")
    plan = Plan(seed=1, fault="pause_orchestrator", children=1, refunds=1, latency=0.0,
                reply=0.0, control_after=0.0, grace=0.5, kill_after=0.0, kill_nth=0,
                probe_mode="ok", lease=1.0, pause_after=0.0, pause_for=4.0)
    holder = subprocess.Popen([sys.executable, "-c", EXCLUSIVE_HOLDER,
                               str(tmp_path / "ledger.db"), "3.0"], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"locked"
        began = time.monotonic()
        pause_orchestrator(holder, plan, tmp_path, url, harness, time.monotonic() + 60.0)
        took = time.monotonic() - began
        assert holder.wait(10.0) == 0
        assert took < plan.pause_for + 20.0, f"resumed only after {took:.0f} s"
        assert [d.get("sig") for _, _, what, _, d in harness.notes() if what == "signal"] == [
            "SIGSTOP", "SIGCONT"]
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.communicate()
        harness.close()
