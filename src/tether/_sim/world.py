"""The simulated outside world: the provider with its own ledger, the network to it, the
faults, and one trial's plan drawn from its seed.

The provider does not deduplicate by idempotency key (like ``tether chaos``'s ledger): a
double-fire shows as two applications of a key, so the journal's key rules are what is tested.
It honours the tool's dispatch deadline: a request arriving at or after its expiry is refused
and never applied, and a probe may void a key so that nothing with it applies any more.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

FAULTS = (
    "crash",  # crash a host at any step; it restarts (a new process, a new owner id)
    "pause",  # pause a host (every process on it) for longer than a lease
    "late_apply",  # requests wait in the network: the provider applies them late
    "reply_lost",  # the provider applied, the reply never arrives
    "probe_raise",  # probes raise: UNKNOWN
    "probe_hang",  # probes hang past the probe timeout: UNKNOWN
    "probe_early",  # eager reconcilers probe while requests are still in the network
    "commit_lost",  # a journal write committed or not, the caller is not told which
    "notify_lost",  # the journal's notifications are lost: owners learn by polling only
    "clock",  # clocks drift and jump, within CLOCK_BOUND of the journal server's
    "race",  # several orchestrators recall, terminate, re-delegate and cancel one task at once
    "stream_cut",  # children whose model stream is cut: re-dispatch decided by decide_redispatch
    "server_lost",  # the journal's server crashes and loses the commits that skipped the disk
    "verify",  # an operator runs `tether verify` while the processes run: it must name nothing
    "keys_busy",  # another process holds the key directory's lock: heads are remembered later
)

# The simulated policy's clock tolerance (``Policy.clock_tolerance``): every judgement of a
# dispatch deadline adds it, since another host's clock wrote the deadline.
CLOCK_TOLERANCE = 1.0
# Every host's wall clock stays within this many seconds of the journal server's (the true
# time): the bound every real process enforces against the server (``clockcheck``: half the
# tolerance; workers also a quarter of their lease, far above it here).
CLOCK_BOUND = CLOCK_TOLERANCE / 2
# The simulated tool asks its provider to refuse a request this long before the dispatch
# deadline it journals. The provider judges the expiry on the true time, at most CLOCK_BOUND
# after the executor's deadline; a probe is final only at deadline + CLOCK_TOLERANCE on the
# prober's clock, at least CLOCK_BOUND after it in true time: no margin is needed.
DEADLINE_MARGIN = 0.0


class Net(Protocol):
    """What the provider runs on: the true time, timers outside any simulated process (a
    request in the network lands whatever happens to its sender), and the trial's notes."""

    @property
    def now(self) -> float: ...

    def call_at(self, when: float, fn: Callable[[], None]) -> None: ...

    def note(self, text: str) -> None: ...


class Reply(Protocol):
    def resolve(self, value: str) -> None: ...


@dataclass(slots=True, eq=False)
class Request:
    key: str
    action_id: str
    logical: str
    expires_at: float  # on the provider's clock
    reply: Reply
    state: str = "sent"  # sent, applied, refused


@dataclass(slots=True)
class Application:
    key: str
    action_id: str
    logical: str
    at: float


