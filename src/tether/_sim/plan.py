"""What a trial is made of, from its seed: the tasks (a root with children making payments),
the orchestrators' scripts of recalls, terminates and re-delegations, the signing key, and the
result's shape."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tether._core.headmark import Busy, HeadMark, HeadMemory, merge_marks
from tether._core.signing import SigningKey, TrustedKeys
from tether._sim.judge import Violation

HORIZON = 120.0  # virtual seconds for the orchestrators to finish
ACTS = ("recall", "terminate", "cancel", "recall+redelegate", "terminate+redelegate", "child",
        "recall+terminate")

_KEYS: tuple[SigningKey, TrustedKeys] | None = None


@dataclass(frozen=True, slots=True)
class Spec:
    """What an agent does: a root starts ``kids`` children (or pays itself when it has none);
    a child makes ``pays`` payments. ``cut``: where attempt 1's model stream is cut (-1 before
    any tool, j before payment j, ``pays`` after the last), or None. ``patience``: how long
    the agent waits for a payment before it gives up and returns, the call going on without
    it (code that ends with a call still out, as ``asyncio.timeout`` around a call does), or
    None to wait for each."""

    kind: str
    pays: int
    kids: tuple[Spec, ...] = ()
    cut: int | None = None
    reads: bool = False
    patience: float | None = None


@dataclass(frozen=True, slots=True)
class Act:
    """An orchestrator's move on a task at a time: one of ``ACTS``."""

    at: float
    task: str
    kind: str


def keys() -> tuple[SigningKey, TrustedKeys]:
    """One signing key per process: trials sign their intents with it (deterministic)."""
    global _KEYS
    if _KEYS is None:
        signer = SigningKey.from_raw(bytes(range(32)), "sim")
        _KEYS = (signer, TrustedKeys([signer.public]))
    return _KEYS


class HeadsFile:
    """The configuration's ``heads.jsonl``: every process of a trial runs under one deployment's
    key directory, so each remembers the chain heads the others wrote or accepted (and those
    of its own earlier lives): appended by a process's ``persist``, taken in from where that
    process last looked by its ``refresh``. A crash loses what a process noted and had not
    persisted yet, never the file."""

    def __init__(self, on_look: Callable[[], None] = lambda: None,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.lines: list[tuple[str, HeadMark]] = []
        # Told of each look but a process's first: a process looks before each read of a
        # chain (``Journal.chain_verdicts``) and once a sealed batch.
        self.on_look = on_look
        # Whether another process holds the directory's lock now: an append that may not wait
        # for it (the event loop's) meets ``Busy``; one that waits (a close's) gets it, as the
        # lock's holder lets go (a wait the loop cannot model; production blocks on it).
        self.busy = busy

    def memory(self, alive: Callable[[], bool] = lambda: True) -> HeadMemory:
        """One process's memory of heads, on this file; ``alive`` False once it is killed
        (its code may still run while it is closed, but it appends nothing more)."""
        looked = [0]

        def look() -> dict[str, HeadMark] | None:
            self.on_look()
            return load()

        def load() -> dict[str, HeadMark] | None:
            if looked[0] == len(self.lines):
                return None
            fresh, looked[0] = self.lines[looked[0]:], len(self.lines)
            return merge_marks({}, fresh)

        def save(marks: Mapping[str, HeadMark], known: int, wait: bool) -> None:
            if not wait and self.busy():
                raise Busy("the key directory is locked by another process or thread")
            if alive():
                self.lines.extend(marks.items())

        return HeadMemory(load(), load=look, save=save)


def trial_seed(run_seed: int, index: int) -> int:
    return random.Random(f"sim:{run_seed}:{index}").randrange(2**31)


@dataclass
class TrialResult:
    seed: int
    faults: tuple[str, ...]
    violations: list[Violation]
    steps: int
    virtual: float
    trace: list[str] | None = None
    stats: Counter[str] = field(default_factory=Counter)
    digest: str = ""  # the step trace's hash (production engine)


def tasks(rng: random.Random, cuts: bool) -> list[Spec]:
    def pays(kind: str) -> Spec:
        n = rng.randint(1, 3)
        cut = rng.randint(-1, n) if cuts and rng.random() < 0.6 else None
        reads = rng.random() < 0.5
        patience = rng.choice((0.005, 0.05, 0.3)) if rng.random() < 0.25 else None
        return Spec(kind, n, (), cut, reads, patience)

    out = []
    for _ in range(rng.randint(1, 2)):
        kids = rng.choice((0, 1, 2))
        out.append(pays("root") if kids == 0 else
                   Spec("root", 0, tuple(pays("child") for _ in range(kids))))
    return out


def acts(rng: random.Random, tasks: list[str], n_orch: int, race: bool) -> list[list[Act]]:
    scripts: list[list[Act]] = [[] for _ in range(n_orch)]
    if race:
        task, at = rng.choice(tasks), rng.uniform(0.0, 2.0)
        for script in scripts:
            script.append(Act(at + rng.uniform(0.0, 0.01), task, rng.choice(ACTS)))
    for script in scripts:
        for _ in range(rng.choice((0, 0, 1, 1, 2))):
            script.append(Act(rng.uniform(0.0, 3.0), rng.choice(tasks), rng.choice(ACTS)))
        script.sort(key=lambda a: a.at)
    return scripts


