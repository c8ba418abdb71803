"""One trial of ``tether sim``: the production runtime on the simulator's loop.

Everything a trial runs is the code that ships: ``Supervisor`` (the orchestrators, a
reconciler and the final recovery), ``Worker`` (claims, leases, adoption of other processes'
intents), the gateway, drains, accounting and recovery, and every journal operation through
the production batch runner (``tether._journal.inline``) on one in-memory SQLite journal the
simulated processes share. The simulator supplies only the outside world and the faults:

- the loop (``loop.SimLoop``): virtual time, a seeded order, hosts that crash and pause;
- the provider (``world.Provider``, unchanged) behind the pay tool and its probe, on the
  loop's time;
- lost commit replies at the runner's COMMIT, failing and slow probes, late applies, skewed
  wall clocks.

A trial's seed fixes everything: the plan (``plan.tasks``, ``plan.acts``), the world's
knobs (``world.knobs``), every latency and fault, the ids (``state.id_source``) and the order
of callbacks due at one instant. Its step trace is the loop's callbacks in the order they ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import itertools
import json
import random
import sqlite3
import struct
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import tether
from tether._core.errors import TetherError
from tether._core.model import DelegationState, Policy
from tether._core.redispatch import RedispatchPolicy
from tether._core.signing import TrustedKeys
from tether._journal.inline import Bus, Loss, MemorySqlite, Server, shared_database
from tether._journal.journal import Journal
from tether._runtime.handle import Handle
from tether._runtime.keys import KeyRing
from tether._runtime.state import id_source
from tether._runtime.worker import Worker
from tether._sim import agents
from tether._sim.facts import Commits, one
from tether._sim.judge import Violation, judge
from tether._sim.loop import HOST, WALL0, Host, HostClock, SimLoop, StepBudget
from tether._sim.operator import chains_named, start_verifier, verify_now
from tether._sim.plan import HORIZON, HeadsFile, TrialResult, keys
from tether._sim.plan import acts as _acts
from tether._sim.plan import tasks as _tasks
from tether._sim.world import (
    CLOCK_BOUND,
    CLOCK_TOLERANCE,
    FAULTS,
    Knobs,
    Provider,
    active_faults,
    knobs,
)

STEP_BUDGET = 400_000  # callbacks
_S = DelegationState
_trials = itertools.count()  # names each trial's shared database apart within a process


class _Net:
    """What ``world.Provider`` schedules on: the loop's time, in no host's name (a request
    in the network lands whatever happens to its sender)."""

    def __init__(self, loop: SimLoop, notes: list[str] | None) -> None:
        self.loop, self.notes = loop, notes

    @property
    def now(self) -> float:
        return self.loop.time()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        self.loop.call_at(when, fn, context=contextvars.Context())

    def note(self, text: str) -> None:
        if self.notes is not None:
            self.notes.append(f"{self.loop.time():.6f} world {text}")


def _offset(rng: random.Random, skewed: bool) -> Callable[[float], float]:
    """A host's wall-clock offset at true time t: a skew, a drift and up to two jumps,
    always within CLOCK_BOUND of the journal server's (the true) time."""
    if not skewed:
        return lambda _t: 0.0
    b = CLOCK_BOUND
    base, drift = rng.uniform(-b, b), rng.uniform(-0.01, 0.01)
    jumps: list[tuple[float, float]] = []
    t = 0.0
    for _ in range(rng.randint(0, 2)):
        t += rng.uniform(0.2, 4.0)
        jumps.append((t, rng.uniform(-b, b)))

    def offset(now: float) -> float:
        value = base + drift * now
        for at, to in jumps:
            if now >= at:
                value = to
        return max(-b, min(b, value))

    return offset


