"""What one chaos trial does, derived from its seed alone (so any trial replays from it)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

FAULTS = (
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


@dataclass(frozen=True)
class Plan:
    seed: int
    fault: str
    children: int
    refunds: int  # per child
    latency: float  # provider latency, seconds
    reply: float  # from applied to the reply reaching the caller
    control_after: float  # when the orchestrator recalls or terminates
    grace: float
    kill_after: float  # kill_random: when
    kill_nth: int  # kill_*: at which occurrence of the point
    probe_mode: str  # "ok", "raise" or "hang"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls(**json.loads(text))


def trial_seed(run_seed: int, index: int) -> int:
    return random.Random(f"{run_seed}:{index}").randrange(2**31)


def plans(run_seed: int, trials: int, faults: tuple[str, ...] = FAULTS) -> list[Plan]:
    """The run's trials: seeds in order, keeping those whose fault is among ``faults``."""
    chosen: list[Plan] = []
    index = 0
    while len(chosen) < trials:
        plan = make_plan(trial_seed(run_seed, index))
        index += 1
        if plan.fault in faults:
            chosen.append(plan)
    return chosen


def make_plan(seed: int) -> Plan:
    """Everything about a trial follows from its seed, so ``--replay SEED`` reruns it."""
    rng = random.Random(seed)
    fault = rng.choice(FAULTS)
    slow = fault == "slow_tool"
    return Plan(
        seed=seed, fault=fault, children=rng.randint(1, 3), refunds=rng.randint(1, 3),
        latency=0.15 if slow else rng.choice([0.0, 0.005, 0.02]),
        reply=rng.choice([0.0, 0.01, 0.05]),
        control_after=rng.uniform(0.0, 0.06),
        grace=0.03 if slow else rng.choice([0.05, 0.2, 0.5]),
        kill_after=rng.uniform(0.0, 0.12), kill_nth=rng.randint(1, 3),
        probe_mode=rng.choice(["raise", "hang"]) if fault == "probe_fail" else "ok",
    )
