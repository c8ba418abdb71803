"""The supervisor: delegates, recalls, terminates, enforces grace windows and reconciles.

The drain of a recall or terminate (``draining``) and the accounting of calls and recovery
(``accounting``) are parts of it kept in their own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
from collections import ChainMap
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tether._core.errors import (
    AlreadyFinished,
    ControlSignal,
    InvalidTransition,
    Recalled,
    TetherError,
    UserError,
)
from tether._core.model import (
    FORK_REFUSED,
    ControlKind,
    DelegationState,
    Policy,
    code_ended,
)
from tether._core.redispatch import Code, RedispatchPolicy, StreamCut, cancelled
from tether._core.report import ActionRecord, Report
from tether._core.signing import Signed, TrustedKeys
from tether._core.trust import work_order
from tether._journal.journal import DEFAULT_URL, Journal
from tether._journal.ops import FenceRefused
from tether._journal.rows import DelegationRow, NewDelegation, OwnerRow
from tether._runtime import draining, issuing
from tether._runtime.accounting import Accounting
from tether._runtime.adoption import Adoption
from tether._runtime.arguments import (
    EndRecord,
    check_supervisor,
    child_payload,
    ending_for,
    unstorable,
)
from tether._runtime.attempts import drive, end_children, ending_of, record, stop_hook
from tether._runtime.bells import RECONNECTED, Bells
from tether._runtime.clock import Clock, SystemClock
from tether._runtime.clockcheck import check_clock
from tether._runtime.compensation import compensate
from tether._runtime.declared import deployment_tools
from tether._runtime.gateway import Context
from tether._runtime.handle import Handle
from tether._runtime.keys import KeyRing
from tether._runtime.logs import logger
from tether._runtime.reconcile import build_report
from tether._runtime.state import ChildRuntime, TaskRun, new_id
from tether._runtime.stopping import Stopping
from tether._runtime.telemetry import HookEvent, Hooks, Telemetry, current, trace_id_of
from tether._runtime.tools import Agent, AgentFn, Tool, as_agent, check_surface

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

T = TypeVar("T")
log = logger("supervisor")


class Supervisor:
    """Holds the journal and the keys, and every child this process runs.

    ``async with Supervisor("sqlite:///.tether/journal.db") as sup: ...``

    ``tools``: tools, or agents (adapter-built ones too) whose tools count at any depth, whose
    probes settle calls an earlier process left in doubt; by default those ``$TETHER_TOOLS``
    names (``module:attribute``, see ``declared``). A child's own tools are learned as it is
    delegated.
    """

    def __init__(self, journal: str | Journal = DEFAULT_URL, *, clock: Clock | None = None,
                 keys: KeyRing | None = None, policy: Policy | None = None,
                 tools: Iterable[Tool | Agent] | None = None, durable: bool = True,
                 control_poll: float = 0.05, recover: bool = True,
                 redispatch: RedispatchPolicy | None = None, hooks: Hooks | None = None,
                 tracer_provider: TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None,
                 handle_signals: bool = False) -> None:
        check_supervisor(journal, clock, keys, policy, redispatch, tools)
        self.journal = journal if isinstance(journal, Journal) else Journal(journal,
                                                                             durable=durable)
        self.clock: Clock = clock or SystemClock()
        self.policy = policy or Policy()
        # Deadlines judged inside the journal's transactions allow the same clock tolerance.
        self.journal.clock_tolerance = self.policy.clock_tolerance
        self._keys = keys
        # Those of the agents this process delegates, first: a call of its own children is
        # probed (and compensated) with the tool it used, never with a namesake declared to it.
        self._tools: dict[str, Tool] = {}
        declared: dict[str, Tool] = {}
        if tools is None:  # the deployment's: where $TETHER_TOOLS says its tools live
            declared.update(deployment_tools())
        else:
            self._learn(check_surface(tools, "Supervisor(tools=...)").values(), declared)
        self._known: ChainMap[str, Tool] = ChainMap(self._tools, declared)
        self.owner_id = new_id("o")
        self._runtimes: dict[str, ChildRuntime] = {}
        self._accounts = Accounting(self, self._known)
        self._background: set[asyncio.Task[Any]] = set()
        self._adoption = Adoption(self)  # intents other processes write for our children
        self._poll = control_poll
        self._open = False
        self._recover_on_start = recover
        self._listeners: list[Callable[[str, str], None]] = []
        self.bells = Bells()  # the journal's notifications, to the loops that wait for them
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abandoned = False
        # A worker's lease as last renewed (None: no lease). Past it this process is presumed
        # dead by others and settles nothing itself: its calls only record their receipts.
        self.lease_until: float | None = None
        self.redispatch = redispatch or RedispatchPolicy()
        self.hooks = hooks or Hooks()
        self.telemetry = Telemetry(tracer_provider, meter_provider)
        self._stopping = Stopping(handle_signals)

    @property
    def keys(self) -> KeyRing:
        if self._keys is None:
            raise UserError("the supervisor is not open: use 'async with Supervisor(...)'")
        return self._keys

    @property
    def undeclared_tools(self) -> frozenset[str]:
        """Names of tools whose calls this supervisor had to probe and nobody declared to it
        (those calls stay UNKNOWN)."""
        return frozenset(self._accounts.undeclared)

    @property
    def control_poll(self) -> float:
        return self._poll

    @property
    def is_open(self) -> bool:
        """Inside ``async with``: delegations may start and background work be scheduled."""
        return self._open

    def presumed_dead(self) -> bool:
        """Whether others may take this process for dead: its lease ran out (or it gave up)."""
        return self._abandoned or (self.lease_until is not None
                                   and self.clock.wall() >= self.lease_until)

    def _notified(self, payload: str) -> None:
        """From the journal's listener thread: another process did something that may concern
        this one (an intent for one of its delegations, a task queued or done)."""
        # "reconnected": the listener was cut, and what it missed is polled for now.
        if payload in (self.owner_id, "queued", "done", RECONNECTED) and \
                self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                self._loop.call_soon_threadsafe(self.bells.ring, payload)

    async def wake(self, at_most: float, *topics: str) -> None:
        """Wait for a notification from the journal (of ``topics``, or any), at most
        ``at_most`` seconds of real time: the polling fallback when notifications are lost or
        unsupported."""
        await self.bells.wait(at_most, *topics)

    def listen(self, callback: Callable[[str, str], None]) -> None:
        """Call ``callback(event, delegation_id)`` on lifecycle events: ``started``, ``drain``
        (a recall or terminate began settling the delegation) and ``ended`` (its code ended)."""
        self._listeners.append(callback)

    def _notify(self, event: str, delegation_id: str) -> None:
        for callback in self._listeners:
            callback(event, delegation_id)

    async def run_hook(self, name: str, event: HookEvent) -> None:
        """Await a user hook; its failure is journaled and never breaks the accounting."""
        hook = getattr(self.hooks, name)
        if hook is None:
            return
        try:
            await hook(event)
        except Exception as exc:
            self.journal.event(self.clock.wall(), "hook_error", event.delegation_id, None,
                               hook=name, error=repr(exc))

    def _learn(self, items: Iterable[Tool | Agent | str],
               into: dict[str, Tool] | None = None) -> None:
        found = self._tools if into is None else into
        for item in items:
            if isinstance(item, Tool):
                found.setdefault(item.name, item)
            elif isinstance(item, Agent):
                self._learn(item.tools, found)

    def track_call(self, action_id: str, task: asyncio.Task[Any], deadline_at: float) -> None:
        self._accounts.track_call(action_id, task, deadline_at)

    async def await_call(self, action_id: str, key: str) -> None:
        """Wait until an earlier call with idempotency key ``key`` has an outcome that lets a
        new call with the key decide (``Accounting.await_call``)."""
        await self._accounts.await_call(action_id, key)

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> Supervisor:
        await self.journal.open()
        try:
            # Before anything is written: a host whose clock is off the server's by more than
            # half the tolerance would misjudge others' dispatch deadlines (``clockcheck``).
            await check_clock(self.journal, self.clock, self.policy.clock_tolerance / 2,
                              "this process cannot use the journal")
            if self._keys is None:
                self._keys = await asyncio.to_thread(KeyRing.load_or_init,
                                                     self.journal.keys_dir)
            if self.journal.signer is None:  # this process's writes are sealed with its key
                self.journal.seal_with(self._keys.signer, self._keys.trusted)
            now = self.clock.wall()
            await self.journal.register_owner(
                OwnerRow(self.owner_id, os.getpid(), socket.gethostname(), now, now))
            if self._keys.signer.key_id in self._keys.trusted:
                # The first process on a fresh journal roots its key registry in its own key,
                # if its configuration pins it (docs/security.md).
                await self.journal.genesis(self._keys.signer, now)
            self._adoption.last_control = await self.journal.last_control_id()
            self._loop = asyncio.get_running_loop()
            self.journal.on_notify(self._notified)
            self._open = True
            self.spawn(self._adoption.watch())
            if self._recover_on_start:
                await self.recover()
            self._stopping.enter()
        except BaseException:
            await self.journal.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        signum = self._stopping.leave()
        await self._close()
        if signum is not None:  # SIGTERM (handle_signals=True): everything settled, now exit
            raise SystemExit(128 + signum)

    async def _close(self) -> None:
        # Children still running when the orchestrator leaves are terminated and accounted for.
        for rt in list(self._runtimes.values()) if not self._abandoned else []:
            if rt.parent is None and rt.task is not None and not rt.task.done():
                try:
                    await self.issue_control(rt.id, ControlKind.TERMINATE, None,
                                             "supervisor closed")
                except (AlreadyFinished, InvalidTransition):
                    pass  # ended, or already terminating: its drain settles it
                except TetherError:
                    rt.cut()  # refused (a lost journal, say): stop it; recovery accounts
        try:
            await self._accounts.let_calls_finish()
        finally:
            self._open = False
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            self.telemetry.close()  # every span ends, those of calls still out IN_DOUBT
            await self.journal.close()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> None:
        """Stop every child here at once, writing nothing: this process lost its lease, so its
        delegations are now settled by whoever reconciles them (a worker after a long pause)."""
        self._abandoned = True
        for rt in list(self._runtimes.values()):
            if rt.parent is None:
                # Calls already sent keep running and record their receipts (a fence refuses
                # new intents, never receipts); only the children's own code stops.
                rt.cut(actions=False)

    async def settle_here(self, delegation_id: str, kind: ControlKind, *,
                          seq: int | None = None, reason: str = "") -> Report:
        """An intent for a delegation this process owns but no longer tracks."""
        return await self._accounts.settle_here(delegation_id, kind, seq=seq, reason=reason)

    def spawn(self, coro: Coroutine[Any, Any, T], *, told: bool = False) -> asyncio.Task[T]:
        """Background work of this supervisor: cancelled when it closes, a failure journaled
        (``told``: work a caller awaits, told of its failure; retrieved, not journaled)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._told_done if told else self._background_done)
        return task

    def _told_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # its caller was told (or stopped waiting: a recovery answers)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        """A failure in background work is recorded in the journal, never dropped."""
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if self._open:
            self.journal.event(self.clock.wall(), "supervisor_error", None, None,
                               task=task.get_name(), error=repr(exc))

    # -- delegation -----------------------------------------------------------------------------
    async def delegate(self, agent: Agent | AgentFn, /, *args: Any,
                       tools: Iterable[Tool | Agent | str] | None = None,
                       task_id: str | None = None, model: str | None = None,
                       redispatch: RedispatchPolicy | None = None, remote: bool = False,
                       **kwargs: Any) -> Handle:
        """Start ``agent(ctx, *args, **kwargs)`` as a child. Returns once the delegation is
        durable and the child has started. ``redispatch`` overrides the supervisor's policy for
        a child whose model stream is cut; ``model`` is recorded for ``tether trace analyze``.
        ``remote=True`` queues it for a ``tether worker`` instead (returns once queued)."""
        if not self._open:
            raise UserError("the supervisor is not open: use 'async with Supervisor(...)'")
        ag = as_agent(agent, tools)
        surface = check_surface(ag.tools, f"delegation of {ag.name}")
        payload = child_payload(args, kwargs, ag.name)
        if task_id is not None and (not isinstance(task_id, str) or not task_id):
            raise UserError("task_id must be a non-empty string")
        if model is not None and not isinstance(model, str):
            raise UserError(f"model must be a string naming the model (e.g. 'gpt-4o'), "
                            f"not {type(model).__name__}")
        if remote and redispatch is not None:
            raise UserError("a queued delegation follows its worker's re-dispatch policy")
        new = NewDelegation(
            id=new_id("d"), task_id=task_id or new_id("t"), parent_id=None, attempt=1,
            agent=ag.name, surface=tuple(surface), args=payload, owner_id=self.owner_id,
            now=self.clock.wall(), model=model, queued=remote,
        )
        row = await self.journal.create_delegation(self.sign_work(new) if remote else new)
        if remote:
            self._learn(surface.values())  # its probes serve reconciliation from here
            return Handle(self, row, queued=True, output=ag.output)
        run = await self.launch(ChildRuntime(row, ag, surface), args, kwargs,
                                redispatch or self.redispatch)
        return Handle.for_run(self, run)

    def sign_work(self, new: NewDelegation) -> NewDelegation:
        """Queued work carries this process's signature over what a worker is to run (agent,
        arguments, surface, parent): a worker runs nothing the deployment did not sign."""
        order = work_order(new.id, new.task_id, new.parent_id, new.agent, new.args,
                           new.surface, new.now)
        return dataclasses.replace(new, work=self.keys.signer.sign(order))

    async def start_child(self, parent: ChildRuntime, agent: Agent, args: Sequence[Any],
                          kwargs: dict[str, Any], place: str | None = None, *,
                          task_id: str | None = None, guests: bool = False) -> TaskRun:
        """A grandchild of ``parent`` (``Context.delegate``), unless the journal fences it. Its
        task is named by its ``place``, or by its count among the attempt's delegations of
        ``agent``; or is ``task_id``, where the task has a name of its own elsewhere (a
        Temporal child workflow's id). ``guests``: other processes make calls of it too."""
        surface = check_surface(agent.tools, f"delegation of {agent.name}")
        payload = child_payload(args, kwargs, agent.name)
        n = parent.ordinals[agent.grant]
        name = f"{agent.name}@{place}" if place is not None else f"{agent.name}#{n}"
        try:
            row = await self.journal.create_delegation(NewDelegation(
                id=new_id("d"), task_id=task_id or f"{parent.row.task_id}/{name}",
                parent_id=parent.id, attempt=1, agent=agent.name, surface=tuple(surface),
                args=payload, owner_id=self.owner_id, now=self.clock.wall(),
                parent_epoch=parent.row.epoch,
            ))
        except FenceRefused:
            raise parent.stop or Recalled(parent.id, "parent is fenced") from None
        parent.ordinals[agent.grant] += 1
        rt = ChildRuntime(row, agent, surface, parent=parent, guests=guests)
        parent.children.append(rt)
        if parent.stop is not None:  # fenced while the insert was queued: never run it
            rt.stop = parent.stop
        return await self.launch(rt, args, kwargs, self.redispatch)

    async def launch(self, rt: ChildRuntime, args: Sequence[Any], kwargs: dict[str, Any],
                     policy: RedispatchPolicy) -> TaskRun:
        """Start the first attempt of a task whose delegation row exists, and drive the rest."""
        run = TaskRun(rt.row.task_id, policy, rt, [rt],
                      asyncio.get_running_loop().create_future(),
                      span=self.telemetry.delegation_span(rt.row.task_id, rt.agent.name))
        rt.run = rt.run or run
        # A failure of the task's driver reaches whoever awaits the result; nobody may (a
        # worker only waits for the end), and that is no reason to print it at exit.
        run.done.add_done_callback(_retrieved)
        if rt.row.epoch or rt.row.parent_id is not None:  # a new root task starts at 0
            rt.generation = await self.journal.cancel_generation(rt.row.task_id)
        await self.start_attempt(rt, args, kwargs, retry=False)
        self.spawn(drive(self, run, args, kwargs))
        return run

    async def start_attempt(self, rt: ChildRuntime, args: Sequence[Any],
                            kwargs: dict[str, Any], *, retry: bool,
                            after: ChildRuntime | None = None) -> bool:
        """Fork one attempt: span, start hook (awaited), then, for a re-dispatch, the last
        cancel check; only then the re-dispatch event and the child's code."""
        self._learn(rt.surface.values())
        self._runtimes[rt.id] = rt
        links = [s for s in (rt.run.span if rt.run else None, after.span if after else None)
                 if s is not None]
        rt.span = self.telemetry.attempt_span(rt.row.task_id, rt.id, rt.row.attempt,
                                              rt.agent.name, links)
        event = HookEvent(rt.row.task_id, rt.id, rt.row.attempt, rt.agent.name)
        await self.run_hook("on_child_start", event)
        if retry and rt.run is not None:
            moved = cancelled(rt.generation,
                              await self.journal.cancel_generation(rt.row.task_id),
                              Code.CANCELLED_DURING_FORK)
            if moved is not None:
                await record(self, rt, moved, "after_fork")
                with contextlib.suppress(AlreadyFinished, InvalidTransition):
                    # (a cancel from another process may have terminated it first)
                    await self.journal.set_state(rt.id, FORK_REFUSED,
                                                 self.clock.wall(),
                                                 error="cancelled before it ran",
                                                 failure="cancelled")
                await stop_hook(self, rt, moved.code.value)
                return False
            rt.run.current = rt
            rt.run.attempts.append(rt)
            self.journal.event(self.clock.wall(), "redispatch", rt.id, None,
                               attempt=rt.row.attempt, retry_of=after.id if after else None)
            await self.run_hook("on_redispatch", event)
        trace_id = trace_id_of(rt.span)
        if trace_id:
            self.journal.event(self.clock.wall(), "trace", rt.id, None, trace_id=trace_id)
        started = asyncio.Event()
        rt.task = asyncio.create_task(self._child_main(rt, args, kwargs, started),
                                      name=f"tether-child-{rt.id}")
        await started.wait()
        return True

    async def _child_main(self, rt: ChildRuntime, args: Sequence[Any], kwargs: dict[str, Any],
                          started: asyncio.Event) -> tuple[bool, Any]:
        started.set()
        self._notify("started", rt.id)
        ending: EndRecord
        try:
            if rt.stop is not None:
                raise rt.stop
            with current(rt.span):  # in the child's own task: what it opens nests under it
                value = await rt.agent.fn(Context(self, rt), *args, **kwargs)
            ending, shown = ending_for(value, rt.agent)
            outcome: tuple[bool, Any] = (True, shown)
        except ControlSignal as signal:
            if rt.stop is None and rt.draining is None and not self.presumed_dead():
                # The journal fenced it before this process heard of the intent (a recall
                # from another shell): drain it now, or nobody would settle it.
                try:
                    await self._adoption.latest(rt)
                except asyncio.CancelledError:
                    if rt.stop is None:
                        raise
                    # The watch loop adopted it too, and its drain cut us here: stopped.
            return False, rt.stop or signal
        except asyncio.CancelledError:
            if rt.stop is None:
                raise
            return False, rt.stop  # stopped by a recall or terminate, not by our caller
        except StreamCut as cut:
            salvaged = cut.partial.to_json() if cut.partial.usable else None
            bad = None if salvaged is None else unstorable(salvaged, rt.agent.name)
            if bad is not None:  # raised here, no other handler of this try would see it
                ending = (code_ended(returned=False), None, f"UserError: {bad}",
                          ending_of(bad)[1])
                outcome = (False, bad)
            elif salvaged is not None:  # retrying would destroy what was salvaged
                ending = (code_ended(returned=False, salvaged=True), salvaged, None,
                          ending_of(cut)[1])
                outcome = (True, cut.partial)
            else:
                ending = (code_ended(returned=False), None, str(cut), ending_of(cut)[1])
                outcome = (False, cut)
        except Exception as exc:
            ending = (code_ended(returned=False), None, f"{type(exc).__name__}: {exc}",
                      ending_of(exc)[1])
            outcome = (False, exc)
        finally:
            self._notify("ended", rt.id)
        try:
            state, result, error, failure = ending
            await end_children(self, rt, state)
            await self._finish(rt, state, result=result, error=error, failure=failure)
        except asyncio.CancelledError:
            # A terminate landed while the child's end was being recorded: the terminate was
            # accepted first, and its drain settles the delegation.
            if rt.stop is None:
                raise
            return False, rt.stop
        return outcome

    async def _finish(self, rt: ChildRuntime, state: DelegationState, result: Any = None,
                      error: str | None = None, failure: str | None = None) -> None:
        """A child ended on its own. If a control intent got there first, the drain decides."""
        if rt.stop is not None:
            return
        try:
            # Queued after this child's receipts, so it commits after them: no flush needed.
            rt.final, doubtful = await self.journal.end_delegation(
                rt.id, state, self.clock.wall(), result=result, error=error,
                failure=failure)
        except AlreadyFinished:
            return
        except InvalidTransition:
            # A control intent was accepted first (RECALLING cannot become SUCCEEDED). If it
            # came from another process and the poll has not seen it yet, drain it now: the
            # journal says it must be settled, and nobody else here will.
            await self._adoption.latest(rt)
            return
        if doubtful:  # a tool raised: it may have applied; ask the outside world
            await self._accounts.account(rt.id, state)  # and again at its deadline

    # -- control --------------------------------------------------------------------------------
    async def issue_control(self, delegation_id: str, kind: ControlKind, grace: float | None,
                            reason: str, seq: int | None = None) -> Report:
        """Sign a recall or terminate, have the journal accept it, and drain the delegation
        (here, or wherever it runs): what ``Handle.recall`` and ``terminate`` do."""
        return await issuing.issue_control(self, delegation_id, kind, grace, reason, seq)

    async def recall_many(self, delegations: Iterable[str | Handle], grace: float,
                          reason: str = "") -> dict[str, Report | TetherError]:
        """Recall each delegation (an id or a handle) at once: a storm's reads and fences
        share the journal's batches. By id, each one's report, or the error that stopped its
        recall; one that fails stops none of the others."""
        return await issuing.stop_many(self, delegations, self.handle_for, ControlKind.RECALL,
                                       grace, reason)

    async def terminate_many(self, delegations: Iterable[str | Handle],
                             reason: str = "") -> dict[str, Report | TetherError]:
        """Terminate each delegation (an id or a handle) at once; as ``recall_many``."""
        return await issuing.stop_many(self, delegations, self.handle_for,
                                       ControlKind.TERMINATE, None, reason)

    async def current_trust(self) -> TrustedKeys:
        """The keys whose intents this process acts on: the journal's key registry as this
        configuration's pins root it, and this process's own key (its acknowledgements)."""
        registry = await self.journal.registry(self.keys.trusted)
        return registry.keys.plus(self.keys.signer.public)

    def start_drain(self, rt: ChildRuntime, signed: Signed,
                     accepted_at: float) -> asyncio.Future[Report]:
        rt.draining = self.spawn(draining.drain(self, self._accounts, rt, signed, accepted_at))
        self._notify("drain", rt.id)
        return rt.draining

    # -- recovery -------------------------------------------------------------------------------
    async def recover(self, delegation_id: str | None = None,
                      refused: dict[str, str] | None = None) -> list[Report]:
        """Reconcile live delegations whose owner is dead (crashed process or expired lease),
        and every action still in doubt. ``tether reconcile`` runs this. Delegations whose
        records fail their chain are left alone; ``refused`` receives each with the reason."""
        return await self._accounts.recover(delegation_id, refused)

    async def recover_delegation(self, row: DelegationRow, reason: str) -> Report:
        """Settle a delegation whose owner is gone, or that its owner cannot settle."""
        return await self._accounts.recover_delegation(row, reason)

    # -- reports and compensation ---------------------------------------------------------------
    async def report(self, delegation_id: str) -> Report:
        await self.journal.flush()
        return await build_report(self.journal, delegation_id)

    async def compensate(self, report: Report) -> Report | None:
        """Run each tool's compensation for actions the report shows COMPLETED, never for
        UNKNOWN ones, as an ordinary journaled delegation with keys derived from the
        originals (so compensating twice is refused, not repeated)."""
        return await compensate(self, report, self._known)

    async def resolve(self, action_id: str, outcome: str, note: str, *,
                      operator: str | None = None) -> ActionRecord:
        """Record a person's decision on an action nobody could settle (UNKNOWN, or in doubt):
        COMPLETED or NOT_APPLIED, signed with this supervisor's key, with ``operator`` (default
        $TETHER_OPERATOR or the login name) and ``note``; its delegation re-settles. What
        ``tether resolve`` does."""
        from tether._runtime.resolve import resolve

        await self.journal.flush()
        return await resolve(self.journal, self.keys, action_id, outcome, note, operator,
                             self.clock.wall())

    def handle_for(self, delegation_id: str) -> Handle:
        """A handle on any delegation in the journal, e.g. one listed by ``tether ls``."""
        rt = self._runtimes.get(delegation_id)
        if rt is not None:
            return Handle(self, rt.row)
        return Handle.detached(self, delegation_id)

    def forget(self, rt: ChildRuntime) -> None:
        if rt.draining is None or rt.draining.done():
            self._runtimes.pop(rt.id, None)
        else:  # a drain still settles it; forget it when that is done
            rt.draining.add_done_callback(lambda _: self._runtimes.pop(rt.id, None))

    def runtime(self, delegation_id: str) -> ChildRuntime | None:
        return self._runtimes.get(delegation_id)


__all__ = ["Supervisor"]


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
