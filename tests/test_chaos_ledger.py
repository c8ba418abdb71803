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
