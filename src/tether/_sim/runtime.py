"""The simulated supervisor: control, drains, accounting, probes and recovery.

Each method mirrors its counterpart in ``tether._runtime`` (``Supervisor._control``,
``_drain``, ``_grace_window``, ``_account``, ``_recover_one``, ``recover``;
``reconcile.probe_all``; ``remote.settle_elsewhere``) step for step, as generators: every
decision is the core's (``_core.drain``, ``evaluate_recall``, ``judge_probe``, ``settle``,
``owner_alive``), and every journal write is one atomic step of the simulated journal.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tether._core import drain, outcome, verdict
from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt
from tether._core.errors import ControlSignal, Recalled, Terminated, TetherError
from tether._core.model import ActionState, ControlKind, DelegationState, Policy, ProbeOutcome
from tether._core.redispatch import RedispatchPolicy
from tether._core.signing import Signed, SigningKey, TrustedKeys
from tether._sim.journal import ARow, DRow, FenceRefused, Journal
from tether._sim.sched import Future, Host, Proc, Sched, Step
from tether._sim.world import Knobs, Provider

T = TypeVar("T")
_A = ActionState
_S = DelegationState
RTT = 0.002  # one journal round trip


class CommitLost(Exception):
    """The journal's reply to a write was lost: it committed or not, the caller must read."""


@dataclass(frozen=True, slots=True)
class Spec:
    """What an agent does: a root starts ``kids`` children (or pays itself when it has none);
    a child makes ``pays`` payments. ``cut``: where attempt 1's model stream is cut (-1 before
    any tool, j before payment j, ``pays`` after the last), or None."""

    kind: str
    pays: int
    kids: tuple[Spec, ...] = ()
    cut: int | None = None
    reads: bool = False


@dataclass(eq=False, slots=True)
class TaskRun:
    task_id: str
    current: Node
    attempts: list[Node]
    done: Future = field(default_factory=Future)
    cut_short: Future = field(default_factory=Future)


@dataclass(eq=False, slots=True)
class Node:
    """A running delegation as its supervisor holds it (``gateway.ChildRuntime``)."""

    row: DRow  # immutable fields only (id, task, epoch, attempt, parent): state is the journal's
    spec: Spec
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    task: Proc | None = None
    inflight: dict[str, Proc] = field(default_factory=dict)
    stop: ControlSignal | None = None
    ordinals: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    effects: int = 0
    draining: Proc | None = None
    run: TaskRun | None = None
    generation: int = 0

    @property
    def id(self) -> str:
        return self.row.id

    def walk(self) -> list[Node]:
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out


class Env:
    """One trial's shared world."""

    def __init__(self, sched: Sched, journal: Journal, provider: Provider, knobs: Knobs,
                 signer: SigningKey, trusted: TrustedKeys, policy: Policy,
                 redispatch: RedispatchPolicy) -> None:
        self.sched = sched
        self.rng: random.Random = sched.rng
        self.journal = journal
        self.provider = provider
        self.knobs = knobs
        self.signer = signer
        self.trusted = trusted
        self.policy = policy
        self.redispatch = redispatch
        self.hosts: dict[str, Host] = {}  # by owner id
        self.workers: list[Host] = []
        self.orchestrators: list[Host] = []
        self._ids = 0
        self.stops: list[tuple[str, int, int]] = []  # (task, epoch, commit) a stop returned at
        self.reading_back = 0

    def new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    def deliver(self) -> None:
        """Hand the journal's notifications to the hosts concerned (or lose them)."""
        notes = self.journal.notes
        if not notes:
            return
        self.journal.notes = []
        loss = self.knobs.notify_loss
        for channel, payload in notes:
            if channel == "owner":
                hosts = [self.hosts[payload]] if payload in self.hosts else []
            elif channel == "queued":
                hosts = self.workers
            else:
                hosts = self.orchestrators
            for host in hosts:
                if host.alive and not (loss and self.rng.random() < loss):
                    host.notify.fire(self.sched)


def natural(state: DelegationState) -> DelegationState:
    return outcome.natural_end(state, _S.TERMINATED)


@dataclass(frozen=True, slots=True)
class Answer:
    outcome: ProbeOutcome
    voided: bool = False
    why: str = ""


