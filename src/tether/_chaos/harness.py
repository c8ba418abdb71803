"""``tether chaos``: run trials, reconcile after each, and judge by the ledger.

Violation classes, each checked against the outside world's own record:
lost (applied, yet no COMPLETED journal record), duplicate (a key applied more than once),
ghost (an intent accepted after its delegation's fence closed, or after a stop of its task
returned to the process that asked for it, or an effect with no intent), unreconciled (an
action left PENDING or IN_DOUBT), dishonest (NOT_APPLIED or FAILED for an effect that was
applied), stuck (a delegation that never reached a terminal state, an orchestrator or a
helper process that hung, a recovery that failed) and tampered (a delegation's chain does not
verify, or reads as rolled back, at the end: nobody tampers in a trial).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tether
from tether._chaos import trace as tracing
from tether._chaos.disk import JournalDisk, check_can_mount
from tether._chaos.judge import CLASSES, Violation, judge, snapshot
from tether._chaos.ledger import Ledger, Network
from tether._chaos.pgserver import PrivateServer
from tether._chaos.plan import (
    ALL_FAULTS,
    CLOCK_TOLERANCE,
    DISK_FAULTS,
    FAULTS,
    GAVE_UP,
    INFRA_FAULTS,
    LATE_APPLY_MAX,
    Plan,
    make_plan,
    plans,
)
from tether._chaos.world import ENV_DIR, ENV_PLAN, TOOL_DEADLINE, Trial, build
from tether._core.model import ActionState


@dataclass
class TrialResult:
    plan: Plan
    outcome: str  # exited, killed, gave_up, crashed or hung
    violations: list[Violation]
    trace: list[tracing.Event] = field(default_factory=list)
    error: str = ""  # the orchestrator's last words, when it crashed or gave up

    def record(self, full: bool) -> dict[str, Any]:
        """What replays this trial: its plan and its observed schedule (the whole trace for
        a failing one)."""
        out: dict[str, Any] = {
            "trial_seed": self.plan.seed, "fault": self.plan.fault,
            "variant": self.plan.variant, "outcome": self.outcome,
            "violations": len(self.violations), "plan": json_plan(self.plan),
            "schedule": tracing.schedule(self.trace), "worker_exits": self.worker_exits(),
        }
        took = self.fault_took()
        if took is not None:  # how long the server or disk was away, to judge the exits by
            out["fault_took"] = round(took, 3)
        lost = self._fault_detail("lost_receipts")
        if lost is not None:  # pg_lost: the calls' receipts its crash took with it
            out["lost_receipts"] = lost
        if self.error:
            out["error"] = self.error
        if full:
            out["found"] = [v.to_json() for v in self.violations]
            out["trace"] = self.trace
        return out


    def fault_took(self) -> float | None:
        """How long the harness's infrastructure fault lasted (a restart's ``pg_ctl``), if any."""
        took = self._fault_detail("took")
        return None if took is None else float(took)

    def _fault_detail(self, name: str) -> float | int | None:
        for e in self.trace:
            if e["who"] == "harness" and e["what"] == self.plan.fault:
                value = e.get("detail", {}).get(name)
                return value if isinstance(value, int | float) else None
        return None

    def worker_exits(self) -> int:
        """Workers that exited on their own (their lease lost, say), not when told to stop."""
        return sum(1 for e in self.trace if e["what"] == "exit" and e["key"] == "worker"
                   and e.get("detail", {}).get("code") not in (0, None))


def json_plan(plan: Plan) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(plan.to_json())
    return data


def trial_url(directory: Path, base: str | None, plan: Plan) -> str:
    """The trial's own journal: a SQLite file in its folder, or a fresh PostgreSQL schema."""
    if base is None:
        if plan.fault in DISK_FAULTS:  # the keys stay in the folder, off the journal's disk
            return f"sqlite:///{directory / 'disk' / 'journal.db'}?keys={directory / 'keys'}"
        return f"sqlite:///{directory / 'journal.db'}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}schema=chaos_{plan.seed}_{os.getpid()}&keys={directory / 'keys'}"


def drop(url: str) -> None:
    if url.startswith("postgresql"):
        import psycopg
        from psycopg import sql

        from tether._journal.postgres import split_url

        conninfo, schema, _ = split_url(url)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stacks_of(proc: subprocess.Popen[bytes], log: Path) -> str:
    """A hung process's threads and tasks, as it writes them on SIGUSR1 (``stacks``), with
    what its log said before them."""
    size = log.stat().st_size if log.exists() else 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and (log.stat().st_size if log.exists() else 0) == size:
        time.sleep(0.05)  # another process writing its dump: polled, bounded
    time.sleep(0.2)  # the rest of the dump
    return log.read_bytes()[max(0, size - 1500):].decode(errors="replace")[-9000:]


