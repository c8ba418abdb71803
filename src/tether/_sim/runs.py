"""Runs of many trials (``tether sim``): each trial's seed drawn from the run's, the results
summarised in ``tether chaos --json``'s shape, with the simulator's own fields added."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tether._sim.judge import SIM_CLASSES, Violation
from tether._sim.plan import TrialResult, trial_seed
from tether._sim.trial import run_trial
from tether._sim.world import FAULTS


def run_sim(trials: int, seed: int, faults: tuple[str, ...] = FAULTS,
            replay: int | None = None,
            progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The run's trials (or one replayed, with its trace)."""
    seeds = [replay] if replay is not None else [trial_seed(seed, i) for i in range(trials)]
    per_fault: dict[str, Counter[str]] = {f: Counter() for f in (*FAULTS, "none")}
    violations: list[Violation] = []
    details: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    started = time.perf_counter()
    results: list[TrialResult] = []
    for i, s in enumerate(seeds):
        result = run_trial(s, faults, trace=replay is not None)
        results.append(result)
        totals.update(result.stats)
        totals["steps"] += result.steps
        for f in result.faults or ("none",):
            c = per_fault[f]
            c["trials"] += 1
            c["violations"] += len(result.violations)
            for v in result.violations:
                c[f"class:{v.kind}"] += 1
        violations += result.violations
        if result.violations or replay is not None:
            details.append({"trial_seed": s, "faults": list(result.faults),
                            "violations": len(result.violations), "steps": result.steps,
                            "virtual_s": round(result.virtual, 3),
                            "trace_sha256": result.digest,
                            "found": [v.to_json() for v in result.violations]})
        if progress is not None:
            progress(i)
    elapsed = time.perf_counter() - started
    by_class = Counter(v.kind for v in violations)
    out: dict[str, Any] = {
        "trials": len(seeds), "seed": seed, "replay": replay, "backend": "sim",
        "faults": {f: {"trials": c["trials"], "violations": c["violations"],
                       "classes": {k: c[f"class:{k}"] for k in SIM_CLASSES if c[f"class:{k}"]}}
                   for f, c in per_fault.items() if c["trials"]},
        "selected_faults": list(faults),
        "outcomes": {"failing_trials": sum(1 for r in results if r.violations),
                     "clean_trials": sum(1 for r in results if not r.violations)},
        "violations": [v.to_json() for v in violations],
        "counts": {k: by_class.get(k, 0) for k in SIM_CLASSES},
        "inject": None,
        "trials_detail": details,
        "records": [],
        "elapsed_s": round(elapsed, 3),
        "trials_per_minute": round(len(seeds) / elapsed * 60) if elapsed > 0 else None,
        "totals": dict(totals),
    }
    if replay is not None:
        out["trace"] = results[0].trace
    return out


__all__ = ["run_sim"]
