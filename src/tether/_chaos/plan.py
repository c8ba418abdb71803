"""What one chaos trial does, derived from its seed alone (so any trial replays from it)."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import asdict, dataclass
from typing import Any

ORIGINAL_FAULTS = (
    "kill_random",  # SIGKILL at a random moment while children act
    "kill_before_dispatch",  # intent durable, request not yet sent
    "kill_during_dispatch",  # request at the provider, not yet applied
    "kill_after_effect",  # applied, reply not yet back
    "kill_in_grace",  # during a recall's grace window
    "kill_in_reconcile",  # inside a probe, while reconciling
    "recall",  # recall at a random time
    "terminate",  # terminate at a random time
    "race",  # two workers recall and re-delegate one task at once
    "stream_cut",  # children whose model stream is cut
    "probe_fail",  # probes that raise or hang
    "slow_tool",  # tools slower than the grace window
)
# Timings across processes: helpers (`tether worker`, the CLI, a second supervisor) are real
# processes the orchestrator starts; the harness pauses the orchestrator itself.
NEW_FAULTS = (
    "pause_worker",  # SIGSTOP a `tether worker` mid-call for longer than its lease, then SIGCONT
    "pause_orchestrator",  # SIGSTOP the orchestrator past its lease; another process reconciles
    "late_apply",  # the provider applies a request a while after it was sent (in the network)
    "exit_in_flight",  # the orchestrator leaves `async with Supervisor` with calls in flight
    "cancel_in_delay",  # a cut child's re-dispatch delay; terminated from another process
    "cli_recall",  # `tether recall ID --grace G` of a busy child, from another process
)
FAULTS = ORIGINAL_FAULTS + NEW_FAULTS
# Faults of the infrastructure, on a private PostgreSQL server the run starts for itself. Drawn
# only when named (``--faults``), so that the other faults' seeds keep giving the same plans.
INFRA_FAULTS = (
    "pg_restart",  # `pg_ctl restart -m fast|immediate` mid-trial
    "pg_terminate",  # pg_terminate_backend on every client backend mid-trial
    "pg_pause",  # SIGSTOP the postmaster and its backends for longer than a lease
    "pg_down",  # `pg_ctl stop -m immediate`, started again after less or more than a lease
    # The orchestrator answers each call after a commit that need not reach the disk (the
    # MCP proxy's mode); the server crashes (`pg_ctl restart -m immediate`) and loses those
    # since the last commit that waited (its WAL writer holds them: ``PrivateServer``).
    "pg_lost",
)
# Faults of the disk under a SQLite journal (tether._chaos.disk), drawn only when named too.
DISK_FAULTS = (
    "disk_full",  # the journal's file system fills up for a while, then has room again
    "journal_readonly",  # the journal's file system turns read-only (an error) mid-trial
)
NAMED_ONLY = INFRA_FAULTS + DISK_FAULTS
# The exit code of an orchestrator that gave up (its journal refused to go on), its reason
# on its last line: an honest end in a disk-fault trial, a crash anywhere else.
GAVE_UP = 3
ALL_FAULTS = FAULTS + NAMED_ONLY

# The provider applies a request at most this many seconds after the tool sent it, or never
# (it drops what is older): the chaos refund tool declares it as its dispatch deadline. Plans
# keep the provider's late-apply delay below it.
LATE_APPLY_MAX = 1.0
# Requests expire this much before LATE_APPLY_MAX after the tool's first line, which runs
# just after the intent: the slack keeps "applied within LATE_APPLY_MAX of the intent" true.
DEADLINE_SLACK = 0.05
# The supervisors' clock tolerance (``Policy.clock_tolerance``). Every process of a trial runs
# on this host, against a local server: one clock, so a small tolerance is safe and keeps the
# wait for a final "not applied" short.
CLOCK_TOLERANCE = 0.5

# Deliberate bugs of the simulated world, switched on with `tether chaos --inject`, to prove
# that the harness catches what they break. They live here, never in the runtime.
BUGS = (
    "double_apply",  # the network delivers every request twice (a provider without keys)
    "blind_probe",  # the provider's lookup misses requests that arrived through the network
    "overdue_apply",  # the provider applies requests past the deadline the tool declares
    # A bug of the runtime, planted in the orchestrator's gateway (tether._chaos.faults).
    "intent_after_dispatch",  # a tool runs before its intent is written (breaks I1)
    # A head sealed by a commit that skipped the disk is remembered as durable at once (the
    # chain's memory); with ``pg_lost``, its configuration then reads the journal as rolled back.
    "relaxed_synced",
)


@dataclass(frozen=True)
class Plan:
    seed: int
    fault: str
    children: int
    refunds: int  # per child
    latency: float  # provider latency, seconds
    reply: float  # from applied to the reply reaching the caller
    control_after: float  # when the orchestrator recalls, terminates, exits or cancels
    grace: float
    kill_after: float  # kill_random (and late_apply/kill): when
    kill_nth: int  # kill_*: at which occurrence of the point
    probe_mode: str  # "ok", "raise" or "hang"
    # Added with the cross-process faults; the defaults are the original faults' behaviour.
    late: float = 0.0  # > 0: requests travel through the network and apply this much later
    remote: bool = False  # children run on a `tether worker` (delegate(..., remote=True))
    lease: float = 0.0  # > 0: the worker's lease and the supervisors' Policy.lease
    pause_after: float = 0.0  # when the SIGSTOP comes, after the children were delegated
    pause_for: float = 0.0  # how long until the SIGCONT
    think: float = 0.0  # pg_lost: the child's pause after each answered call (its model)
    settle: float = 0.01  # the re-dispatch settle delay
    variant: str = ""  # the fault's sub-mode (which process, which control)
    bug: str = ""  # a deliberate bug of the simulated world (see BUGS), "" for none

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


def trial_seed(run_seed: int, index: int) -> int:
    return random.Random(f"{run_seed}:{index}").randrange(2**31)


def plans(run_seed: int, trials: int, faults: tuple[str, ...] = FAULTS,
          per_fault: int | None = None) -> list[Plan]:
    """The run's trials: seeds in order, keeping those whose fault is among ``faults``; with
    ``per_fault``, the first ``per_fault`` seeds of each fault (in the order of ``faults``)."""
    chosen: list[Plan] = []
    wanted = {f: per_fault for f in faults} if per_fault is not None else None
    index = 0
    infra = any(f in NAMED_ONLY for f in faults)
    while (len(chosen) < trials) if wanted is None else any(wanted.values()):
        seed = trial_seed(run_seed, index)
        # With an infrastructure fault named, the fault is drawn among those named.
        plan = make_plan(seed, random.Random(seed).choice(faults) if infra else None)
        index += 1
        if wanted is None:
            if plan.fault in faults:
                chosen.append(plan)
        elif wanted.get(plan.fault):
            wanted[plan.fault] = (wanted[plan.fault] or 0) - 1
            chosen.append(plan)
    if wanted is not None:
        chosen.sort(key=lambda p: faults.index(p.fault))
    return chosen


def make_plan(seed: int, forced: str | None = None) -> Plan:
    """Everything about a trial follows from its seed, so ``--replay SEED`` reruns it (an
    infrastructure fault's trial from its recorded plan: its fault was chosen, not drawn)."""
    rng = random.Random(seed)
    fault = rng.choice(FAULTS)
    if forced is not None:
        fault = forced
    slow = fault == "slow_tool"
    plan = Plan(
        seed=seed, fault=fault, children=rng.randint(1, 3), refunds=rng.randint(1, 3),
        latency=0.15 if slow else rng.choice([0.0, 0.005, 0.02]),
        reply=rng.choice([0.0, 0.01, 0.05]),
        control_after=rng.uniform(0.0, 0.06),
        grace=0.03 if slow else rng.choice([0.05, 0.2, 0.5]),
        kill_after=rng.uniform(0.0, 0.12), kill_nth=rng.randint(1, 3),
        probe_mode=rng.choice(["raise", "hang"]) if fault == "probe_fail" else "ok",
    )
    if fault in NEW_FAULTS:  # a stream of its own, so the fields above stay as they were
        plan = dataclasses.replace(plan, **_cross_process(fault, random.Random(f"{seed}:{fault}")))
    if fault in INFRA_FAULTS:
        plan = dataclasses.replace(plan, **_infra(fault, random.Random(f"{seed}:{fault}")))
    if fault in DISK_FAULTS:
        plan = dataclasses.replace(plan, **_disk(fault, random.Random(f"{seed}:{fault}")))
    return plan


def _disk(fault: str, rng: random.Random) -> dict[str, Any]:
    """Children on this process or on a `tether worker`; the disk fills up for a while (then has
    room again) or turns read-only for good, once they are under way."""
    lease = rng.choice([1.0, 2.0])
    p: dict[str, Any] = {
        "remote": rng.random() < 0.5, "lease": lease, "latency": rng.uniform(0.02, 0.15),
        "children": rng.randint(1, 3), "refunds": rng.randint(1, 3),
        "pause_after": rng.uniform(0.0, 0.3),
        "pause_for": rng.uniform(0.2, 1.5) if fault == "disk_full" else 0.0,
    }
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()}