def run_orchestrator(directory: Path, plan: Plan, url: str, timeout: float,
                     ledger: Ledger, server: PrivateServer | None = None,
                     disk: JournalDisk | None = None) -> tuple[str, str]:
    """('exited' | 'killed' | 'gave_up' | 'crashed' | 'hung', last words). The orchestrator leads
    a process group of its own: whatever it started and left behind is ended with it, by that
    group id. It gives up (exit GAVE_UP) when its journal refuses to go on: an honest end only
    when the trial's fault took the journal's disk away; otherwise it is a crash."""
    log = directory / "orchestrator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tether._chaos.orchestrator", str(directory), plan.to_json(),
             url], stdout=out, stderr=subprocess.STDOUT, env={**os.environ},
            start_new_session=True)
    code: int | None = None
    try:
        deadline = time.monotonic() + timeout
        if plan.fault == "pause_orchestrator":
            pause_orchestrator(proc, plan, directory, url, ledger, deadline)
        if plan.fault in INFRA_FAULTS and server is not None:
            infra_fault(proc, plan, server, ledger, deadline, url)
        if disk is not None:
            disk_fault(proc, plan, disk, ledger, deadline)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        # First end them all: a process stopped inside a write to the ledger holds its lock.
        _signal_group(proc.pid, signal.SIGCONT)
        stacks = _stacks_of(proc, log) if code is None else ""
        leftover = _signal_group(proc.pid, signal.SIGKILL) and code is not None
        proc.wait()
        if code is None:
            ledger.note("harness", "hung", "orchestrator", after=timeout, stacks=stacks)
        elif leftover:
            ledger.note("harness", "leftover", "", pgid=proc.pid)
    if code is None:
        return "hung", ""
    if code == -signal.SIGKILL:
        return "killed", ""
    if code != 0:
        lines = log.read_text(errors="replace").strip().splitlines()
        last = lines[-1][:300] if lines else f"exit code {code}"
        if code == GAVE_UP and disk is not None:
            return "gave_up", last
        return "crashed", last
    return "exited", ""


def _fault_time(proc: subprocess.Popen[bytes], plan: Plan, ledger: Ledger,
                deadline: float) -> bool:
    """Wait until ``plan.pause_after`` past the orchestrator's "delegated" note; False if it
    ended (or the trial's deadline passed) first."""
    while ledger.first_note("delegated") is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    start = ledger.first_note("delegated")
    assert start is not None
    time.sleep(max(0.0, start + plan.pause_after - time.time()))
    return proc.poll() is None


def pause_orchestrator(proc: subprocess.Popen[bytes], plan: Plan, directory: Path, url: str,
                       ledger: Ledger, deadline: float) -> None:
    """SIGSTOP the orchestrator once its children are delegated, for longer than its lease;
    meanwhile another process reconciles it as soon as its owner may be presumed dead."""
    if not _fault_time(proc, plan, ledger, deadline):
        return
    os.kill(proc.pid, signal.SIGSTOP)
    stopped = time.time()
    # Noted once it runs again: stopped inside a write to the ledger, it holds its lock.
    notes: list[tuple[float, str, str, dict[str, Any]]] = [
        (stopped, "signal", "orchestrator", {"sig": "SIGSTOP", "pid": proc.pid})]

    def resume() -> None:
        os.kill(proc.pid, signal.SIGCONT)
        notes.append((time.time(), "signal", "orchestrator",
                      {"sig": "SIGCONT", "pid": proc.pid}))

    # The SIGCONT comes when the pause ends, whatever the reconciler is doing: it may be
    # waiting for a lock of the ledger that the stopped orchestrator holds, and only the
    # SIGCONT releases it (a trial once waited there until the ledger gave up, 120 s).
    end = stopped + plan.pause_for
    timer = threading.Timer(plan.pause_for, resume)
    timer.start()
    try:
        time.sleep(max(0.0, stopped + 0.6 * plan.lease - time.time()))
        while time.time() < end - 0.05:
            try:
                settled = asyncio.run(recover(directory, url, plan, "reconciler"))
            except Exception as exc:  # noted; the final recovery is the one judged
                notes.append((time.time(), "reconcile_failed", "", {"error": repr(exc)[:300]}))
                settled = 0
            if settled:
                break
            time.sleep(0.1)
    finally:
        timer.join()
        for at, what, key, detail in sorted(notes, key=lambda n: n[0]):
            ledger.note("harness", what, key, at=at, **detail)


