"""The chaos harness: a short fixed-seed run finds nothing; a deliberate bug is found."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def chaos(*args: str, faults: str = "") -> tuple[int, dict[str, object], str]:
    env = {**os.environ}
    env.pop("TETHER_FAULTS", None)
    if faults:
        env["TETHER_FAULTS"] = faults
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "chaos", *args, "--json", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, json.loads(out) if out.strip() else {}, err.decode()


async def test_thirty_trials_find_no_violation() -> None:
    code, result, err = await chaos("--trials", "30", "--seed", "7")
    assert code == 0, (err, result)
    assert result["trials"] == 30
    assert result["violations"] == []
    assert result["counts"] == {"lost": 0, "duplicate": 0, "ghost": 0, "unreconciled": 0,
                                "dishonest": 0, "stuck": 0}
    faults = result["faults"]
    assert isinstance(faults, dict) and sum(f["trials"] for f in faults.values()) == 30
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict) and outcomes.get("killed", 0) > 0  # kills really happen


async def test_writing_the_intent_after_dispatch_is_caught_and_replays() -> None:
    """The harness is itself tested: break I1 with the fault switch and chaos must say so."""
    code, result, _ = await chaos("--trials", "8", "--seed", "3", "--faults",
                                  "kill_after_effect,recall,race",
                                  faults="intent_after_dispatch")
    assert code == 1
    counts = result["counts"]
    assert isinstance(counts, dict) and counts["lost"] > 0 and counts["ghost"] > 0
    violations = result["violations"]
    assert isinstance(violations, list)
    seed = next(v["trial_seed"] for v in violations if v["fault"] == "kill_after_effect")
    code, again, _ = await chaos("--replay", str(seed), faults="intent_after_dispatch")
    assert code == 1 and again["trials"] == 1
    replayed = again["violations"]
    assert isinstance(replayed, list) and {v["class"] for v in replayed} >= {"lost", "ghost"}
    code, clean, _ = await chaos("--replay", str(seed))  # the same trial, no bug: clean
    assert code == 0 and clean["violations"] == []


async def test_unknown_fault_kind_is_one_line() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "chaos", "--faults", "meteor", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert err.decode().strip().startswith("error: unknown fault kind(s) meteor")


async def test_trials_on_postgresql_find_no_violation(pg_url: str) -> None:
    base = pg_url.split("?")[0]  # each trial makes and drops a schema of its own there
    code, result, err = await chaos("--trials", "12", "--seed", "11", "--journal", base)
    assert code == 0, (err, result)
    assert result["backend"] == "postgresql" and result["violations"] == []