class Supervisor:
    def __init__(self, env: Env, host: Host, owner_id: str, *, lossy: bool = True,
                 reliable_probes: bool = False) -> None:
        self.env = env
        self.sched = env.sched
        self.journal = env.journal
        self.host = host
        self.owner_id = owner_id
        self.lossy = lossy
        self.reliable_probes = reliable_probes
        self.policy = env.policy
        self.runtimes: dict[str, Node] = {}
        self.calls: dict[str, Proc] = {}
        self.rechecks: set[str] = set()
        self.abandoned = False
        env.hosts[owner_id] = host

    # -- clocks and the journal ------------------------------------------------------------
    def wall(self) -> float:
        return self.host.clock.wall(self.sched.now)

    def mono(self) -> float:
        return self.sched.now

    def write(self, op: Callable[..., T], *args: Any) -> T:
        """A journal write whose reply may be lost (``commit_lost``): committed or not."""
        env = self.env
        loss = env.knobs.commit_loss if self.lossy else 0.0
        if loss and env.rng.random() < loss:
            if env.rng.random() < 0.5:
                with contextlib.suppress(TetherError, FenceRefused):
                    op(*args)
                env.deliver()
                self.sched.note(f"commit reply lost ({op.__name__}, committed)")
            else:
                self.sched.note(f"commit reply lost ({op.__name__}, not committed)")
            env.reading_back += 1
            raise CommitLost(op.__name__)
        try:
            return op(*args)
        finally:
            env.deliver()

    def spawn(self, name: str, gen: Step, daemon: bool = True) -> Proc:
        return self.sched.spawn(self.host, name, gen, daemon=daemon)

    def alive(self, owner_id: str) -> bool:
        """``remote.judge_alive``: a lease judged on the journal server's clock."""
        if owner_id == self.owner_id:
            return True
        return outcome.owner_alive(self.journal.owner_facts(owner_id), now=self.wall(),
                                   server_now=self.sched.now,
                                   heartbeat_lease=self.policy.lease)

    # -- control ---------------------------------------------------------------------------
    def control(self, delegation_id: str, kind: ControlKind, grace: float | None,
                reason: str) -> Step:
        """``Supervisor._control`` for a delegation run elsewhere (or here). Returns the
        accepted intent's Signed; raises ControlRefused like the journal does."""
        while True:
            issued = self.wall()
            offered = self.journal.get(delegation_id).control_seq + 1
            yield RTT  # the read and the write are two round trips: racing callers interleave
            made: list[Signed] = []

            def sign(row: DRow, offered: int = offered, issued: float = issued,
                     made: list[Signed] = made) -> Signed:
                signed = self.env.signer.sign(ControlIntent(
                    kind=kind, delegation_id=row.id, epoch=row.epoch, seq=offered, grace=grace,
                    reason=reason, issued_at=issued))
                made.append(signed)
                return signed

            try:
                _, signed = self.write(self.journal.sign_and_accept, delegation_id, sign,
                                       self.owner_id, issued)
                break
            except CommitLost:
                yield RTT  # read back: is our intent there? If not, send it again
                mine = [c for c in self.journal.controls.get(delegation_id, ())
                        if made and c.signed == made[0]]
                if mine:
                    signed = mine[0].signed
                    break
        self.sched.note(f"{kind.value} {delegation_id} seq {offered} accepted")
        rt = self.runtimes.get(delegation_id)
        if rt is None:
            yield from self.settle_elsewhere(delegation_id, signed)
        elif kind is ControlKind.TERMINATE and rt.draining is not None:
            self.cut(rt)
            yield rt.draining.done
        else:
            yield self.start_drain(rt, signed, self.mono()).done
        return signed

    def settle_elsewhere(self, delegation_id: str, signed: Signed) -> Step:
        intent = self.env.trusted.verify(signed, ControlIntent)
        yield RTT
        while True:
            try:
                took = self.write(self.journal.unclaim, delegation_id, self.owner_id)
                break
            except CommitLost:
                yield RTT  # read back; not there: send it again
                row = self.journal.get(delegation_id)
                if row.claimed_by == self.owner_id and row.done:
                    took = True
                    break
        if took:
            final = _S.RECALLED if intent.kind is ControlKind.RECALL else _S.TERMINATED
            self.journal.settle_subtree(delegation_id, final, self.wall())
            self.sched.note(f"{delegation_id} never started: settled here")
            return
        row = self.journal.get(delegation_id)
        if not self.alive(row.owner_id):
            yield from self.recover_one(row, "owner is gone")
            return
        budget = (intent.grace or 0.0) + self.policy.ack_timeout + self.policy.probe_timeout
        deadline = self.mono() + budget
        while self.mono() < deadline:
            row = self.journal.get(delegation_id)
            if row.state.terminal:
                return
            if not self.alive(row.owner_id):
                yield from self.recover_one(row, "owner is gone")
                return
            yield (self.host.notify, self.env.knobs.poll)
        yield from self.recover_one(self.journal.get(delegation_id),
                                    "owner did not settle in time")

    def recover_one(self, row: DRow, reason: str) -> Step:
        """A terminate intent if it still runs (read now, as the runtime's row was), then
        every pending call in doubt, probed and settled."""
        state, seq = row.state, row.control_seq
        yield RTT
        if state is _S.RUNNING:
            signed = self.env.signer.sign(ControlIntent(
                ControlKind.TERMINATE, row.id, row.epoch, seq + 1, None,
                f"recovery: {reason}", self.wall(), recovery=True))
            intent = self.env.trusted.verify(signed, ControlIntent)
            self.journal.accept_control(signed, intent, self.owner_id, self.wall())
            self.env.deliver()
            self.sched.note(f"recovery terminated {row.id}: {reason}")
        self.journal.mark_in_doubt(row.id)
        yield from self.account(row.id, _S.TERMINATED)

    def adopt(self, rt: Node, accepted_at: float, signed: Signed) -> None:
        if rt.draining is None:
            elapsed = max(0.0, self.wall() - accepted_at)
            self.start_drain(rt, signed, self.mono() - elapsed)

    def adopt_latest(self, rt: Node) -> None:
        cs = self.journal.controls.get(rt.id)
        if cs:
            self.adopt(rt, cs[-1].accepted_at, cs[-1].signed)

    def start_drain(self, rt: Node, signed: Signed, accepted_at: float) -> Proc:
        rt.draining = self.spawn(f"drain:{rt.id}", self.drain(rt, signed, accepted_at))
        return rt.draining

    def cut(self, rt: Node, *, actions: bool = True) -> None:
        for node in rt.walk():
            node.stop = Terminated(node.id, "terminated")
            procs = [*node.inflight.values(), node.task] if actions else [node.task]
            for proc in procs:
                if proc is not None:
                    self.sched.cancel(proc)

    # -- the drain (Supervisor._drain) -----------------------------------------------------
    def drain(self, rt: Node, signed: Signed, accepted_at: float) -> Step:
        intent = self.env.trusted.verify(signed, ControlIntent)
        stop, cut_now = drain.start(intent.kind)
        for node in rt.walk():
            node.stop = node.stop or (Recalled if stop is drain.Stop.RECALLED
                                      else Terminated)(node.id, intent.reason)
        decided = verdict.Verdict.TERMINATE
        if not cut_now:
            decided = yield from self.grace_window(rt, signed, intent, accepted_at)
        killed = cut_now or any(isinstance(n.stop, Terminated) for n in rt.walk())
        plan = drain.ending(decided, killed=killed)
        if plan.terminate:
            self.cut(rt, actions=plan.cut_calls)
        tasks = [n.task for n in rt.walk() if n.task is not None and n.task.alive]
        for proc in tasks:
            self.sched.cancel(proc)
        end = self.mono() + self.policy.ack_timeout
        for proc in tasks:
            if not proc.done.done and self.mono() < end:
                yield (proc.done, end - self.mono())
        if plan.mark_in_doubt:
            self.journal.mark_in_doubt(rt.id)
        yield from self.account(rt.id, plan.fallback)
        self.sched.note(f"drain of {rt.id}: {decided.value}")

    def grace_window(self, rt: Node, signed: Signed, intent: ControlIntent,
                     accepted_at: float) -> Step:
        env = self.env
        nodes = rt.walk()
        ack = env.signer.sign(Acknowledgement(rt.id, intent.seq, tuple(
            a for n in nodes for a in n.inflight), acked_at=self.wall()))
        self.journal.record_ack(ack)
        receipt = None
        if sum(n.effects for n in nodes) == 0:
            receipt = env.signer.sign(NoEffectsReceipt(rt.id, intent.seq, self.wall()))
            self.journal.record_receipt(receipt)
        while True:
            running = [p for n in rt.walk() for p in n.inflight.values() if p.alive]
            facts = self.journal.facts(rt.id)
            decision = verdict.evaluate_recall(verdict.RecallInput(
                signed, facts, accepted_at, self.mono(), self.policy, env.trusted, ack,
                receipt))
            step = drain.grace_step(decision, live=len(running), terminated=any(
                isinstance(n.stop, Terminated) for n in nodes))
            if step.wait is None:
                return step.verdict
            if running:
                yield ([p.done for p in running], step.wait)
            else:
                yield step.wait

    # -- accounting (Supervisor._account, reconcile.probe_all) -----------------------------
    def account(self, root_id: str, fallback: DelegationState) -> Step:
        doubtful = self.journal.unsettled(root_id)
        if doubtful:
            yield from self.probe_all(doubtful)
        self.journal.settle_subtree(root_id, fallback, self.wall())
        self.recheck_later(root_id, fallback)

    def recheck_later(self, root_id: str, fallback: DelegationState) -> None:
        open_calls = [a for a in self.journal.unsettled(root_id) if self.probe_again(a)]
        at = drain.recheck_at((a.deadline_at for a in open_calls), self.wall(),
                              self.policy.clock_tolerance)
        if at is not None and root_id not in self.rechecks and self.host.alive:
            self.rechecks.add(root_id)
            self.spawn(f"recheck:{root_id}", self._recheck(root_id, fallback, at))

    def probe_again(self, action: ARow) -> bool:
        """``Accounting._probe_again``: the simulated payment tool always has a probe."""
        return outcome.probe_again(action.state, deadline_at=action.deadline_at,
                                   asked_at=action.asked_at,
                                   tolerance=self.policy.clock_tolerance, can_probe=True)

    def _recheck(self, root_id: str, fallback: DelegationState, at: float) -> Step:
        yield max(0.0, at - self.wall())
        self.rechecks.discard(root_id)
        yield from self.account(root_id, fallback)

    def probe_all(self, actions: list[ARow]) -> Step:
        for action in actions:
            asked = self.wall()
            answer = yield from self.probe_one(action)
            now = self.wall()  # as reconcile.probe_all: the time the answer is judged
            if "probe_time" in self.journal.fixes:
                now = asked  # what the provider's answer can speak for
            state = outcome.judge_probe(answer.outcome, voided=answer.voided,
                                        deadline_at=action.deadline_at, now=now,
                                        tolerance=self.policy.clock_tolerance)
            self.sched.note(f"probe {action.id} ({action.key}): {answer.outcome.value}"
                            f"{' voided' if answer.voided else ''} {answer.why} -> {state.value}")
            if action.state in (_A.IN_DOUBT, _A.UNKNOWN):
                self.journal.finish_action(action.id, state, now, probed=True, asked_at=asked)

    def probe_one(self, action: ARow) -> Step:
        """Never guesses: a probe that raises or outlasts the probe timeout is UNKNOWN."""
        knobs, rng = self.env.knobs, self.env.rng
        limit = self.policy.probe_timeout
        if not self.reliable_probes:
            r = rng.random()
            if r < knobs.probe_raise:
                yield RTT
                return Answer(ProbeOutcome.UNKNOWN, why="(probe raised)")
            if r < knobs.probe_raise + knobs.probe_hang:
                yield limit
                return Answer(ProbeOutcome.UNKNOWN, why="(probe timed out)")
        latency = rng.uniform(0.0, knobs.probe_latency)
        if self.reliable_probes:  # the operator's reconcile: a provider that answers in time
            latency = min(latency, limit / 2)
        yield min(latency / 2, limit)
        if latency / 2 >= limit:
            return Answer(ProbeOutcome.UNKNOWN, why="(probe timed out)")
        applied, voided = self.env.provider.lookup(action.key, knobs.void)
        yield min(latency / 2, limit - latency / 2)
        if latency >= limit:
            return Answer(ProbeOutcome.UNKNOWN, why="(probe timed out)")
        if applied:
            return Answer(ProbeOutcome.COMPLETED)
        return Answer(ProbeOutcome.NOT_APPLIED, voided=voided)

    # -- recovery (Supervisor.recover) -----------------------------------------------------
    def settle_unclaimed(self, row: DRow) -> None:
        """The ``queued_fenced`` fix: fenced, so no worker will ever claim it, and its issuer
        is gone before it took it off the queue: settle it as the issuer would have."""
        if self.journal.unclaim(row.id, self.owner_id):
            self.journal.settle_subtree(row.id, natural(row.state), self.wall())
            self.env.deliver()
            self.sched.note(f"{row.id} fenced in the queue, its issuer gone: settled here")

    def recover(self) -> Step:
        live = self.journal.live()
        ids = {r.id for r in live}
        for row in live:
            if row.id in self.runtimes or row.parent_id in ids:
                continue
            if not self.alive(row.owner_id):
                if row.queued and row.claimed_by is None:
                    if not (row.fenced and "queued_fenced" in self.journal.fixes):
                        continue  # queued: it waits for a worker
                    self.settle_unclaimed(row)
                    continue
                if row.state.terminal:
                    continue  # settled meanwhile (the runtime would refuse, then read again)
                yield from self.recover_one(row, f"owner {row.owner_id} is gone")
        doubtful = [a for a in self.journal.unsettled(None)
                    if a.delegation_id not in self.runtimes and a.id not in self.calls]
        if doubtful:
            yield from self.probe_all(doubtful)
            roots: dict[str, None] = dict.fromkeys(a.delegation_id for a in doubtful)
            for root in roots:
                state = self.journal.get(root).state
                self.journal.settle_subtree(root, state, self.wall())
                self.recheck_later(root, state)


__all__ = ["RTT", "Answer", "CommitLost", "Env", "Node", "Spec", "Supervisor", "TaskRun"]