def infra_fault(proc: subprocess.Popen[bytes], plan: Plan, server: PrivateServer,
                ledger: Ledger, deadline: float, url: str) -> None:
    """Restart the trial's database server, stop it for a while, end its backends or pause it,
    once the children are delegated: every process of the trial must ride through or give up
    cleanly."""
    while ledger.first_note("delegated") is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.005)
    start = ledger.first_note("delegated")
    assert start is not None
    time.sleep(max(0.0, start + plan.pause_after - time.time()))
    detail: dict[str, Any] = {}
    if plan.fault == "pg_lost":
        # Right after a call was answered (its receipt committed without waiting for the
        # disk), while its child thinks: a crash then loses that receipt at least.
        while ledger.first_note("answered") is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.005)
        settled = _settled(url)
    at = time.time()
    try:
        if plan.fault == "pg_lost":
            server.restart(plan.variant)
            detail["lost_receipts"] = len(settled - _settled(url))
        elif plan.fault == "pg_restart":
            server.restart(plan.variant)
        elif plan.fault == "pg_terminate":
            server.terminate()
        elif plan.fault == "pg_down":
            server.down("immediate")
            try:
                time.sleep(plan.pause_for)
            finally:
                server.up()
        else:
            server.pause()
            time.sleep(plan.pause_for)
    finally:
        server.resume()
        ledger.note("harness", plan.fault, "", at=at, mode=plan.variant, took=time.time() - at,
                    **detail)


def _settled(url: str) -> set[str]:
    """The trial journal's calls with a receipt (no longer PENDING)."""
    import psycopg
    from psycopg import sql

    from tether._journal.postgres import split_url

    conninfo, schema, _ = split_url(url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT id FROM {}.actions WHERE state <> %s")
                            .format(sql.Identifier(schema)),
                            (ActionState.PENDING.value,)).fetchall()
    return {r[0] for r in rows}


def disk_fault(proc: subprocess.Popen[bytes], plan: Plan, disk: JournalDisk, ledger: Ledger,
               deadline: float) -> None:
    """Fill the journal's disk for a while, or make it read-only for the rest of the trial,
    once the children are delegated: every call must then fail before its tool runs, or go
    through; no process may hang."""
    if not _fault_time(proc, plan, ledger, deadline):
        return
    at = time.time()
    detail: dict[str, Any] = {}
    try:
        if plan.fault == "disk_full":
            detail["filled"] = disk.fill()
            time.sleep(plan.pause_for)
        else:
            disk.make_readonly()
    finally:
        if plan.fault == "disk_full":
            disk.free()
        ledger.note("harness", plan.fault, "", at=at, took=time.time() - at, **detail)


