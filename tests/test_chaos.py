"""The chaos harness: a short fixed-seed run finds nothing; a deliberate bug is found; the
cross-process faults run, are judged, and a failing trial replays from its record."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tether._chaos.judge import CLASSES
from tether._chaos.plan import NEW_FAULTS, ORIGINAL_FAULTS, Plan, make_plan, plans

ROOT = Path(__file__).resolve().parent.parent
# The clean runs draw from the original faults: the cross-process ones still find violations
# on the current runtime (docs/reliability.md), which is what they are for.
ORIGINAL = ",".join(ORIGINAL_FAULTS)


async def chaos(*args: str, inject: str = "") -> tuple[int, dict[str, Any], str]:
    env = {**os.environ}
    if inject:
        args = (*args, "--inject", inject)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "chaos", *args, "--json", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, json.loads(out) if out.strip() else {}, err.decode()


async def test_thirty_trials_find_no_violation(tmp_path: Path) -> None:
    code, result, err = await chaos("--trials", "30", "--seed", "7", "--faults", ORIGINAL,
                                    "--traces", str(tmp_path))
    assert code == 0, (err, result)
    assert result["trials"] == 30
    assert result["violations"] == []
    assert result["counts"] == {"lost": 0, "duplicate": 0, "ghost": 0, "unreconciled": 0,
                                "dishonest": 0, "stuck": 0, "tampered": 0}
    faults = result["faults"]
    assert isinstance(faults, dict) and sum(f["trials"] for f in faults.values()) == 30
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict) and outcomes.get("killed", 0) > 0  # kills really happen
    assert set(outcomes) <= {"exited", "killed"}  # none crashed or hung
    assert not os.listdir(tmp_path)  # only failing trials leave a record


async def test_writing_the_intent_after_dispatch_is_caught_and_replays(tmp_path: Path) -> None:
    """The harness is itself tested: break I1 with the interceptor it plants and chaos must
    say so."""
    traces = ("--traces", str(tmp_path))
    code, result, _ = await chaos("--trials", "8", "--seed", "3", "--faults",
                                  "kill_after_effect,recall,race", *traces,
                                  inject="intent_after_dispatch")
    assert code == 1
    counts = result["counts"]
    assert isinstance(counts, dict) and counts["lost"] > 0 and counts["ghost"] > 0
    violations = result["violations"]
    assert isinstance(violations, list)
    seed = next(v["trial_seed"] for v in violations if v["fault"] == "kill_after_effect")
    code, again, _ = await chaos("--replay", str(seed), *traces, inject="intent_after_dispatch")
    assert code == 1 and again["trials"] == 1
    replayed = again["violations"]
    assert isinstance(replayed, list) and {v["class"] for v in replayed} >= {"lost", "ghost"}
    code, clean, _ = await chaos("--replay", str(seed), *traces)  # the same trial, no bug: clean
    assert code == 0 and clean["violations"] == []


async def test_unknown_fault_kind_is_one_line() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "chaos", "--faults", "meteor", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert err.decode().strip().startswith("error: unknown fault kind(s) meteor")


async def test_trials_on_postgresql_find_no_violation(pg_url: str, tmp_path: Path) -> None:
    base = pg_url.split("?")[0]  # each trial makes and drops a schema of its own there
    code, result, err = await chaos("--trials", "12", "--seed", "11", "--journal", base,
                                    "--faults", ORIGINAL, "--traces", str(tmp_path))
    assert code == 0, (err, result)
    assert result["backend"] == "postgresql" and result["violations"] == []


# What shows, in a trial's observed schedule, that its fault really happened.
def _happened(fault: str, record: dict[str, Any]) -> bool:
    schedule = record["schedule"]
    counts: dict[str, int] = schedule["counts"]
    signals = {(target, sig) for _, target, sig in schedule["signals"]}
    controls = {(what, how) for _, what, _, how in schedule["controls"]}
    if fault == "pause_worker":
        return {("worker", "SIGSTOP"), ("worker", "SIGCONT")} <= signals
    if fault == "pause_orchestrator":
        return {("orchestrator", "SIGSTOP"), ("orchestrator", "SIGCONT")} <= signals
    if fault == "late_apply":
        return sum(n for k, n in counts.items() if k.endswith(":sent")) > 0
    if fault == "exit_in_flight":
        return counts.get("orchestrator:leaving", 0) == 1
    if fault == "cancel_in_delay":
        how = record["plan"]["variant"].split("_")[-1]
        return any(what == "control_returned" and h.endswith(how) for what, h in controls)
    if fault == "cli_recall":
        return ("control_returned", "cli recall") in controls
    raise AssertionError(fault)


def _check_judged(result: dict[str, Any], traces: Path) -> None:
    assert result["trials"] == len(NEW_FAULTS)
    assert {f: row["trials"] for f, row in result["faults"].items()} == dict.fromkeys(
        NEW_FAULTS, 1)
    assert sum(row["violations"] for row in result["faults"].values()) == len(
        result["violations"])
    assert {v["class"] for v in result["violations"]} <= set(CLASSES)
    for record in result["trials_detail"]:
        assert _happened(record["fault"], record), record
        assert Plan.from_json(json.dumps(record["plan"])).fault == record["fault"]
        if record["violations"]:  # a failing trial: its record holds the whole trace
            assert record["trace"] and record["found"]
            saved = json.loads((traces / f"trial-{record['trial_seed']}.json").read_text())
            assert saved["plan"] == record["plan"] and saved["trace"] == record["trace"]
        if record["outcome"] == "hung":
            assert any(v["class"] == "stuck" for v in record["found"])


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_each_cross_process_fault_runs_and_is_judged(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """One trial of each: a worker paused past its lease, the orchestrator paused while
    another process reconciles it, requests applied late, an orchestrator leaving with calls
    in flight, a cancel from another process during a re-dispatch delay, a CLI recall. Their
    violations on the current runtime are expected; what is checked is that each fault
    happened and was judged, and that a failing trial is recorded for its replay."""
    extra: tuple[str, ...] = ()
    if backend == "postgresql":
        extra = ("--journal", request.getfixturevalue("pg_url").split("?")[0])
    code, result, err = await chaos("--faults", ",".join(NEW_FAULTS), "--per-fault", "1",
                                    "--seed", "1", "--traces", str(tmp_path),
                                    "--trial-timeout", "12", *extra)
    assert code in (0, 1), err
    assert code == (1 if result["violations"] else 0)
    _check_judged(result, tmp_path)


async def test_a_provider_that_applies_twice_is_caught_and_replays(tmp_path: Path) -> None:
    """The cross-process faults are themselves tested: a provider that applies each request
    of the network twice must show as duplicates, and the failing trial must replay from its
    record, printed beside the recorded run."""
    traces = ("--traces", str(tmp_path))
    code, result, _ = await chaos("--faults", "late_apply", "--per-fault", "2", "--seed", "5",
                                  "--inject", "double_apply", *traces)
    assert code == 1 and result["inject"] == "double_apply"
    dupes = [v for v in result["violations"] if v["class"] == "duplicate"]
    assert dupes and {v["fault"] for v in dupes} == {"late_apply"}
    seed = dupes[0]["trial_seed"]
    assert (tmp_path / f"trial-{seed}.json").exists()
    code, again, _ = await chaos("--replay", str(seed), "--inject", "double_apply", *traces)
    assert code == 1 and again["trials"] == 1
    assert again["replay_plan"] == "recorded" and again["replay_of"]["trial_seed"] == seed
    assert "divergence" in again and again["trials_detail"][0]["trace"]
    assert any(v["class"] == "duplicate" for v in again["violations"])
    code, clean, _ = await chaos("--replay", str(seed), *traces)  # the same plan, no bug
    assert not any(v["class"] == "duplicate" for v in clean["violations"])
    assert clean["replay_plan"] == "recorded"


def test_plans_follow_from_the_seed_and_old_records_still_load() -> None:
    assert plans(9, 5) == plans(9, 5)
    covered = plans(9, 0, NEW_FAULTS, per_fault=2)
    assert [p.fault for p in covered] == [f for f in NEW_FAULTS for _ in range(2)]
    old = {k: v for k, v in json.loads(make_plan(4).to_json()).items()
           if k in ("seed", "fault", "children", "refunds", "latency", "reply",
                    "control_after", "grace", "kill_after", "kill_nth", "probe_mode")}
    assert Plan.from_json(json.dumps(old)).late == 0.0  # a record from before the new fields


def test_a_hung_orchestrator_leaves_its_threads_stacks(tmp_path: Path) -> None:
    """Before a hung trial's process is killed it is asked (SIGUSR1, ``_chaos.stacks``) for
    every thread's stack and every asyncio task's, so that the record says where it waited,
    after the last lines its log held."""
    import subprocess
    import sys
    import time

    from tether._chaos.harness import _stacks_of

    log = tmp_path / "orchestrator.log"
    script = ("import asyncio\n"
              "from tether._chaos import stacks\n"
              "stacks.install()\n"
              "async def waiting_here():\n"
              "    await asyncio.sleep(60)\n"
              "async def main():\n"
              "    task = asyncio.create_task(waiting_here(), name='the-stuck-task')\n"
              "    print('ready', flush=True)\n"
              "    await task\n"
              "asyncio.run(main())\n")
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while b"ready" not in log.read_bytes():  # a condition, polled with a bound
            assert time.monotonic() < deadline, "the process never started"
            time.sleep(0.02)
        stacks = _stacks_of(proc, log)
    finally:
        proc.kill()
        proc.wait()
    assert "the-stuck-task" in stacks and "waiting_here" in stacks, stacks  # its task
    assert "Current thread" in stacks and stacks.index("ready") < stacks.index("Current"), stacks


async def test_a_chain_that_does_not_verify_at_the_end_is_judged_tampered(
        journal_url: str, tmp_path: Path) -> None:
    """The harness reads every delegation's chain at the end as `tether verify` does: a
    trial whose journal would fail it (here, a state flipped by hand) is a violation."""
    import tether
    from tests.test_trust import raw
    from tether._chaos.judge import judge, snapshot
    from tether._chaos.ledger import Ledger

    async def body(ctx: tether.Context) -> str:
        return "ok"

    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(body)
        await handle.result()
    ledger, plan = Ledger(tmp_path / "ledger.db"), make_plan(7)
    snap = await snapshot(journal_url)
    assert snap.chains == [] and judge(snap, ledger, plan, "ok") == []
    async with tether.Journal(journal_url) as j:
        await raw(j, "UPDATE delegations SET state = 'FAILED' WHERE id = ?", handle.id)
    snap = await snapshot(journal_url)
    found = judge(snap, ledger, plan, "ok")
    assert [v.kind for v in found] == ["tampered"] and handle.id in found[0].detail, found
