"""A worker process: claims queued delegations and runs them under its own supervisor.

``tether worker --journal URL --agents module:attribute`` runs one. It holds a lease in the
journal, renewed every tenth of the lease; while the lease holds it claims delegations of the
agents it knows and runs each exactly as a local child (the same gateway, grace windows,
drains and re-dispatch). Control intents reach it through the journal (LISTEN/NOTIFY on
PostgreSQL, polling everywhere). If it cannot renew its lease in time it stops at once: the
journal already refuses its actions, and whoever reconciles its delegations owns them now.

A lost connection to the journal (a database restart or failover) is ridden through: the
journal reconnects for up to one lease, the renewal is tried again until the lease the worker
knows it holds runs out, and one that gets through before then keeps every claim. One that
does not (the database stayed away, or paused, for longer) gives them up: the worker stops
its children at once, writes nothing and exits (LeaseLost). A lease is judged on the
database server's clock, by the renewal as by everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from tether._core.documents import WorkOrder
from tether._core.errors import (
    AlreadyFinished,
    ClockSkew,
    ControlRefused,
    JournalError,
    LeaseLost,
    Tampered,
    UserError,
    WorkRefused,
)
from tether._core.model import ControlKind, Policy, check_positive, code_ended
from tether._core.redispatch import RedispatchPolicy
from tether._core.trust import check_work
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow
from tether._journal.runner import BACKOFF_FIRST
from tether._runtime.bells import Bell
from tether._runtime.clock import Clock
from tether._runtime.clockcheck import check_clock, is_virtual
from tether._runtime.handle import Handle
from tether._runtime.keys import KeyRing
from tether._runtime.logs import logger
from tether._runtime.state import ChildRuntime
from tether._runtime.supervisor import Supervisor
from tether._runtime.telemetry import Hooks
from tether._runtime.tools import Agent, check_surface

log = logger("worker")
RENEWALS = 10  # renewals per lease


def agents_by_name(found: object, where: str) -> dict[str, Agent]:
    """An Agent, an iterable of them, or a mapping of them, by name."""
    items: Iterable[object]
    if isinstance(found, Agent):
        items = [found]
    elif isinstance(found, Mapping):
        items = list(found.values())
    elif isinstance(found, Iterable) and not isinstance(found, str | bytes):
        items = list(found)
    else:
        raise UserError(f"{where} is not an agent or a collection of agents")
    agents: dict[str, Agent] = {}
    for item in items:
        if not isinstance(item, Agent):
            raise UserError(f"{where}: {item!r} is not a tether agent (use @tether.agent)")
        if agents.setdefault(item.name, item) is not item:
            raise UserError(f"{where}: two different agents are named {item.name!r}")
    if not agents:
        raise UserError(f"{where} holds no agent")
    return agents


def load_agents(spec: str) -> dict[str, Agent]:
    """``package.module:attribute``, imported the way the orchestrator imports it: the worker
    and the orchestrator must run the same agent and tool definitions (probes included)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UserError(f"--agents {spec!r} must be module:attribute, e.g. myapp.agents:ALL")
    if "" not in sys.path:  # like `python -m`: the working directory is importable
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import {module_name!r} for --agents: {exc}") from None
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise UserError(f"{module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    return agents_by_name(found, spec)


class Worker:
    """``async with Worker(url, agents) as w: await w.run()``; ``w.stop()`` ends it gently."""

    def __init__(self, journal: str | Journal, agents: object, *, concurrency: int = 16,
                 lease: float = 10.0, poll: float = 0.1, stop_timeout: float = 30.0,
                 clock: Clock | None = None,
                 policy: Policy | None = None, keys: KeyRing | None = None,
                 redispatch: RedispatchPolicy | None = None,
                 hooks: Hooks | None = None) -> None:
        self.agents = agents_by_name(agents, "Worker(agents=...)")
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise UserError("concurrency must be a positive integer")
        self.lease = check_positive(lease, "lease")
        self.poll = check_positive(poll, "poll")
        self.stop_timeout = check_positive(stop_timeout, "stop_timeout")
        self.concurrency = concurrency
        self.supervisor = Supervisor(journal, clock=clock, policy=policy, keys=keys,
                                     recover=False, redispatch=redispatch, hooks=hooks,
                                     control_poll=min(poll, self.lease / 6))
        # No operation waits for the journal longer than the lease that vouches for it.
        journal_ = self.supervisor.journal
        journal_.reconnect_within = min(journal_.reconnect_within, self.lease)
        self._lease_ends = 0.0  # loop time by which the lease last renewed surely ends
        self._running: dict[str, asyncio.Task[None]] = {}
        self._bell: Bell | None = None  # the claim loop's wake-up (``_serve``)
        self._loop: asyncio.AbstractEventLoop | None = None  # ``run``'s
        self._stopping = asyncio.Event()
        self._fault: BaseException | None = None

    @property
    def owner_id(self) -> str:
        return self.supervisor.owner_id

    async def __aenter__(self) -> Worker:
        sup = self.supervisor
        try:
            await sup.__aenter__()
        except ClockSkew as exc:  # checked on opening, like any process on the journal
            raise LeaseLost(sup.owner_id, _skewed(exc)) from None
        try:
            # A worker signs what it settles (terminates, acknowledgements): its key must be
            # one the deployment trusts, or it would claim work it cannot account for.
            registry = await sup.journal.registry(sup.keys.trusted)
            if sup.keys.signer.key_id not in registry.keys:
                why = registry.explain(sup.keys.signer.key_id)
                raise UserError(f"this worker cannot serve: {why}")
            await self._check_clock()
            now, started = sup.clock.wall(), asyncio.get_running_loop().time()
            if not await sup.journal.renew_lease(sup.owner_id, now, self.lease):
                raise LeaseLost(sup.owner_id)
            sup.lease_until = now + self.lease
            self._lease_ends = started + self.lease
        except BaseException:
            await sup.__aexit__(None, None, None)
            raise
        log.info("worker %s ready: %s", sup.owner_id, ", ".join(sorted(self.agents)),
                 extra={"owner": sup.owner_id, "agents": sorted(self.agents),
                        "lease": self.lease})
        return self

    async def __aexit__(self, *exc: object) -> None:
        sup = self.supervisor
        held = list(self._running)
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        lost: JournalError | None = None
        if not sup.abandoned:
            # Still ours: terminate what is left (journaled, probed), say so in the queue, and
            # give up the lease, so that nobody waits for it to run out.
            try:
                for delegation_id in held:
                    with contextlib.suppress(AlreadyFinished):
                        await sup.issue_control(delegation_id, ControlKind.TERMINATE, None,
                                                "worker stopping")
                    await sup.journal.queue_done(delegation_id, sup.clock.wall())
                await sup.journal.renew_lease(sup.owner_id, sup.clock.wall(), 0.0)
            except JournalError as err:  # the lease hands them over when it runs out
                lost = err
                sup.abandon()
        await sup.__aexit__(*exc)
        if lost is not None and not isinstance(exc[1], BaseException):
            raise LeaseLost(sup.owner_id, f"could not hand over what it held ({lost})")

    def stop(self) -> None:
        """Stop claiming; ``run`` returns once the delegations it holds have ended, or after
        ``stop_timeout`` seconds, when leaving the worker terminates the rest."""
        log.info("stopping: %d delegation(s) still running", len(self._running),
                 extra={"owner": self.owner_id, "running": list(self._running)})
        loop = self._loop
        try:
            here = loop is None or asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self._stop_here()
        else:  # from another thread (a signal handler's, a UI's): handed to the worker's loop
            assert loop is not None
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                loop.call_soon_threadsafe(self._stop_here)

    def _stop_here(self) -> None:
        self._stopping.set()
        self._ring()

    def _ring(self, *_: object) -> None:
        """Wake the claim loop now: a slot freed, the worker stops, or its lease ended."""
        if self._bell is not None:
            self._bell.ring()

    async def run(self) -> None:
        """Claim and run delegations until ``stop()``; raises LeaseLost if the lease ran out."""
        self._loop = asyncio.get_running_loop()
        beat = asyncio.create_task(self._keep_lease(), name="tether-lease")
        beat.add_done_callback(self._ring)
        try:
            await self._serve(beat)
        except JournalError as exc:
            if isinstance(exc, LeaseLost):
                raise
            # Without the journal the worker cannot tell whether its lease holds: stop.
            self.supervisor.abandon()
            raise LeaseLost(self.owner_id, f"lost the journal ({exc})") from None
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                await beat

    async def _serve(self, beat: asyncio.Task[None]) -> None:
        sup = self.supervisor
        # A task queued for some worker (maybe one of ours), or a slot of ours freed.
        with sup.bells.listening("queued") as bell:
            self._bell = bell
            try:
                await self._claim(sup, beat, bell)
            finally:
                self._bell = None
        self._raise_fault()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_timeout  # real time, like the lease
        while (self._running and not beat.done() and loop.time() < deadline
               and self._fault is None):
            # Stopping: let running ones finish, for a while.
            await asyncio.wait([beat, *self._running.values()],
                               timeout=deadline - loop.time(),
                               return_when=asyncio.FIRST_COMPLETED)
        if beat.done():
            beat.result()  # raises LeaseLost
        self._raise_fault()

    def _raise_fault(self) -> None:
        fault = self._fault
        if fault is None:
            return
        if isinstance(fault, JournalError):
            raise fault  # run() turns it into LeaseLost
        self.supervisor.abandon()
        raise LeaseLost(self.owner_id, f"worker fault ({fault!r})") from fault

    async def _claim(self, sup: Supervisor, beat: asyncio.Task[None], bell: Bell) -> None:
        """Claim what is queued for these agents while there is room, until stopped."""
        while not self._stopping.is_set() and not beat.done():
            free = self.concurrency - len(self._running)
            if free > 0:
                rows = await sup.journal.claim(sup.owner_id, tuple(self.agents),
                                               sup.clock.wall(), free)
                for row in rows:
                    log.info("claimed %s (%s)", row.id, row.agent,
                             extra={"delegation": row.id, "agent": row.agent,
                                    "owner": sup.owner_id})
                    self._start(row)
                if rows:
                    continue  # there may be more waiting
            await bell.wait(self.poll)

    def _start(self, row: DelegationRow) -> None:
        task = asyncio.create_task(self._run_one(row), name=f"tether-worker-{row.id}")
        self._running[row.id] = task
        task.add_done_callback(lambda _: self._done(row.id, task))

    def _done(self, delegation_id: str, task: asyncio.Task[None]) -> None:
        self._running.pop(delegation_id, None)
        self._ring()  # a slot is free: claim what waits now, not at the next poll
        if not task.cancelled() and task.exception() is not None and self._fault is None:
            # The journal failed under it, or settling a fault failed: the worker can no
            # longer vouch for what it holds, so it stops and its lease decides (run raises).
            self._fault = task.exception()
            self._stopping.set()

    async def _keep_lease(self) -> None:
        loop = asyncio.get_running_loop()
        every = self.lease / RENEWALS
        due = loop.time() + every
        while True:
            # Real time: a lease is about this process being alive, not about any clock.
            # Often, so that at least nine tenths of it are left when the journal goes away:
            # that is how long an outage the worker rides through.
            await asyncio.sleep(max(0.0, due - loop.time()))
            due = loop.time() + every
            await self._renew()
            try:
                # At most until the next renewal: a read the journal holds (a paused server)
                # held the renewals back for the read's own bound, seconds past the lease.
                async with asyncio.timeout(every):
                    await self._check_clock(renewing=True)
            except TimeoutError:
                pass  # nothing learnt; the next renewal says whether the journal is there

    async def _renew(self) -> None:
        """Renew before the lease this worker knows it holds runs out (``_lease_ends``, on
        its own monotonic clock, counted from before the renewal that last got through), or
        give it up. A journal that cannot be reached is tried again until then: a server
        away for less than that (a restart) costs no claim, and none is kept past it."""
        sup = self.supervisor
        loop = asyncio.get_running_loop()
        delay, failed = BACKOFF_FIRST, ""
        while True:
            started, now = loop.time(), sup.clock.wall()
            left = self._lease_ends - started
            if left <= 0:
                sup.abandon()
                # A fact for whoever reads the journal (as a refused renewal records it): the
                # worker knows, and from now on only its calls already sent report back.
                sup.journal.event(now, "lease_lost", None, None, owner=sup.owner_id,
                                  why="not renewed in time")
                log.error("lease lost: not renewed in time", extra={"owner": sup.owner_id})
                raise LeaseLost(sup.owner_id, f"could not renew its lease in time ({failed})")
            # Judged when it runs (after a reconnection, say), not when it was asked for;
            # run after the lease ended, it writes nothing.
            renewal = asyncio.ensure_future(sup.journal.renew_lease(
                sup.owner_id, sup.clock.wall, self.lease, until=loop.time() + left,
                on_server=not is_virtual(sup.clock)))
            renewal.add_done_callback(_retrieved)  # also when this loop is cancelled first
            # asyncio.wait, not wait_for: on Python 3.11 wait_for returns the answer when it is
            # there as the task is cancelled, swallowing the cancel (run() then waited for this
            # task for ever), and it would cancel the renewal, which must be let land.
            answered, _ = await asyncio.wait({renewal}, timeout=left)
            if not answered:  # the journal did not answer within the lease: give up
                sup.abandon()
                raise LeaseLost(sup.owner_id, "the journal did not answer within its lease "
                                f"({self.lease:g} s)") from None
            try:
                ok = renewal.result()
            except JournalError as exc:
                if isinstance(exc, LeaseLost | ClockSkew) or sup.journal.reconnect_within <= 0:
                    sup.abandon()  # cannot tell whether the lease holds: stop
                    raise LeaseLost(sup.owner_id, f"cannot renew its lease ({exc})") from None
                # Unreachable (a restart): tried again while the lease lasts.
                failed = str(exc)
                log.warning("renewing the lease failed, trying again: %s", exc,
                            extra={"owner": sup.owner_id})
                await asyncio.sleep(min(delay, max(0.0, self._lease_ends - loop.time())))
                delay = min(delay * 2, max(BACKOFF_FIRST, self.lease / 20))
                continue
            # Answered after the lease ended: others may have judged it run out meanwhile.
            if not ok or loop.time() >= self._lease_ends:
                sup.abandon()
                log.error("lease lost", extra={"owner": sup.owner_id})
                raise LeaseLost(sup.owner_id)
            sup.lease_until = now + self.lease
            self._lease_ends = started + self.lease
            return

    async def _check_clock(self, *, renewing: bool = False) -> None:
        """Leases are written on this host's clock and judged on the database server's, and
        so are dispatch deadlines (``clockcheck``): a worker whose clock is off by a quarter of
        its lease, or half the policy's clock tolerance, stops rather than risk acting after
        others presumed it dead (or being presumed dead while it works), or writing deadlines
        that others judge passed too soon."""
        sup = self.supervisor
        limit = min(self.lease / 4, sup.policy.clock_tolerance / 2)
        try:
            await check_clock(sup.journal, sup.clock, limit, f"worker {sup.owner_id}")
        except ClockSkew as exc:
            sup.abandon()
            raise LeaseLost(sup.owner_id, _skewed(exc)) from None
        except JournalError as exc:
            if renewing and sup.journal.reconnect_within > 0:
                # Just renewed, then unreachable again: nothing learnt, the lease decides.
                log.warning("cannot read the journal's clock: %s", exc,
                            extra={"owner": sup.owner_id})
                return
            sup.abandon()
            raise LeaseLost(sup.owner_id, f"cannot read the journal's clock ({exc})") from None

    async def _run_one(self, row: DelegationRow) -> None:
        sup = self.supervisor
        try:
            await self._execute(row)
        except (JournalError, asyncio.CancelledError):
            raise  # the worker as a whole stops: its lease then decides who settles this
        except Exception as exc:
            # A fault in the worker's own handling (an agent's failure ends its delegation
            # FAILED and never gets here). Nobody would run or settle the delegation, and an
            # orchestrator waiting on it would wait for as long as this worker lives: settle
            # it now, like a terminate (journaled, in-flight actions probed).
            await self._settle_after_fault(row.id, exc)
        if not sup.abandoned:  # after a lost lease, whoever reconciles it says when it is done
            await sup.journal.queue_done(row.id, sup.clock.wall())

    async def _check_work(self, row: DelegationRow) -> None:
        """Queued work runs only if a key the deployment trusts signed exactly this row's
        agent, arguments, surface and parent (a forged or altered queue entry does not)."""
        sup = self.supervisor
        signed = await sup.journal.work_of(row.id)
        if signed is None:
            raise WorkRefused(f"delegation {row.id} carries no signed work order")
        registry = await sup.journal.registry(sup.keys.trusted)
        order = registry.verify(signed, WorkOrder)
        check_work(order, row.id, row.task_id, row.parent_id, row.agent, row.args, row.surface)
        # A genuine order on a row put back by hand (a recall undone: its control row
        # deleted, the fence lifted) is run only if the delegation's records verify.
        try:
            await sup.journal.untampered(await sup.journal.kin([row.id]), sup.keys.trusted,
                                         f"run {row.id}")
        except Tampered as exc:
            raise WorkRefused(str(exc)) from None

    async def _execute(self, row: DelegationRow) -> None:
        sup = self.supervisor
        try:
            await self._check_work(row)
        except ControlRefused as exc:
            why = f"refused: {exc}"
            sup.journal.event(sup.clock.wall(), "work_refused", row.id, None, error=str(exc))
            await sup.journal.set_state(row.id, code_ended(returned=False), sup.clock.wall(),
                                        failure="refused:work", error=why)
            return
        agent = self.agents[row.agent]
        surface = check_surface(agent.tools, f"delegation of {agent.name}")
        if tuple(surface) != row.surface:
            # Different definitions on the two sides: running it could act outside the
            # surface the orchestrator granted. Refuse, with the reason on record.
            await sup.journal.set_state(
                row.id, code_ended(returned=False), sup.clock.wall(), failure="error:surface",
                error=f"worker's {agent.name} grants {sorted(surface)}, "
                      f"the delegation grants {sorted(row.surface)}")
            return
        args, kwargs = row.args["args"], row.args["kwargs"]
        run = await sup.launch(ChildRuntime(row, agent, surface), args, kwargs, sup.redispatch)
        await Handle.for_run(sup, run).wait()

    async def _settle_after_fault(self, delegation_id: str, exc: Exception) -> None:
        sup = self.supervisor
        why = f"worker fault: {exc!r}"[:300]
        sup.journal.event(sup.clock.wall(), "worker_error", delegation_id, None, error=why)
        row = await sup.journal.get(delegation_id)
        if row.state.terminal:
            return
        rt = sup.runtime(delegation_id)
        if rt is not None and rt.task is not None and not rt.task.done():
            with contextlib.suppress(AlreadyFinished):
                await sup.issue_control(delegation_id, ControlKind.TERMINATE, None, why)
        else:
            await sup.recover_delegation(row, why)


def _skewed(exc: ClockSkew) -> str:
    return (f"its clock is {exc.offset:+.1f} s off the journal server's, more than the "
            f"{exc.limit:g} s it may be (a quarter of its lease, half the policy's "
            "clock_tolerance; sync it with NTP)")


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Nobody waits for it any more: its failure, if any, was accounted for already."""
    if not future.cancelled():
        future.exception()


__all__ = ["Worker", "load_agents"]