def fleet_resumes(directory: Path, plan: Plan, url: str, ledger: Ledger,
                  within: float = 20.0) -> None:
    """The disk repaired, the operator starts a worker again: it runs what stayed queued while
    no worker could write the journal (nobody else may run it), then stops with SIGTERM."""
    env = {**os.environ, ENV_DIR: str(directory), ENV_PLAN: plan.to_json()}
    log_path = directory / "worker-after.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(  # `tether worker`, which writes its stacks on SIGUSR1
            [sys.executable, "-m", "tether._chaos.stacks", "worker", "--journal", url, "--agents",
             "tether._chaos.agents:AGENTS", "--lease", f"{plan.lease}", "--stop-timeout", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and proc.poll() is None:
            if asyncio.run(_nothing_for_a_worker(url)):
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.wait(timeout=6.0)
        except subprocess.TimeoutExpired:
            code = None
            ledger.note("harness", "helper_hung", "worker-after", pid=proc.pid, after=6.0,
                        log=_stacks_of(proc, log_path))
        ledger.note("harness", "fleet_resumed", "", code=code)
    finally:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


async def _nothing_for_a_worker(url: str) -> bool:
    """Whether the worker started after the disk came back can still move anything: nothing is
    queued unclaimed, and nothing is held by an owner whose lease still runs (that worker
    itself, at work). What a dead process held waits for the recovery that comes next, which
    no worker does: waiting out the whole window for it only made the trial slower."""
    async with tether.Journal(url, create=False) as j:
        leased = {o.id for o in await j.owners()
                  if o.lease_until is not None and o.lease_until > time.time()}
        for row in await j.delegations():
            if row.state.terminal:
                continue
            if row.owner_id in leased:
                return False
            entry = await j.queue_entry(row.id)
            if entry is not None and entry.claimed_by is None and entry.done_at is None:
                return False
    return True


def recovery_policy(plan: Plan) -> tether.Policy:
    if plan.lease > 0:
        return tether.Policy(lease=plan.lease, clock_tolerance=CLOCK_TOLERANCE)
    return tether.Policy(clock_tolerance=CLOCK_TOLERANCE)


async def recover(directory: Path, url: str, plan: Plan, who: str = "recovery") -> int:
    """A fresh supervisor on the journal, with probes that work, reconciles whatever the
    orchestrator left (its process is gone, or presumed dead: its lease or heartbeat ran out).
    Returns how many delegations it reported on."""
    trial = Trial(directory, plan, who, buffered=who == "reconciler")
    refund, _, _ = build(trial)
    keys = tether.KeyRing.load(directory / "keys")
    try:
        async with tether.Supervisor(url, keys=keys, tools=[refund], recover=False,
                                     policy=recovery_policy(plan)) as sup:
            return len(await sup.recover()) + len(await sup.recover())
    finally:
        trial.close()


def one_trial(plan: Plan, base: str | None = None, timeout: float = 30.0,
              server: PrivateServer | None = None) -> TrialResult:
    with tempfile.TemporaryDirectory(prefix="tether-chaos-") as tmp:
        directory = Path(tmp)
        url = trial_url(directory, base, plan)
        # The journal alone on a small disk of its own; the ledger stays in the folder.
        disk = JournalDisk(directory, plan.fault) if plan.fault in DISK_FAULTS else None
        try:
            if disk is not None:
                disk.mount()
            ledger = Ledger(directory / "ledger.db")
            start = time.time()
            network = Network(directory / "ledger.db", twice=plan.bug == "double_apply",
                              overdue=plan.bug == "overdue_apply")
            network.start()
            try:
                return _trial(plan, directory, url, ledger, network, start, timeout, server,
                              disk)
            finally:
                network.close()
                ledger.close()
                drop(url)
        finally:
            if disk is not None:
                disk.close()


def _trial(plan: Plan, directory: Path, url: str, ledger: Ledger, network: Network,
           start: float, timeout: float, server: PrivateServer | None = None,
           disk: JournalDisk | None = None) -> TrialResult:
    outcome, error = run_orchestrator(directory, plan, url, timeout, ledger, server, disk)
    if disk is not None:
        disk.clear()  # the fault clears once the trial's processes are gone
        if plan.remote and (directory / "keys" / "signing.json").exists():
            fleet_resumes(directory, plan, url, ledger)
    if not (directory / "keys" / "signing.json").exists():
        # Killed before it opened the journal: nothing happened.
        return TrialResult(plan, outcome, [], tracing.collect(ledger, None, start), error)
    if plan.lease > 0 and ledger.first_note("leftover") is not None:
        time.sleep(plan.lease + 0.2)  # a worker ended with SIGKILL holds its lease until then
    extra: list[Violation] = []
    try:
        asyncio.run(recover(directory, url, plan))
    except tether.TetherError as exc:  # a recovery that fails is a finding
        extra.append(Violation(plan.seed, plan.fault, "stuck", f"recovery failed: {exc}"))
    if not network.drain(ledger, LATE_APPLY_MAX * 2 + 1.0):
        extra.append(Violation(plan.seed, plan.fault, "stuck",
                               f"requests still in the network: {network.error!r}"))
    snap = asyncio.run(snapshot(url))
    if TOOL_DEADLINE and not extra and any(
            a.state in (tether.ActionState.PENDING, tether.ActionState.IN_DOUBT)
            for a in snap.actions):
        # "Not applied yet" until the tool's dispatch deadline and the clock tolerance:
        # reconcile again past both.
        last = max(a.started_at for a in snap.actions)
        time.sleep(max(0.0, last + LATE_APPLY_MAX + CLOCK_TOLERANCE + 0.1 - time.time()))
        ledger.note("harness", "reconcile_again", "",
                    reason="past the dispatch deadline and the clock tolerance")
        with contextlib.suppress(tether.TetherError):
            asyncio.run(recover(directory, url, plan))
        snap = asyncio.run(snapshot(url))
    found = judge(snap, ledger, plan, outcome) + extra
    trace = tracing.collect(ledger, snap, start)
    return TrialResult(plan, outcome, found, trace, error)


def run_chaos(trials: int, seed: int, faults: tuple[str, ...] = FAULTS,
              replay: int | None = None, journal: str | None = None,
              progress: Callable[[int, Plan, str], None] | None = None, *,
              per_fault: int | None = None, traces: Path | None = None, inject: str = "",
              timeout: float = 30.0) -> dict[str, Any]:
    """Run the trials (or replay one) and summarise them. A failing trial's record (plan and
    observed schedule) is written to ``traces``; ``replay`` reads it back from there."""
    recorded: dict[str, Any] | None = None
    if replay is not None:
        recorded = tracing.load(traces, replay) if traces is not None else None
        base = Plan.from_json(json.dumps(recorded["plan"])) if recorded else make_plan(replay)
        chosen = [replace(base, bug=inject)]
    else:
        chosen = [replace(p, bug=inject) for p in plans(seed, trials, faults, per_fault)]
    per_fault_counts: dict[str, Counter[str]] = {f: Counter() for f in ALL_FAULTS}
    server: PrivateServer | None = None
    if any(p.fault in DISK_FAULTS for p in chosen):
        if journal is not None:
            raise tether.errors.UserError(f"{', '.join(DISK_FAULTS)} are faults of a SQLite "
                                          "journal's disk: leave --journal out")
        check_can_mount()
    if any(p.fault in INFRA_FAULTS for p in chosen):
        if journal is None:
            raise tether.errors.UserError(
                f"{', '.join(INFRA_FAULTS)} need --journal postgresql://... (the run then "
                "starts a private server of its own for every trial)")
        # Its WAL writer holds a commit that did not wait for the disk for up to 10 s, so
        # that a crash (``pg_lost``) loses what such commits wrote since the last that waited.
        server = PrivateServer(wal_writer_delay="10s").start()
        journal = server.url
    try:
        return _run(chosen, journal, timeout, per_fault_counts, traces, replay, recorded,
                    progress, seed, inject, server)
    finally:
        if server is not None:
            server.stop()


def _run(chosen: list[Plan], journal: str | None, timeout: float,
         per_fault_counts: dict[str, Counter[str]], traces: Path | None, replay: int | None,
         recorded: dict[str, Any] | None, progress: Callable[[int, Plan, str], None] | None,
         seed: int, inject: str, server: PrivateServer | None) -> dict[str, Any]:
    violations: list[Violation] = []
    outcomes: Counter[str] = Counter()
    details: list[dict[str, Any]] = []
    written: list[str] = []
    results: list[TrialResult] = []
    for i, plan in enumerate(chosen):
        result = one_trial(plan, journal, timeout, server)
        results.append(result)
        outcomes[result.outcome] += 1
        counts = per_fault_counts[plan.fault]
        counts["trials"] += 1
        counts["violations"] += len(result.violations)
        counts["worker_exits"] += result.worker_exits()
        for v in result.violations:
            counts[f"class:{v.kind}"] += 1
        violations += result.violations
        failing = bool(result.violations)
        details.append(result.record(full=failing or replay is not None))
        if failing and traces is not None and replay is None:
            record = result.record(full=True)
            record["backend"] = "sqlite" if journal is None else "postgresql"
            written.append(str(tracing.save(traces, record)))
        if progress is not None:
            progress(i, plan, result.outcome)
    counts_all = Counter(v.kind for v in violations)
    out: dict[str, Any] = {
        "trials": len(chosen), "seed": seed, "replay": replay,
        "backend": "sqlite" if journal is None else "postgresql",
        "faults": {f: {"trials": c["trials"], "violations": c["violations"],
                       "worker_exits": c["worker_exits"],
                       "classes": {k: c[f"class:{k}"] for k in CLASSES if c[f"class:{k}"]}}
                   for f, c in per_fault_counts.items() if c["trials"]},
        "outcomes": dict(outcomes),
        "violations": [v.to_json() for v in violations],
        "counts": {k: counts_all.get(k, 0) for k in CLASSES},
        "inject": inject or None,
        "trials_detail": details,
        "records": written,
    }
    if replay is not None:
        out["replay_of"] = recorded
        out["replay_plan"] = "recorded" if recorded else "from the seed"
        out["divergence"] = (tracing.divergence(recorded.get("trace", []), results[0].trace)
                             if recorded else None)
    return out
