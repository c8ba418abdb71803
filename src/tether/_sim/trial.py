"""One simulated trial from its seed, and runs of many (``tether sim``).

A trial: orchestrators delegate one or two queued tasks (a root with children making
payments); workers claim and run them; orchestrators recall, terminate, cancel and re-delegate
by script; faults strike. When every orchestrator is done (or the step budget is spent), every
host is stopped, time runs past every deadline and lease, a recovery with working probes
runs twice (``tether reconcile``), and the judge compares the journal with the ledger.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tether._core.model import Policy
from tether._core.redispatch import RedispatchPolicy
from tether._sim.actors import Orchestrator, Worker, reconciler
from tether._sim.journal import FIXES, Journal
from tether._sim.judge import CLASSES, SIM_CLASSES, Violation, judge
from tether._sim.plan import HORIZON, TrialResult, keys, trial_seed
from tether._sim.plan import acts as _acts
from tether._sim.plan import tasks as _tasks
from tether._sim.runtime import Env, Supervisor
from tether._sim.sched import Host, OutOfSteps, Sched, Step
from tether._sim.world import CLOCK_TOLERANCE, FAULTS, Provider, active_faults, knobs

STEP_BUDGET = 40_000


def run_trial(seed: int, selected: tuple[str, ...] = FAULTS, *, trace: bool = False,
              fixes: frozenset[str] = frozenset(FIXES)) -> TrialResult:
    active = active_faults(seed, selected)
    on = frozenset(active)
    rng = random.Random(seed)
    lines: list[str] | None = [] if trace else None
    sched = Sched(rng, lines, STEP_BUDGET)
    signer, trusted = keys()
    k = knobs(rng, on)
    policy = Policy(max_grace=5.0, ack_timeout=0.5, probe_timeout=rng.choice((0.3, 1.0)),
                    lease=k.lease, clock_tolerance=CLOCK_TOLERANCE)
    retry_safe = frozenset({"lookup", "pay"} if k.retry_safe_pay else {"lookup"})
    env = Env(sched, Journal(trusted), Provider(sched, rng, reply_loss=k.reply_loss), k, signer,
              trusted, policy, RedispatchPolicy(retry_safe, 1, k.settle_delay))
    env.journal.fixes = fixes
    skewed = "clock" in on
    specs = _tasks(rng, "stream_cut" in on)
    task_ids = [f"t{i}" for i in range(len(specs))]
    by_task = dict(zip(task_ids, specs, strict=True))
    n_orch = rng.randint(2, 3) if "race" in on else 1
    scripts = _acts(rng, task_ids, n_orch, "race" in on)
    restarts: Counter[str] = Counter()
    orchestrators: list[Orchestrator] = []
    pending = [0]

    def worker_exit(w: Worker) -> None:  # a worker that lost its lease is restarted
        restart(w.host.name.split(".")[0], rng.uniform(0.2, 1.0) * k.lease)

    def start_worker(base: str) -> None:
        Worker(env, f"{base}.{restarts[base]}", by_task, skewed, worker_exit)

    def start_orchestrator(base: str, index: int, resumed: bool) -> None:
        acts = [] if resumed else scripts[index]
        orchestrators.append(Orchestrator(env, f"{base}.{restarts[base]}", task_ids, acts,
                                          creator=index == 0, skewed=skewed))

    def restart(base: str, delay: float) -> None:
        pending[0] += 1

        def again() -> None:
            pending[0] -= 1
            restarts[base] += 1
            if base.startswith("w"):
                start_worker(base)
            elif base.startswith("o"):
                start_orchestrator(base, int(base[1:]), True)

        sched.call_at(sched.now + delay, again)

    for i in range(rng.randint(1, 2)):
        start_worker(f"w{i}")
    for i in range(n_orch):
        start_orchestrator(f"o{i}", i, False)
    if on & {"probe_early", "crash", "pause"}:
        times = ([rng.uniform(0.1, 0.5) * j for j in range(1, 16)] if "probe_early" in on
                 else sorted(rng.uniform(0.5, 6.0) for _ in range(2)))
        reconciler(env, "rec", times, skewed)
    _faults(env, rng, on, restart)

    def finished() -> bool:
        return pending[0] == 0 and all(o.done or not o.host.alive for o in orchestrators) \
            and any(o.done for o in orchestrators)

    quiesced: str | None = None
    try:
        if not sched.run(finished, HORIZON):
            quiesced = f"orchestrators still waiting at t={sched.now:.1f}s"
    except OutOfSteps as exc:
        quiesced = f"step budget spent ({exc})"
    _final_recovery(env)
    found = judge(env.journal, env.provider, env.stops, sched.errors, quiesced)
    result = TrialResult(seed, active, [Violation(seed, active, c, d) for c, d in found],
                         sched.steps, sched.now, lines)
    result.stats.update(restarts=sum(restarts.values()), read_backs=env.reading_back,
                        applied=len(env.provider.ledger), actions=len(env.journal.actions),
                        controls=sum(len(c) for c in env.journal.controls.values()))
    return result


def _faults(env: Env, rng: random.Random, on: frozenset[str],
            restart: Callable[[str, float], None]) -> None:
    sched = env.sched
    if "crash" in on:
        targets = sorted(rng.randint(1, 600) for _ in range(rng.randint(1, 2)))

        def crash(host: Host) -> None:
            if targets and sched.steps >= targets[0] and host.name[0] in "wor":
                targets.pop(0)
                sched.note(f"crash {host.name}")
                sched.kill(host)
                if host.name[0] in "wo":
                    restart(host.name.split(".")[0], rng.uniform(0.1, 2.0) * env.knobs.lease)

        sched.on_step = crash
    if "pause" in on:
        for _ in range(rng.randint(1, 2)):
            at = rng.uniform(0.05, 4.0)
            length = env.knobs.lease * rng.uniform(1.2, 2.5)
            pick = rng.random()

            def pause(pick: float = pick, length: float = length) -> None:
                hosts = [h for h in (*env.workers, *env.orchestrators) if h.alive]
                if hosts:
                    host = hosts[int(pick * len(hosts))]
                    host.paused_until = sched.now + length
                    sched.note(f"pause {host.name} for {length:.2f}s")

            sched.call_at(at, pause)


def _final_recovery(env: Env) -> None:
    """Stop every host, let time pass every deadline and lease, then reconcile twice with
    probes that work (the operator's ``tether reconcile`` after the incident)."""
    sched, journal = env.sched, env.journal
    for host in env.hosts.values():
        if host.alive:
            sched.kill(host)
    deadlines = [a.deadline_at for a in journal.actions.values()]
    leases = [o.lease_until or 0.0 for o in journal.owners.values()]
    end = max([sched.now, env.provider.last_arrival, *deadlines, *leases]) \
        + env.policy.lease + env.policy.clock_tolerance + 1.0
    sched.run(horizon=end)
    sched.now = max(sched.now, end)
    host = Host("final")
    sup = Supervisor(env, host, env.new_id("r"), lossy=False, reliable_probes=True)

    def twice() -> Step:
        yield from sup.recover()
        yield from sup.recover()

    sched.spawn(host, "reconcile", twice(), daemon=True)
    sched.budget = sched.steps + STEP_BUDGET
    try:
        sched.run()
    except OutOfSteps:
        sched.errors.append("the final recovery did not finish")


def run_sim(trials: int, seed: int, faults: tuple[str, ...] = FAULTS,
            replay: int | None = None, progress: Callable[[int], None] | None = None,
            fixes: frozenset[str] = frozenset(FIXES), engine: str = "mirror") -> dict[str, Any]:
    """The run's trials (or one replayed, with its trace), summarised in ``tether chaos
    --json``'s shape, with the simulator's own fields added. ``engine``: ``mirror`` (the
    hand-written model) or ``production`` (the production runtime and journal on the
    simulator's loop, ``tether._sim.production``; it takes no ``fixes``)."""
    one: Callable[..., TrialResult] = run_trial
    if engine == "production":
        from tether._sim import production

        def one(s: int, faults: tuple[str, ...], *, trace: bool,
                fixes: frozenset[str]) -> TrialResult:
            return production.run_trial(s, faults, trace=trace)

    seeds = [replay] if replay is not None else [trial_seed(seed, i) for i in range(trials)]
    per_fault: dict[str, Counter[str]] = {f: Counter() for f in (*FAULTS, "none")}
    violations: list[Violation] = []
    details: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    started = time.perf_counter()
    results = []
    for i, s in enumerate(seeds):
        result = one(s, faults, trace=replay is not None, fixes=fixes)
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
                            **({"trace_sha256": result.digest} if result.digest else {}),
                            "found": [v.to_json() for v in result.violations]})
        if progress is not None:
            progress(i)
    elapsed = time.perf_counter() - started
    by_class = Counter(v.kind for v in violations)
    out: dict[str, Any] = {
        "trials": len(seeds), "seed": seed, "replay": replay, "backend": "sim",
        "engine": engine,
        "faults": {f: {"trials": c["trials"], "violations": c["violations"],
                       "classes": {k: c[f"class:{k}"] for k in SIM_CLASSES if c[f"class:{k}"]}}
                   for f, c in per_fault.items() if c["trials"]},
        "selected_faults": list(faults),
        "fixes": sorted(fixes),
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


__all__ = ["CLASSES", "run_sim", "run_trial", "trial_seed"]
