"""Runs of many trials (``tether sim``): each trial's seed drawn from the run's, the results
summarised in ``tether chaos --json``'s shape, with the simulator's own fields added."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from tether._sim.judge import SIM_CLASSES, Violation
from tether._sim.mutate import Edit, applied
from tether._sim.plan import TrialResult, trial_seed
from tether._sim.trial import run_trial
from tether._sim.world import FAULTS

CHUNK = 50  # trials a worker process runs at a time (``jobs``)


def _orphaned(parent: int) -> None:
    """A worker process's start: it ends once the run's process is gone (killed, or stopped
    by a signal whose default runs no cleanup), instead of running on alone and holding the
    run's output pipes. The watch thread only sleeps: it changes no trial."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _chunk(seeds: list[int], faults: tuple[str, ...],
           edits: tuple[Edit, ...]) -> list[TrialResult]:
    """A worker process's share: its trials, with the run's edits in its own code."""
    with applied(*edits):
        return [run_trial(s, faults) for s in seeds]


def results(seeds: list[int], faults: tuple[str, ...], *, replay: bool = False,
            edits: tuple[Edit, ...] = (), jobs: int = 1,
            chunk: int = CHUNK) -> Generator[TrialResult, None, None]:
    """Each trial's result, in the run's order: in this process, or from ``jobs`` worker
    processes (each trial depends on its seed alone, so where it ran changes nothing)."""
    if jobs <= 1 or replay or len(seeds) <= chunk:
        with applied(*edits):
            for s in seeds:
                yield run_trial(s, faults, trace=replay)
        return
    parts = [seeds[i:i + chunk] for i in range(0, len(seeds), chunk)]
    # Spawned, not forked: a fresh interpreter holds no lock, thread or patched code of ours.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_orphaned, initargs=(os.getpid(),)) as pool:
        for part in pool.map(_chunk, parts, itertools.repeat(faults),
                             itertools.repeat(edits)):
            yield from part


def run_sim(trials: int, seed: int, faults: tuple[str, ...] = FAULTS,
            replay: int | None = None,
            progress: Callable[[int], None] | None = None, *,
            edits: tuple[Edit, ...] = (), jobs: int = 1, chunk: int = CHUNK) -> dict[str, Any]:
    """The run's trials (or one replayed, with its trace), with ``edits`` (a mutation) in
    the code they run, in this process or in ``jobs`` worker processes."""
    seeds = [replay] if replay is not None else [trial_seed(seed, i) for i in range(trials)]
    per_fault: dict[str, Counter[str]] = {f: Counter() for f in (*FAULTS, "none")}
    violations: list[Violation] = []
    details: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    started = time.perf_counter()
    done: list[TrialResult] = []
    ran = results(seeds, faults, replay=replay is not None, edits=edits, jobs=jobs,
                  chunk=chunk)
    for i, result in enumerate(ran):
        s = result.seed
        done.append(result)
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
        "outcomes": {"failing_trials": sum(1 for r in done if r.violations),
                     "clean_trials": sum(1 for r in done if not r.violations)},
        "violations": [v.to_json() for v in violations],
        "counts": {k: by_class.get(k, 0) for k in SIM_CLASSES},
        "inject": None,
        "trials_detail": details,
        "records": [],
        "elapsed_s": round(elapsed, 3),
        "trials_per_minute": round(len(seeds) / elapsed * 60) if elapsed > 0 else None,
        "jobs": jobs if replay is None and len(seeds) > chunk else 1,
        "totals": dict(totals),
    }
    if replay is not None:
        out["trace"] = done[0].trace
    return out


__all__ = ["run_sim"]