def _infra(fault: str, rng: random.Random) -> dict[str, Any]:
    """Children on this process or on a `tether worker`, the fault once they are under way."""
    remote = rng.random() < 0.5
    lease = rng.choice([1.0, 1.5]) if fault == "pg_pause" else rng.choice([2.0, 3.0])
    p: dict[str, Any] = {
        "remote": remote, "lease": lease, "latency": rng.uniform(0.02, 0.2),
        "children": rng.randint(1, 3), "refunds": rng.randint(1, 3),
        "pause_after": rng.uniform(0.0, 0.3),
        "variant": rng.choice(["fast", "immediate"]) if fault == "pg_restart" else "",
        # A pause outlasts a worker's lease: the worker gives its claims up.
        "pause_for": lease * rng.uniform(1.5, 2.5) if fault == "pg_pause" else 0.0,
    }
    if fault == "pg_lost":
        p["remote"] = False  # a `tether worker` posts durably: the orchestrator's calls here
        p["variant"] = "immediate"
        # The model thinks between calls: the last receipt waits for the disk meanwhile.
        p["think"] = rng.uniform(0.2, 0.6)
    if fault == "pg_down":
        # Shorter: down for 0.2 to 0.45 of the lease, so that, with stopping and starting, it
        # is back well before the least a worker holds (two thirds: it renews every third),
        # and no worker may exit. Longer: 1.5 to 2 leases, past any lease.
        shorter = rng.random() < 0.5
        p["variant"] = "shorter" if shorter else "longer"
        p["pause_for"] = lease * (rng.uniform(0.2, 0.45) if shorter else rng.uniform(1.5, 2.0))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()}