class Trial:
    """One trial's world: its loop, journal, provider, agents and processes."""

    def __init__(self, seed: int, active: tuple[str, ...]) -> None:
        self.seed, self.on = seed, frozenset(active)
        self.rng = rng = random.Random(seed)
        self._looks = random.Random(f"{seed}:looks")  # ``looked``'s own draws
        self._reading: set[str] = set()  # hosts that looked at the heads and have not read
        self._runners: dict[str, list[MemorySqlite]] = {}  # each host's journals' runners
        self.lines: list[str] = []  # the step trace (hashed, printed on replay)
        self.loop = SimLoop(rng, trace=self.lines, max_steps=STEP_BUDGET)
        self.k: Knobs = knobs(rng, self.on)
        self.policy = Policy(max_grace=5.0, ack_timeout=0.5,
                             probe_timeout=rng.choice((0.3, 1.0)), lease=self.k.lease,
                             clock_tolerance=CLOCK_TOLERANCE)
        retry_safe = frozenset({"lookup", "pay"} if self.k.retry_safe_pay else {"lookup"})
        self.redispatch = RedispatchPolicy(retry_safe, 1, self.k.settle_delay)
        self.name = f"sim-{seed}-{next(_trials)}"
        self.anchor = shared_database(self.name)
        self.commits = Commits(self.anchor)
        self.provider = Provider(_Net(self.loop, self.lines), rng,
                                 reply_loss=self.k.reply_loss)
        self.reliable = False  # the final recovery's probes answer in time
        # The journal's notifications, as PostgreSQL gives them; lost under ``notify_lost``.
        self.bus = Bus(self.loop, lambda: rng.uniform(0.0005, 0.003),
                       lambda: bool(self.k.notify_loss) and rng.random() < self.k.notify_loss)
        # Under ``server_lost`` every process posts its writes without waiting for the disk
        # (``Journal.relaxed_posts``, as the MCP proxy does), and the server loses them.
        self.server = (Server(self.anchor, self.bus, self.commits.remember,
                              self.commits.restore) if "server_lost" in self.on else None)
        self.stops: list[tuple[str, int, int]] = []
        self.errors: list[str] = []
        self.broken: list[str] = []  # the tool's promise broken: a call sent past its deadline
        # Each key's last probe: by which host, when (true time) and when by that host's clock.
        self.asked: dict[str, tuple[Host, float, float]] = {}
        self.first_asked: dict[tuple[str, str], float] = {}  # (key, host): its first probe
        self.sups: dict[str, tether.Supervisor] = {}  # each host's supervisor (a worker's own)
        self.neglected: list[str] = []  # calls left in doubt by a process that could re-probe
        self.verified: list[str] = []  # what an operator's ``tether verify`` named meanwhile
        self.stats: Counter[str] = Counter()
        self.workers: list[Host] = []
        self.orchestrators: list[Host] = []
        self.others: list[Host] = []
        self.operators: list[Host] = []  # the operator's shell and its runs: no fault's target
        self.restarts: Counter[str] = Counter()
        self.pending = 0  # restarts scheduled, not yet made
        self.stopped = False  # every process was stopped for the final recovery
        self.done: set[str] = set()  # orchestrators that finished their script and waits
        self.ids = itertools.count()
        self.plans: dict[str, dict[str, Any]] = {}  # task id -> what its root does
        # Under ``keys_busy``, another process holds the key directory's lock now and then,
        # for a moment or past the journal's patience (``access.PERSIST_PATIENCE``). Drawn on
        # a stream of its own: a trial without it draws nothing more.
        self._holds = random.Random(f"{seed}:keys_busy")
        self._held_until = -1.0
        self.heads = HeadsFile(self.looked, self.keys_busy)  # the deployment's: shared
        self.pay, self.root, self.child = agents.build(self)

    # -- the world's pieces ---------------------------------------------------------------
    def note(self, text: str) -> None:
        self.lines.append(f"{self.loop.time():.6f} note {text}")

    def _id_bytes(self) -> bytes:
        return struct.pack(">QQ", next(self.ids), self.rng.getrandbits(64))

    def refusal(self, what: str) -> None:
        """The schema refused what the runtime asked of it (the live-key index, a foreign
        key): a decision the journal's own constraints had to catch, never a fault of the
        world. Recorded where it happens: a heartbeat's or a receipt's is answered to nobody."""
        self.errors.append(f"the journal's constraints refused a write: {what}")

    def keys_busy(self) -> bool:
        """Whether the key directory's lock is held by another process at this moment."""
        if "keys_busy" not in self.on:
            return False
        now = self.loop.time()
        if now < self._held_until:
            return True
        if self._holds.random() < 0.3:
            self._held_until = now + self._holds.choice((0.02, 0.3, 2.0, 6.0))
            self.stats["keys_busy"] += 1
            return True
        return False

    def _lose(self, wrote: bool) -> Loss:
        if self.k.commit_loss and self.rng.random() < self.k.commit_loss:
            # Counted where the commit wrote, as ``commits`` counts landed writes: a read's
            # lost COMMIT reply is a fault all the same, and costs a retry.
            self.stats["commits_lost"] += wrote
            return "after" if self.rng.random() < 0.5 else "before"
        return None

    def journal(self, host: Host, *, lossy: bool = True) -> Journal:
        def landed(runner: MemorySqlite) -> None:
            calls = any(table == "actions" for table, _ in runner.staged)
            self.commits.landed(runner)
            if runner.relaxed_write and self.rng.random() < 0.2:
                self.lose_server(self.rng.uniform(0.0, 0.05))
            elif runner.relaxed_write is None and host.name in self._reading:
                # The first read after a look at the heads outside a batch (a chain's read,
                # ``Journal.chain_verdicts``): half the time the server crashes the moment it
                # committed. Drawn on a stream of its own: a trial without ``server_lost``
                # draws nothing more.
                self._reading.discard(host.name)
                if self._looks.random() < 0.5:
                    self.crash_server()
            if calls:
                self.pause_here("after a call's row committed", host)

        runner = MemorySqlite(self.name, latency=lambda: self.rng.uniform(0.0005, 0.004),
                              on_refusal=self.refusal,
                              lose_commit=self._lose if lossy else (lambda wrote: None),
                              mark=f"{host.name}", on_commit=landed, bus=self.bus,
                              server=self.server, alive=lambda: host.alive)
        self._runners.setdefault(host.name, []).append(runner)
        journal = Journal(f"sqlite:///{self.name}/journal.db", runner=runner,
                          wall=HostClock(self.loop, host).wall)
        journal.relaxed_posts = self.server is not None
        self.commits.watch(runner)
        return journal

    async def answered(self) -> None:
        """A call's answer given back to the code that made it. Under ``server_lost`` it waits,
        as the MCP proxy's answer to its client does, for a commit of the call's receipt that
        need not reach the disk (``flush(durable=False)``)."""
        host = HOST.get()
        if self.server is not None and host is not None and host.name in self.sups:
            await self.sups[host.name].journal.flush(durable=False)

    def pause_here(self, what: str, host: Host) -> None:
        """Under ``pause``, now and then: ``host`` pauses at this very step (a VM stopped, a
        long collection) for longer than a call's dispatch deadline, so that what it does
        next comes after that deadline. Never in the final recovery."""
        if (self.reliable or not self.k.call_pause
                or self.rng.random() >= self.k.call_pause):
            return
        length = self.k.deadline * self.rng.uniform(1.0, 1.5)
        self.note(f"pause {host.name} for {length:.2f}s {what}")
        self.loop.pause(host, self.loop.time() + length)

    def unprobed(self) -> list[str]:
        """Calls a process probed while they could still apply and left IN_DOUBT or UNKNOWN,
        though it stayed up, open, not presumed dead and not paused for most of a lease past
        their deadlines: each should have been probed again then (``outcome.probe_again``),
        when its answer is final. Judged without ``probe_again`` itself, which a mutation
        may have edited."""
        out = []
        for action_id, key, state, deadline_at, evidence in self.anchor.execute(
                "SELECT id, idem_key, state, deadline_at, evidence FROM actions "
                "WHERE state IN (?, ?)", ("IN_DOUBT", "UNKNOWN")).fetchall():
            asked = self.asked.get(key)
            if asked is None or deadline_at is None:
                continue  # never probed: its executor's end is for a recovery to find
            host, at, last = asked
            # When the probe whose answer the journal kept was asked, by its prober's clock
            # (a later probe that could not tell either changes nothing on record), and when
            # the last probe of all was, by its own.
            kept = json.loads(evidence) if evidence else {}
            wall = kept.get("asked_at", kept.get("probed_at"))
            if not isinstance(wall, int | float):
                continue
            final = float(deadline_at) + CLOCK_TOLERANCE
            if state == "UNKNOWN" and max(wall, last) >= final:
                continue  # asked when an answer was final: it could not tell, a person decides
            sup = self.sups.get(host.name)
            if not host.alive or sup is None or not sup.is_open or sup.presumed_dead():
                continue  # gone, closed, or its lease lost: whoever recovers it probes
            first = self.first_asked.get((key, host.name), at)
            if first > self.loop.time() - self.policy.probe_timeout - 0.5:
                # Its first probe of the call was asked as the trial's live part ended
                # (after every deadline, by any clock): no time to ask again before the end.
                # One that probed earlier and asks again only now is held to its re-probe.
                continue
            if any(until > at and (until - start >= 0.9 * self.k.lease
                                   or until > self.loop.time() - self.policy.probe_timeout - 0.5)
                   for start, until in host.pauses):
                # Paused since for most of a lease (its lease may have lapsed while its
                # re-probe was due: it judges nothing then), or too lately to have answered.
                continue
            out.append(f"{action_id} ({key}) left {state}: {host.name} probed it at "
                       f"{at:.3f} while it could still apply and stayed up past its deadline "
                       f"{float(deadline_at) - WALL0:.3f}, but never probed it again")
        return out

    def pause_prober(self, key: str) -> None:
        """Under ``pause``, half the time a probe looked before its call's deadline: its host
        pauses until past that deadline and its tolerance, so the answer comes back after
        the deadline while a request still in the network may land in between."""
        host = HOST.get()
        if host is None or self.reliable or not self.k.call_pause:
            return
        found = one(self.anchor.execute("SELECT MAX(deadline_at) FROM actions WHERE "
                                        "idem_key = ?", (key,)))
        if found is None or found[0] is None:
            return
        left = float(found[0]) - WALL0 - self.loop.time()
        if left > 0 and self.rng.random() < 0.5:
            length = left + CLOCK_TOLERANCE + self.rng.uniform(0.05, 0.5)
            self.note(f"pause {host.name} for {length:.2f}s after its probe of {key} looked")
            self.loop.pause(host, self.loop.time() + length)

    def keyring(self, host: Host) -> KeyRing:
        """The deployment's key directory, as ``host`` opens it."""
        signer, _ = keys()
        trusted = TrustedKeys([signer.public])
        trusted.heads = self.heads.memory(lambda: host.alive)
        return KeyRing(signer, trusted)

    # -- processes ------------------------------------------------------------------------
    def start(self, host: Host, main: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            try:
                await main
            except (TetherError, asyncio.CancelledError):
                pass
            except Exception as exc:  # what production raised that its caller never expects
                if not host.alive:  # being closed where it stood (``SimLoop.crash``)
                    raise
                self.errors.append(f"{host.name}: {type(exc).__name__}: {exc}")
        self.loop.start(host, guarded())

    def new_host(self, base: str, group: list[Host]) -> Host:
        host = Host(f"{base}.{self.restarts[base]}", _offset(self.rng, "clock" in self.on))
        group.append(host)
        return host

    def supervisor(self, host: Host, *, lossy: bool = True) -> tether.Supervisor:
        return tether.Supervisor(self.journal(host, lossy=lossy),
                                 clock=HostClock(self.loop, host), keys=self.keyring(host),
                                 policy=self.policy, tools=[self.pay], recover=False,
                                 redispatch=self.redispatch, control_poll=self.k.poll)

    def start_worker(self, base: str) -> None:
        host = self.new_host(base, self.workers)

        async def work() -> None:
            try:
                async with Worker(self.journal(host), [self.root, self.child], lease=self.k.lease,
                                  poll=self.k.poll, concurrency=4,
                                  clock=HostClock(self.loop, host), policy=self.policy,
                                  keys=self.keyring(host), redispatch=self.redispatch) as w:
                    self.sups[host.name] = w.supervisor
                    await w.run()
            except TetherError as exc:  # LeaseLost, or a journal error on its way out
                self.note(f"{host.name} stopped: {type(exc).__name__}: {exc}")
            if host.alive:  # a worker that stopped is started again (its supervisor's job)
                self.restart(base, self.rng.uniform(0.2, 1.0) * self.k.lease)

        self.start(host, work())

    def start_orchestrator(self, base: str, index: int, scripts: list[list[Any]],
                           plans: dict[str, dict[str, Any]], resumed: bool) -> None:
        host = self.new_host(base, self.orchestrators)
        acts = [] if resumed else scripts[index]

        async def orchestrate() -> None:
            async with self.supervisor(host) as sup:
                self.sups[host.name] = sup
                if index == 0 and not resumed:
                    for task, plan in plans.items():
                        await sup.delegate(self.root, plan, task_id=task, remote=True)
                while len(await self.roots(sup)) < len(plans):  # another creates them
                    await sup.wake(self.k.poll)
                for act in acts:
                    await asyncio.sleep(max(0.0, act.at - self.loop.time()))
                    try:
                        await self.act(sup, act.task, act.kind)
                    except TetherError as exc:
                        self.note(f"{act.kind} {act.task}: {type(exc).__name__}: {exc}")
                for task in plans:
                    while True:
                        first = (await self.roots(sup))[task]
                        try:
                            await Handle.detached(sup, first.id).wait()
                        except TetherError as exc:
                            self.note(f"wait for {task}: {type(exc).__name__}: {exc}")
                        if (await self.roots(sup))[task].id == first.id:
                            break
                # Done, and still up: it keeps accounting for what it settled (its re-probes
                # at the calls' deadlines) until the trial stops every process.
                self.done.add(host.name)
                await self.loop.create_future()

        self.start(host, orchestrate())

    async def roots(self, sup: tether.Supervisor) -> dict[str, Any]:
        """Each task's newest epoch's first attempt (its root row). An epoch's attempts are
        numbered on from the task's last (a re-delegation of a task at attempt 2 starts at 2),
        so the first is the newest epoch's lowest attempt."""
        out: dict[str, Any] = {}
        for row in await sup.journal.delegations():
            if row.parent_id is None and (
                    row.task_id not in out
                    or (row.epoch, -row.attempt) > (out[row.task_id].epoch,
                                                    -out[row.task_id].attempt)):
                out[row.task_id] = row
        return out

    async def act(self, sup: tether.Supervisor, task: str, kind: str) -> None:
        first = (await self.roots(sup))[task]
        grace = self.rng.choice((0.2, 1.0, 3.0))
        if kind == "child":
            kids = [r for r in await sup.journal.delegations()
                    if r.parent_id == first.id and not r.state.terminal]
            if kids:
                await Handle.detached(sup, kids[0].id).recall(grace, "sim")
            return
        handle = Handle.detached(sup, first.id)
        if kind == "cancel":
            await handle.cancel("sim")
        elif kind.startswith("recall"):
            report = await handle.recall(grace, "sim")
            if kind == "recall+terminate" and not report.outcome.terminal:
                # Not settled within the grace (calls left running): kill it now.
                await handle.terminate("sim")
        else:
            await handle.terminate("sim")
        row = await sup.journal.latest_attempt(first.id)
        self.stops.append((row.task_id, row.epoch, self.commits.seq))
        self.note(f"{kind} of {task} returned")
        if kind.endswith("+redelegate"):
            await handle.redelegate()

    def start_reconciler(self, times: list[float]) -> None:
        host = self.new_host("rec", self.others)

        async def reconcile() -> None:
            async with self.supervisor(host) as sup:
                self.sups[host.name] = sup
                for at in times:
                    await asyncio.sleep(max(0.0, at - self.loop.time()))
                    try:
                        await sup.recover()
                    except TetherError as exc:
                        self.note(f"reconcile failed: {exc}")

        self.start(host, reconcile())

    def restart(self, base: str, delay: float) -> None:
        self.restarts[base] += 1
        self.start_later(base, delay)

    def start_later(self, base: str, delay: float) -> None:
        """Start a worker (``w...``) or resume an orchestrator (``o...``) after ``delay``; the
        trial does not end while one is still to come."""
        self.pending += 1

        def again() -> None:
            self.pending -= 1
            if self.stopped:  # the trial stopped its processes: none is started any more
                return
            if base.startswith("w"):
                self.start_worker(base)
            else:
                self.start_orchestrator(base, int(base[1:]), [], self.plans, True)

        self.loop.call_later(delay, again, context=contextvars.Context())

    def faults(self) -> None:
        rng, loop = self.rng, self.loop
        if "crash" in self.on:
            for at in sorted(rng.uniform(0.05, 6.0) for _ in range(rng.randint(1, 2))):
                pick = rng.random()

                def crash(pick: float = pick) -> None:
                    hosts = [h for h in (*self.workers, *self.orchestrators, *self.others)
                             if h.alive]
                    if not hosts:
                        return
                    host = hosts[int(pick * len(hosts))]
                    self.note(f"crash {host.name}")
                    loop.crash(host)
                    base = host.name.split(".")[0]
                    if base[0] in "wo":
                        self.restart(base, rng.uniform(0.1, 2.0) * self.k.lease)

                loop.call_at(at, crash, context=contextvars.Context())
        if "pause" in self.on:
            for _ in range(rng.randint(1, 2)):
                at, pick = rng.uniform(0.05, 4.0), rng.random()
                length = self.k.lease * rng.uniform(1.2, 2.5)

                def pause(pick: float = pick, length: float = length) -> None:
                    hosts = [h for h in (*self.workers, *self.orchestrators) if h.alive]
                    if hosts:
                        host = hosts[int(pick * len(hosts))]
                        self.note(f"pause {host.name} for {length:.2f}s")
                        loop.pause(host, loop.time() + length)

                loop.call_at(at, pause, context=contextvars.Context())
        if self.server is not None:
            for at in sorted(rng.uniform(0.05, 6.0) for _ in range(rng.randint(1, 3))):
                self.lose_server(at - loop.time())

    def looked(self) -> None:
        """A process looked at the configuration's heads, as it does when it begins to read
        a chain (and once a sealed batch, inside it: not counted): under ``server_lost``,
        that read's commit may be followed at once by a crash of the server (``landed``), so
        that the read accepted a head whose commit did not wait for the disk, and lost it
        after."""
        host = HOST.get()
        if self.server is None or host is None:
            return
        if any(r.running for r in self._runners.get(host.name, ())):
            return  # a seal's look, once a batch: no read of a chain follows it
        self._reading.add(host.name)

    def lose_server(self, delay: float) -> None:
        """Under ``server_lost``: ``delay`` from now, the journal's server crashes, losing
        what committed without waiting for the disk since the last commit that did (at random
        times, and now and then right after such a commit). Never in the final recovery."""
        self.loop.call_later(max(0.0, delay), self.crash_server, context=contextvars.Context())

    def crash_server(self) -> None:
        if self.server is not None and not self.reliable and self.server.crash():
            self.note("the journal's server lost its commits since the last sync")
            self.stats["server_lost"] += 1


def _plan(spec: Any) -> dict[str, Any]:
    return {"pays": spec.pays, "cut": spec.cut, "reads": spec.reads, "patience": spec.patience,
            "kids": [_plan(k) for k in spec.kids]}


async def _main(t: Trial) -> str | None:
    """The trial: its processes and faults until every orchestrator is done; then every host
    stops, time runs past every deadline and lease, and a recovery runs twice."""
    rng, loop = t.rng, t.loop
    specs = _tasks(rng, "stream_cut" in t.on)
    plans = t.plans = {f"t{i}": _plan(s) for i, s in enumerate(specs)}
    n_orch = rng.randint(2, 3) if "race" in t.on else 1
    scripts = _acts(rng, list(plans), n_orch, "race" in t.on)
    for i in range(rng.randint(1, 2)):
        # Half of the time the tasks wait in the queue before a worker comes up, so that
        # recalls and terminates also meet tasks nobody has claimed yet.
        later = rng.uniform(0.0, 1.5) if rng.random() < 0.5 else 0.0
        t.start_later(f"w{i}", later)
    for i in range(n_orch):
        t.start_orchestrator(f"o{i}", i, scripts, plans, False)
    if t.on & {"probe_early", "crash", "pause"}:
        t.start_reconciler([rng.uniform(0.1, 0.5) * j for j in range(1, 16)]
                           if "probe_early" in t.on
                           else sorted(rng.uniform(0.5, 6.0) for _ in range(2)))
    t.faults()
    if "verify" in t.on:
        start_verifier(t)
    quiesced: str | None = None
    while not (t.pending == 0 and any(t.done) and all(
            h.name in t.done or not h.alive for h in t.orchestrators)):
        if loop.time() > HORIZON:
            quiesced = f"orchestrators still waiting at t={loop.time():.1f}s"
            break
        await asyncio.sleep(0.25)  # the trial's own clock: time to look
    open_calls = [float(r[0]) - WALL0 for r in t.anchor.execute(
        "SELECT deadline_at FROM actions WHERE deadline_at IS NOT NULL AND state IN (?, ?, ?)",
        ("PENDING", "IN_DOUBT", "UNKNOWN"))]
    if quiesced is None and open_calls:
        # Every process stays up until each call still open can no longer apply, and its
        # re-probe then (at the deadline plus the tolerance, by a clock up to CLOCK_BOUND
        # off) has answered.
        # A host paused then does it once it resumes, and so does one paused while this
        # waits (a probe's answer committing can pause its host): the end is reckoned again
        # until no pause moves it.
        while True:
            resumed = [until for h in (*t.workers, *t.orchestrators, *t.others) if h.alive
                       for _, until in h.pauses]
            end = max([max(open_calls) + CLOCK_TOLERANCE + CLOCK_BOUND, *resumed]) \
                + t.policy.probe_timeout + 0.5
            if loop.time() >= end:
                break
            if loop.time() >= 2 * HORIZON:  # pauses that never let the re-probes end
                quiesced = f"re-probes still awaited at t={loop.time():.1f}s"
                break
            await asyncio.sleep(min(end, 2 * HORIZON) - loop.time())
        if quiesced is None:
            t.neglected = t.unprobed()
    t.stopped = True
    for host in (*t.workers, *t.orchestrators, *t.others, *t.operators):
        if host.alive:
            loop.crash(host)
    if "verify" in t.on:
        await verify_now(t, "verify-quiet")  # every process killed, none recovered yet
    deadlines = [float(r[0]) - WALL0 for r in t.anchor.execute(
        "SELECT deadline_at FROM actions WHERE deadline_at IS NOT NULL")]
    end = max([loop.time(), t.provider.last_arrival, *deadlines]) \
        + t.policy.lease + t.policy.clock_tolerance + 1.0
    await asyncio.sleep(end - loop.time())
    t.reliable = True
    final = Host("final")
    recovered: asyncio.Future[None] = loop.create_future()

    async def twice() -> None:
        try:
            async with t.supervisor(final, lossy=False) as sup:
                await sup.recover()
                await sup.recover()
        except Exception as exc:
            t.errors.append(f"the final recovery failed: {type(exc).__name__}: {exc}")
        recovered.set_result(None)

    loop.start(final, twice())
    await recovered
    if "verify" in t.on:
        await verify_now(t, "verify-final")
    return quiesced


def run_trial(seed: int, selected: tuple[str, ...] = FAULTS, *,
              trace: bool = False) -> TrialResult:
    """Run one trial from its seed and judge it; ``digest`` hashes its step trace."""
    active = active_faults(seed, selected)
    t = Trial(seed, active)
    quiesced: str | None
    with id_source(t._id_bytes), t.loop.no_threads():
        try:
            quiesced = t.loop.run_until_complete(_main(t))
        except StepBudget as exc:
            quiesced = f"step budget spent ({exc})"
        finally:
            with contextlib.suppress(Exception):
                t.loop.close()
    events = t.anchor.execute(
        "SELECT detail FROM events WHERE kind = 'supervisor_error' ORDER BY id").fetchall()
    errors = [*t.errors, *(f"supervisor_error: {d}" for (d,) in events),
              *(f"an exception nobody retrieved: {e}" for e in t.loop.errors),
              *(f"production code reached for {r}" for r in t.loop.refused)]
    found = judge(t.commits.view(), t.provider, t.stops, errors, quiesced, t.broken,
                  t.neglected, [*t.verified, *chains_named(t.anchor)])
    t.stats.update(applied=len(t.provider.ledger), restarts=sum(t.restarts.values()),
                   commits=t.commits.seq, actions=len(t.commits.intents))
    with contextlib.suppress(sqlite3.Error):
        t.anchor.close()
    lines = t.lines or []
    result = TrialResult(seed, active, [Violation(seed, active, c, d) for c, d in found],
                         t.loop.steps, t.loop.time(), lines if trace else None, t.stats)
    result.digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return result


__all__ = ["Trial", "run_trial"]
