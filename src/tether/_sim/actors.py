"""The simulated processes: workers (``tether worker``), orchestrators holding handles on
queued tasks (``Handle.recall/terminate/cancel/redelegate/wait``) and reconcilers
(``tether reconcile``), each a host whose processes can crash, restart and pause."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from tether._core.errors import AlreadyFinished, InvalidTransition, TetherError
from tether._core.model import ControlKind, DelegationState
from tether._sim.gateway import launch
from tether._sim.journal import DRow
from tether._sim.runtime import RTT, CommitLost, Env, Node, Spec, Supervisor
from tether._sim.sched import Clock, Host, Step
from tether._sim.world import CLOCK_BOUND

_S = DelegationState
CONCURRENCY = 4


def make_clock(env: Env, skewed: bool) -> Clock:
    if not skewed:
        return Clock()
    rng, b = env.rng, CLOCK_BOUND
    clock = Clock(rng.uniform(-b, b), rng.uniform(-0.01, 0.01), b)
    t = 0.0
    for _ in range(rng.randint(0, 2)):
        t += rng.uniform(0.2, 4.0)
        clock.jumps.append((t, rng.uniform(-b, b)))
    return clock


# -- workers -----------------------------------------------------------------------------

class Worker:
    """Claims queued delegations under a lease, renews it every third of the lease, adopts
    control intents (notified or polled), runs each claimed root as a local child."""

    def __init__(self, env: Env, name: str, specs: dict[str, Spec], skewed: bool,
                 on_exit: Callable[[Worker], None]) -> None:
        self.env = env
        self.specs = specs
        self.host = Host(name, make_clock(env, skewed))
        self.sup = Supervisor(env, self.host, env.new_id("w"))
        self.running: dict[str, Node] = {}
        self.on_exit = on_exit
        env.workers.append(self.host)
        lease = env.knobs.lease
        env.journal.register_owner(self.sup.owner_id, self.sup.wall(), lease)
        self.sup.spawn("claim", self.claim())
        self.sup.spawn("lease", self.keep_lease())
        self.sup.spawn("watch", self.watch())

    def claim(self) -> Step:
        sup, journal = self.sup, self.env.journal
        while True:
            free = CONCURRENCY - len(self.running)
            rows = journal.claim(sup.owner_id, sup.wall(), free) if free > 0 else []
            for row in rows:
                sup.sched.note(f"claimed {row.id}")
                sup.spawn(f"run:{row.id}", self.run_one(row))
            if not rows:
                yield (self.host.notify, self.env.knobs.poll)
            else:
                yield RTT

    def run_one(self, row: DRow) -> Step:
        sup = self.sup
        node = Node(row, self.specs[row.task_id])
        self.running[row.id] = node
        run = yield from launch(sup, node)
        yield (run.done, 1e9)
        if run.current.draining is not None:
            yield (run.current.draining.done, 1e9)
        self.running.pop(row.id, None)
        if not sup.abandoned:
            yield RTT
            self.env.journal.queue_done(row.id)
            self.env.deliver()

    def keep_lease(self) -> Step:
        sup, journal, lease = self.sup, self.env.journal, self.env.knobs.lease
        while True:
            yield lease / 3
            try:
                ok = sup.write(journal.renew_lease, sup.owner_id, sup.wall(), lease)
            except CommitLost:
                yield RTT
                held = journal.owners[sup.owner_id].lease_until
                ok = held is not None and held > sup.wall()
            if not ok:
                sup.sched.note("lease lost: abandoning")
                yield from self.abandon()
                return

    def abandon(self) -> Step:
        """``Supervisor.abandon`` then leaving: the children's code stops, writing nothing;
        calls already sent get a bounded while to post their receipts, then the rest are
        declared in doubt; the process exits (and is restarted)."""
        sup = self.sup
        sup.abandoned = True
        for rt in list(sup.runtimes.values()):
            if rt.parent is None:
                sup.cut(rt, actions=False)
        end = sup.mono() + sup.policy.ack_timeout + sup.policy.probe_timeout
        for proc in list(sup.calls.values()):
            if proc.alive and sup.mono() < end:
                yield (proc.done, end - sup.mono())
        for action_id, proc in list(sup.calls.items()):
            if proc.alive:
                self.env.journal.action_in_doubt(action_id)
        self.exit()

    def exit(self) -> None:
        self.env.sched.kill(self.host)
        self.on_exit(self)

    def watch(self) -> Step:
        sup, journal, knobs = self.sup, self.env.journal, self.env.knobs
        beat = 0.0
        while True:
            yield (self.host.notify, knobs.poll)
            for c in journal.controls_for_owner(sup.owner_id):
                rt = sup.runtimes.get(c.delegation_id)
                if rt is not None and c.issuer != sup.owner_id:
                    sup.adopt(rt, c.accepted_at, c.signed)
            if sup.mono() - beat > knobs.lease / 3:
                beat = sup.mono()
                journal.heartbeat(sup.owner_id, sup.wall())


# -- orchestrators -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Act:
    at: float
    task: str
    kind: str  # recall, terminate, cancel, recall+redelegate, terminate+redelegate, child


class Orchestrator:
    """Creates the tasks (the first one), acts on them by script, waits for every task."""

    def __init__(self, env: Env, name: str, tasks: list[str], acts: list[Act], *,
                 creator: bool, skewed: bool) -> None:
        self.env = env
        self.tasks = tasks
        self.host = Host(name, make_clock(env, skewed))
        self.sup = Supervisor(env, self.host, env.new_id("o"))
        self.done = False
        env.orchestrators.append(self.host)
        env.journal.register_owner(self.sup.owner_id, self.sup.wall(), None)
        self.sup.spawn("main", self.main(creator, acts))
        self.sup.spawn("beat", self.beat())

    def beat(self) -> Step:
        while True:
            yield self.env.policy.lease / 3
            self.env.journal.heartbeat(self.sup.owner_id, self.sup.wall())

    def main(self, creator: bool, acts: list[Act]) -> Step:
        sup, journal = self.sup, self.env.journal
        if creator:
            for task in self.tasks:
                if journal.latest_root(task) is None:
                    yield from self.create(task)
        while any(journal.latest_root(t) is None for t in self.tasks):
            yield (self.host.notify, self.env.knobs.poll)
        for act in acts:
            yield max(0.0, act.at - sup.mono())
            try:
                yield from self.act(act)
            except (TetherError, CommitLost) as exc:
                sup.sched.note(f"{act.kind} {act.task}: {type(exc).__name__}: {exc}")
        for task in self.tasks:
            yield from self.wait_task(task)
        self.done = True

    def create(self, task: str, from_epoch: int | None = None) -> Step:
        sup, journal = self.sup, self.env.journal
        did = self.env.new_id("d")
        while True:
            yield RTT
            try:
                sup.write(journal.create_root, did, task, "root", sup.owner_id, sup.wall(),
                          from_epoch)
                break
            except CommitLost:
                yield RTT
                if did in journal.rows:
                    break
        sup.sched.note(f"delegated {task} as {did}" + (
            "" if from_epoch is None else f" (epoch {from_epoch + 1})"))

    def act(self, act: Act) -> Step:
        journal = self.env.journal
        first = journal.latest_root(act.task)
        assert first is not None
        grace = self.env.rng.choice((0.2, 1.0, 3.0))
        if act.kind == "child":
            kids = [journal.rows[c] for c in first.children]
            live = [k for k in kids if not k.state.terminal]
            if live:
                yield from self.stop(live[0], ControlKind.RECALL, grace)
            return
        if act.kind == "cancel":
            yield RTT
            journal.bump_cancel(act.task)
        kind = ControlKind.RECALL if act.kind.startswith("recall") else ControlKind.TERMINATE
        target = yield from self.stop(first, kind, grace)
        if act.kind.endswith("+redelegate"):
            yield RTT
            row = journal.get(target.id)
            if not (row.state.terminal or row.fenced):
                raise InvalidTransition(row.id, row.state.value, "re-delegated")
            yield from self.create(act.task, row.epoch)

    def stop(self, first: DRow, kind: ControlKind, grace: float) -> Step:
        """``Handle._stop``: the newest attempt; if it already finished, stop a re-dispatch
        through the cancel generation, and the attempt that may have been forked."""
        sup, journal = self.sup, self.env.journal
        target = journal.latest_attempt(first.id)
        try:
            yield from sup.control(target.id, kind, grace if kind is ControlKind.RECALL
                                   else None, "sim")
        except AlreadyFinished:
            yield RTT
            journal.bump_cancel(target.task_id)
            latest = journal.latest_attempt(target.id)
            if latest is not target and not latest.state.terminal:
                with contextlib.suppress(AlreadyFinished):
                    yield from sup.control(latest.id, kind, grace if kind is ControlKind.RECALL
                                           else None, "sim")
        self.env.stops.append((target.task_id, target.epoch, journal.seq))
        sup.sched.note(f"{kind.value} of {target.id} returned")
        return target

    def wait_task(self, task: str) -> Step:
        journal = self.env.journal
        while True:
            first = journal.latest_root(task)
            assert first is not None
            yield from self.wait_queued(first)
            if journal.latest_root(task) is first:
                return

    def wait_queued(self, first: DRow) -> Step:
        """``remote.wait_queued``: until the task's newest attempt ended and its worker said
        so; a claimant presumed dead (lease run out) is reconciled here."""
        sup, journal = self.sup, self.env.journal
        while True:
            latest = journal.latest_attempt(first.id)
            claimant = first.claimed_by
            dead = claimant is not None and not sup.alive(claimant)
            if claimant is None and first.fenced and "queued_fenced" in journal.fixes:
                sup.settle_unclaimed(first)  # nobody will claim it: its issuer may be gone
            if dead and not latest.state.terminal:
                try:
                    yield from sup.recover_one(latest, f"worker {claimant} lost its lease")
                except TetherError as exc:
                    sup.sched.note(f"recovery of {latest.id} refused: {exc}")
                latest = journal.latest_attempt(first.id)
            if latest.state.terminal and (first.done or dead):
                if dead:
                    journal.queue_done(first.id)
                return
            yield (self.host.notify, self.env.knobs.poll)


# -- reconcilers -------------------------------------------------------------------------

def reconciler(env: Env, name: str, times: list[float], skewed: bool, *,
               reliable: bool = False) -> Host:
    """``tether reconcile`` run at the given times (a cron job, an operator)."""
    host = Host(name, make_clock(env, skewed))
    sup = Supervisor(env, host, env.new_id("r"), lossy=not reliable, reliable_probes=reliable)
    env.journal.register_owner(sup.owner_id, sup.wall(), None)

    def run() -> Step:
        for at in times:
            yield max(0.0, at - env.sched.now)
            try:
                yield from sup.recover()
            except (TetherError, CommitLost) as exc:
                env.sched.note(f"reconcile failed: {exc}")

    sup.spawn("reconcile", run())
    return host


__all__ = ["Act", "Orchestrator", "Worker", "make_clock", "reconciler"]