class Provider:
    """Applies each request it receives once, when it arrives, unless it has expired or its
    key was voided. Its ledger is the truth the judge compares the journal with."""

    overdue = False  # a deliberately broken provider (mutation tests): applies past expiry

    def __init__(self, net: Net, rng: random.Random, *, reply_loss: float) -> None:
        self.net = net
        self.rng = rng
        self.reply_loss = reply_loss
        self.ledger: list[Application] = []
        self.applied: dict[str, int] = {}
        self.voided: set[str] = set()
        self.in_network = 0
        self.last_arrival = 0.0

    def send(self, req: Request, delay: float, reply_delay: float) -> None:
        self.in_network += 1
        if self.overdue:  # slow as well as careless: requests land well past their expiry
            delay *= 2
        arrival = self.net.now + delay
        self.last_arrival = max(self.last_arrival, arrival)
        self.net.call_at(arrival, lambda: self._arrive(req, reply_delay))

    def _arrive(self, req: Request, reply_delay: float) -> None:
        self.in_network -= 1
        net = self.net
        if req.key in self.voided or (net.now >= req.expires_at and not self.overdue):
            req.state = "refused"
            net.note(f"provider refused {req.key} ({req.action_id})")
        else:
            req.state = "applied"
            self.applied[req.key] = self.applied.get(req.key, 0) + 1
            self.ledger.append(Application(req.key, req.action_id, req.logical, net.now))
            net.note(f"provider applied {req.key} ({req.action_id})")
        if self.rng.random() < self.reply_loss:
            net.note(f"reply for {req.action_id} lost")
            return
        state = req.state
        net.call_at(net.now + reply_delay, lambda: req.reply.resolve(state))

    def lookup(self, key: str, void: bool) -> tuple[int, bool]:
        """(applications of the key, whether it is now voided). Voiding refuses every later
        request with the key; it only happens to a key never applied."""
        n = self.applied.get(key, 0)
        if void and n == 0:
            self.voided.add(key)
        return n, key in self.voided


@dataclass(frozen=True, slots=True)
class Knobs:
    """What one trial's world is like, drawn from its seed."""

    lease: float
    deadline: float  # the pay tool's dispatch deadline
    poll: float
    tool_timeout: float  # the tool gives up on a reply after this long: IN_DOUBT
    latency: tuple[float, float]  # to the provider, min and max
    late: float  # probability a request waits long in the network
    reply_loss: float
    probe_raise: float
    probe_hang: float
    probe_latency: float  # at most
    commit_loss: float
    notify_loss: float
    void: bool  # the provider can void a key from a probe
    retry_safe_pay: bool  # the operator listed pay as retry-safe (I6 still needs no effect)
    settle_delay: float
    call_pause: float  # probability a host pauses the moment one of its call's rows commits


def knobs(rng: random.Random, active: frozenset[str]) -> Knobs:
    lease = rng.choice((2.0, 3.0, 4.0))
    return Knobs(
        lease=lease,
        deadline=rng.choice((2.0, 3.0, 5.0)),
        poll=rng.choice((0.05, 0.1, 0.25)) * (1 if "notify_lost" in active else 10),
        tool_timeout=rng.choice((0.8, 1.5, 3.0)),
        latency=(0.005, rng.choice((0.02, 0.1, 0.3))),
        late=0.5 if "late_apply" in active or "probe_early" in active else 0.0,
        reply_loss=0.3 if "reply_lost" in active else 0.0,
        probe_raise=0.4 if "probe_raise" in active else 0.0,
        probe_hang=0.4 if "probe_hang" in active else 0.0,
        probe_latency=rng.choice((0.01, 0.1, 0.5)),
        commit_loss=0.08 if "commit_lost" in active else 0.0,
        notify_loss=0.7 if "notify_lost" in active else 0.0,
        void=rng.random() < 0.3,
        retry_safe_pay=rng.random() < 0.5,
        settle_delay=rng.choice((0.05, 0.3, 1.0)),
        call_pause=0.03 if "pause" in active else 0.0,  # (no draw: other trials stay as they were)
    )


def active_faults(seed: int, selected: tuple[str, ...]) -> tuple[str, ...]:
    """The faults a trial runs with. One selected fault is always active; of several, each is
    drawn on its own stream keyed by the seed and its name, so a trial's active set is the
    same whether the run selected those faults only or more (``--replay`` relies on it)."""
    if len(selected) == 1:
        return selected
    return tuple(f for f in FAULTS if f in selected
                 and random.Random(f"{seed}:{f}").random() < 0.5)


__all__ = ["CLOCK_BOUND", "CLOCK_TOLERANCE", "DEADLINE_MARGIN", "FAULTS", "Application",
           "Knobs", "Net", "Provider", "Reply", "Request", "active_faults", "knobs"]
