"""`tether chaos` draws infrastructure faults on a private PostgreSQL server of its own: a
restart (fast or immediate), terminated backends, a pause longer than a lease, the server
stopped for less or more than a lease, a crash that loses the commits that skipped the disk,
each mid-trial. Every process rides through or gives up
cleanly: no violation, no hung process, no worker exit while the server was away for less
than a lease. On SQLite, the journal's own disk fills up or turns read-only mid-trial."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.test_chaos import ROOT, chaos
from tether._chaos.pgserver import PrivateServer
from tether._journal.journal import Journal

INFRA = ("pg_restart", "pg_terminate", "pg_pause", "pg_down", "pg_lost")


async def test_infrastructure_faults_find_no_violation(pg_url: str, tmp_path: Path) -> None:
    base = pg_url.split("?")[0]  # names the backend; the run starts a private server
    code, result, err = await chaos("--faults", ",".join(INFRA), "--per-fault", "2",
                                    "--seed", "3", "--journal", base, "--traces",
                                    str(tmp_path), "--trial-timeout", "40")
    crashed = [(t["fault"], t["trial_seed"], t.get("error")) for t in result["trials_detail"]
               if t["outcome"] != "exited"]
    assert code == 0, (err, result["violations"], crashed)
    assert {f: row["trials"] for f, row in result["faults"].items()} == dict.fromkeys(INFRA, 2)
    assert result["outcomes"] == {"exited": 2 * len(INFRA)}  # none hung
    for record in result["trials_detail"]:
        # The fault happened, while the trial ran.
        assert record["schedule"]["counts"].get(f"harness:{record['fault']}") == 1, record
        # How long the server was away, as it happened (a loaded machine stretches a stop
        # and start): well inside the lease (a worker renews every tenth of it, and needs a
        # moment to reconnect), no worker gave up.
        if record["fault_took"] < 0.8 * record["plan"]["lease"]:
            assert record["worker_exits"] == 0, record
        if record["fault"] == "pg_lost":  # what the crash took is counted (often > 0)
            assert record["lost_receipts"] >= 0, record


async def test_the_lost_commits_fault_loses_what_skipped_the_disk_and_nothing_else(
        tmp_path: Path) -> None:
    """``pg_lost``'s premise, on the server it runs (``wal_writer_delay`` 10 s) and through the
    journal's own relaxed commits: a crash loses the events committed by a relaxed flush since
    the last durable commit, and keeps every event a durable commit covered (it synced the log
    up to itself, the relaxed commits before it included)."""
    with PrivateServer(wal_writer_delay="10s") as server:
        url = f"{server.url}?schema=lost&keys={tmp_path / 'keys'}"

        async def kinds(journal: Journal) -> list[str]:
            rows = await journal._read(lambda db: db.execute(
                "SELECT kind FROM events ORDER BY id").fetchall())
            return [r[0] for r in rows]

        async with Journal(url) as journal:
            journal.relaxed_posts = True
            journal.event(1.0, "relaxed, then synced")
            await journal.flush(durable=False)
            journal.event(1.0, "durable")
            await journal.flush()
            journal.event(1.0, "relaxed, then lost")
            await journal.flush(durable=False)
            before = await kinds(journal)
            await asyncio.to_thread(server.restart, "immediate")
            after = await kinds(journal)  # reconnected
    assert before == ["relaxed, then synced", "durable", "relaxed, then lost"]
    assert after == ["relaxed, then synced", "durable"]


async def test_infrastructure_faults_need_postgresql() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "chaos", "--faults", "pg_restart", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pg_restart"), lines


DISK = ("disk_full", "journal_readonly")


async def test_disk_faults_find_no_violation(tmp_path: Path) -> None:
    """SQLite on a disk that fills up for a while, or turns read-only for good, mid-trial:
    calls fail with a JournalError before their tool runs, no process hangs, and the fresh
    supervisor (the disk back) reconciles the journal with the ledger."""
    code, result, err = await chaos("--faults", ",".join(DISK), "--per-fault", "2",
                                    "--seed", "5", "--traces", str(tmp_path))
    crashed = [(t["fault"], t["trial_seed"], t.get("error")) for t in result["trials_detail"]
               if t["outcome"] not in ("exited", "killed", "gave_up")]
    assert code == 0, (err, result["violations"], crashed)
    assert {f: row["trials"] for f, row in result["faults"].items()} == dict.fromkeys(DISK, 2)
    # A journal read-only for good may leave the orchestrator nothing to do but give up,
    # saying why (the disk); it never crashes on anything else, nor hangs.
    assert set(result["outcomes"]) <= {"exited", "killed", "gave_up"}, result["trials_detail"]
    struck = {f: 0 for f in DISK}
    for record in result["trials_detail"]:
        # At most once; not at all when the children were done before the fault's time.
        happened = record["schedule"]["counts"].get(f"harness:{record['fault']}", 0)
        assert happened <= 1, record
        struck[record["fault"]] += happened
        if record["outcome"] == "gave_up":
            assert record["error"].startswith(("gave up: JournalError: journal ",
                                               "gave up: GaveUp: no worker could start")), record
            assert any(why in record["error"] for why in (
                "is read-only (", "its disk refused", "its disk is full")), record
        if record["variant"] == "shorter":  # away for less than a lease: no worker gave up
            assert record["worker_exits"] == 0, record
    assert all(struck.values()), struck  # each fault struck in some trial
    assert chaos_mounts() == []  # every trial's disk unmounted


def chaos_mounts() -> list[str]:
    return [line for line in Path("/proc/mounts").read_text().splitlines()
            if "tether-chaos" in line]


async def test_disk_faults_need_sqlite(pg_url: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "chaos", "--faults", "disk_full", "--journal",
        pg_url.split("?")[0], cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: disk_full"), lines