def _late(rng: random.Random, always: bool = False) -> float:
    if not always and rng.random() < 0.5:
        return 0.0
    return round(rng.uniform(0.1, 0.8 * LATE_APPLY_MAX), 4)


def _cross_process(fault: str, rng: random.Random) -> dict[str, Any]:
    lease = rng.choice([1.0, 1.5])
    p: dict[str, Any] = {"lease": lease, "children": rng.randint(1, 2),
                         "reply": rng.choice([0.0, 0.02])}
    if fault == "pause_worker":
        p.update(remote=True, variant="worker", latency=rng.uniform(0.05, 0.3), late=_late(rng),
                 pause_after=rng.uniform(0.0, 0.4), pause_for=lease * rng.uniform(1.5, 2.5))
    elif fault == "pause_orchestrator":
        variant = rng.choice(["local", "remote"])
        control = rng.uniform(0.05, 0.2)
        p.update(variant=variant, remote=variant == "remote", late=_late(rng),
                 latency=rng.uniform(0.05, 0.3) if variant == "local" else rng.uniform(0.2, 0.5),
                 control_after=control, grace=rng.choice([0.5, 1.0]),
                 pause_after=(control + rng.uniform(0.02, 0.1)) if variant == "remote"
                 else rng.uniform(0.0, 0.3),
                 pause_for=lease * rng.uniform(1.5, 2.5))
    elif fault == "late_apply":
        p.update(variant=rng.choice(["terminate", "recall", "kill"]), late=_late(rng, True),
                 latency=rng.choice([0.0, 0.01]), control_after=rng.uniform(0.0, 0.15),
                 grace=rng.choice([0.05, 0.2]), kill_after=rng.uniform(0.05, 0.4))
    elif fault == "exit_in_flight":
        variant = rng.choice(["local", "remote", "cut"])
        p.update(variant=variant, remote=variant == "remote", late=_late(rng),
                 latency=rng.uniform(0.05, 0.3), control_after=rng.uniform(0.0, 0.3),
                 settle=rng.uniform(0.2, 0.6) if variant == "cut" else 0.01)
    elif fault == "cancel_in_delay":
        p.update(variant=rng.choice(["cli_terminate", "sup_terminate", "sup_cancel"]),
                 latency=rng.choice([0.0, 0.01]), settle=rng.uniform(1.0, 1.5),
                 control_after=rng.uniform(0.0, 0.4))
    elif fault == "cli_recall":
        variant = rng.choice(["local", "remote"])
        p.update(variant=variant, remote=variant == "remote", latency=rng.uniform(0.1, 0.5),
                 grace=rng.choice([0.1, 0.3, 1.0]), control_after=rng.uniform(0.05, 0.3),
                 late=_late(rng))
    else:  # pragma: no cover - every new fault has a branch
        raise AssertionError(fault)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()}
