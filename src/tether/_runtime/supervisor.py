"""The supervisor: delegates, recalls, terminates, enforces grace windows and reconciles."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tether._core import drain
from tether._core.documents import (
    Acknowledgement,
    ControlIntent,
    NoEffectsReceipt,
    canonical,
)
from tether._core.errors import (
    AlreadyFinished,
    ControlSignal,
    InvalidTransition,
    KeyInUse,
    Recalled,
    Terminated,
    UserError,
)
from tether._core.model import ActionState, ControlKind, DelegationState, Policy, check_grace
from tether._core.outcome import UNSETTLED
from tether._core.redispatch import Code, RedispatchPolicy, StreamCut, cancelled
from tether._core.report import Report
from tether._core.signing import Signed
from tether._core.verdict import RecallInput, Verdict, evaluate_recall
from tether._journal.journal import DEFAULT_URL, Journal
from tether._journal.ops import FenceRefused
from tether._journal.rows import ControlRow, DelegationRow, NewDelegation, OwnerRow
from tether._runtime.attempts import TaskRun, drive, ending_of, record, stop_hook
from tether._runtime.clock import Clock, SystemClock, first_of
from tether._runtime.gateway import UNSERIALIZABLE, ChildRuntime, Context, new_id
from tether._runtime.handle import Handle
from tether._runtime.keys import KeyRing
from tether._runtime.reconcile import build_report, compensate, probe_all, settle_subtree
from tether._runtime.remote import owner_alive, settle_elsewhere
from tether._runtime.telemetry import HookEvent, Hooks, Telemetry, trace_id_of
from tether._runtime.tools import Agent, AgentFn, Tool, as_agent, check_surface

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

T = TypeVar("T")


def _json_or_marker(value: Any) -> Any:
    try:
        canonical(value)
        return value
    except UserError:
        return {UNSERIALIZABLE: repr(value)[:500]}


def _payload(args: Sequence[Any], kwargs: dict[str, Any], what: str) -> dict[str, Any]:
    payload = {"args": list(args), "kwargs": kwargs}
    try:
        canonical(payload)
    except UserError as exc:
        raise UserError(f"arguments to {what} cannot be serialized: {exc}") from None
    return payload


class Supervisor:
    """Holds the journal and the keys, and every child this process runs.

    ``async with Supervisor("sqlite:///.tether/journal.db") as sup: ...``
    """

    def __init__(self, journal: str | Journal = DEFAULT_URL, *, clock: Clock | None = None,
                 keys: KeyRing | None = None, policy: Policy | None = None,
                 tools: Iterable[Tool] = (), durable: bool = True,
                 control_poll: float = 0.05, recover: bool = True,
                 redispatch: RedispatchPolicy | None = None, hooks: Hooks | None = None,
                 tracer_provider: TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None) -> None:
        self.journal = journal if isinstance(journal, Journal) else Journal(journal,
                                                                             durable=durable)
        self.clock: Clock = clock or SystemClock()
        self.policy = policy or Policy()
        self._keys = keys
        self._tools: dict[str, Tool] = {}
        self._learn(check_surface(tools, "Supervisor(tools=...)").values())
        self.owner_id = new_id("o")
        self._runtimes: dict[str, ChildRuntime] = {}
        # Every tool call of this process still running, by action id, whether or not its
        # delegation is still tracked: a call left running after a recall's grace window must
        # still record its receipt.
        self._calls: dict[str, asyncio.Task[Any]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._rechecks: set[str] = set()  # roots with a re-probe scheduled
        self._last_control = 0
        self._poll = control_poll
        self._open = False
        self._recover_on_start = recover
        self._listeners: list[Callable[[str, str], None]] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abandoned = False
        # A worker's lease as last renewed (None: no lease). Past it this process is presumed
        # dead by others and settles nothing itself: its calls only record their receipts.
        self.lease_until: float | None = None
        self.redispatch = redispatch or RedispatchPolicy()
        self.hooks = hooks or Hooks()
        self.telemetry = Telemetry(tracer_provider, meter_provider)

    @property
    def keys(self) -> KeyRing:
        if self._keys is None:
            raise UserError("the supervisor is not open: use 'async with Supervisor(...)'")
        return self._keys

    @property
    def control_poll(self) -> float:
        return self._poll

    def presumed_dead(self) -> bool:
        """Whether others may take this process for dead: its lease ran out (or it gave up)."""
        return self._abandoned or (self.lease_until is not None
                                   and self.clock.wall() >= self.lease_until)

    def _notified(self, payload: str) -> None:
        """From the journal's listener thread: another process did something that may concern
        this one (an intent for one of its delegations, a task queued or done)."""
        if payload in (self.owner_id, "queued", "done") and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                self._loop.call_soon_threadsafe(self._ring)

    def _ring(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def wake(self, at_most: float) -> None:
        """Wait for a notification from the journal (PostgreSQL), at most ``at_most`` seconds
        of real time: the polling fallback when notifications are lost or unsupported."""
        if self._wakeup is None or self._wakeup.done():
            self._wakeup = asyncio.get_running_loop().create_future()
        await asyncio.wait([self._wakeup], timeout=at_most)

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

    def _learn(self, items: Iterable[Tool | Agent | str]) -> None:
        for item in items:
            if isinstance(item, Tool):
                self._tools.setdefault(item.name, item)
            elif isinstance(item, Agent):
                self._learn(item.tools)

    def track_call(self, action_id: str, task: asyncio.Task[Any]) -> None:
        self._calls[action_id] = task
        task.add_done_callback(lambda _: self._calls.pop(action_id, None))

    async def await_call(self, action_id: str, key: str) -> None:
        """Wait until an earlier action with idempotency key ``key`` has an outcome that lets
        a new call with the key decide (replay, run again, or fail): at most until the earlier
        call's dispatch deadline, after which a probe's answer is final."""
        task = self._calls.get(action_id)
        if task is not None:  # this process runs it: its receipt is posted before it ends
            await asyncio.wait([task])
            await self.journal.flush()
            return
        while True:
            action = await self.journal.action(action_id)
            if action.state not in UNSETTLED:
                return
            deadline = action.deadline_at if action.deadline_at is not None else 0.0
            now = self.clock.wall()
            if now >= deadline:
                if action.state is ActionState.IN_DOUBT:
                    await probe_all(self.journal, [action], self._tools, self.clock,
                                    self.policy.probe_timeout)
                    action = await self.journal.action(action_id)
                if action.state in UNSETTLED or action.state is ActionState.UNKNOWN:
                    raise KeyInUse(key, action_id, action.state.value)
                return
            await first_of(self.clock, min(deadline - now, self.policy.lease),
                           self.wake(self._poll))

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> Supervisor:
        await self.journal.open()
        try:
            if self._keys is None:
                self._keys = await asyncio.to_thread(KeyRing.load_or_init,
                                                     self.journal.keys_dir)
            now = self.clock.wall()
            await self.journal.register_owner(
                OwnerRow(self.owner_id, os.getpid(), socket.gethostname(), now, now))
            self._last_control = await self.journal.last_control_id()
            self._loop = asyncio.get_running_loop()
            self.journal.on_notify(self._notified)
            self._open = True
            self._spawn(self._watch())
            if self._recover_on_start:
                await self.recover()
        except BaseException:
            await self.journal.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Children still running when the orchestrator leaves are terminated and accounted for.
        for rt in list(self._runtimes.values()) if not self._abandoned else []:
            if rt.parent is None and rt.task is not None and not rt.task.done():
                with contextlib.suppress(AlreadyFinished):
                    await self._control(rt.id, ControlKind.TERMINATE, None, "supervisor closed")
        await self._let_calls_finish()
        self._open = False
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.journal.close()

    async def _let_calls_finish(self) -> None:
        """Calls still running (left to finish after a recall's grace window, or by a lost
        lease) get a bounded while to record their receipts; whatever is still running then is
        declared in doubt, so that the next supervisor on the journal probes it."""
        running = [t for t in self._calls.values() if not t.done()]
        if running:
            await first_of(self.clock, self.policy.ack_timeout + self.policy.probe_timeout,
                           asyncio.gather(*running, return_exceptions=True))
        left = [a for a, t in self._calls.items() if not t.done()]
        with contextlib.suppress(Exception):  # a lost journal: recovery still finds them
            for action_id in left:
                await self.journal.settle_pending(action_id, self.clock.wall(),
                                                  "its supervisor closed while it ran")
            await self.journal.flush()

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
                self._cut(rt, actions=False)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        """A failure in background work is recorded in the journal, never dropped."""
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if self._open:
            self.journal.event(self.clock.wall(), "supervisor_error", None, None,
                               task=task.get_name(), error=repr(exc))

    async def _watch(self) -> None:
        """Learn of control intents written by other processes (``tether recall``) and keep
        this owner's heartbeat. Real time: this is a poll loop, not a deadline."""
        beats = 0
        every = max(1, int(self.policy.lease / 3 / self._poll))
        while True:
            await self.wake(self._poll)
            if self.presumed_dead():
                continue  # whoever reconciles our delegations settles them, not us
            for row in await self.journal.controls_to_adopt(self.owner_id, self._last_control):
                self._last_control = max(self._last_control, row.id)
                rt = self._runtimes.get(row.delegation_id)
                if row.issuer != self.owner_id and rt is not None:
                    self._adopt(rt, row)
            beats += 1
            if beats % every == 0:
                self.journal.heartbeat(self.owner_id, self.clock.wall())

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
        payload = _payload(args, kwargs, ag.name)
        if task_id is not None and (not isinstance(task_id, str) or not task_id):
            raise UserError("task_id must be a non-empty string")
        if remote and redispatch is not None:
            raise UserError("a queued delegation follows its worker's re-dispatch policy")
        row = await self.journal.create_delegation(NewDelegation(
            id=new_id("d"), task_id=task_id or new_id("t"), parent_id=None, attempt=1,
            agent=ag.name, surface=tuple(surface), args=payload, owner_id=self.owner_id,
            now=self.clock.wall(), model=model, queued=remote,
        ))
        if remote:
            self._learn(surface.values())  # its probes serve reconciliation from here
            return Handle(self, row, queued=True)
        return await self._launch(ChildRuntime(row, ag, surface), args, kwargs,
                                  redispatch or self.redispatch)

    async def _start_child(self, parent: ChildRuntime, agent: Agent, args: Sequence[Any],
                           kwargs: dict[str, Any]) -> Handle:
        surface = check_surface(agent.tools, f"delegation of {agent.name}")
        payload = _payload(args, kwargs, agent.name)
        n = parent.ordinals[agent.grant]
        try:
            row = await self.journal.create_delegation(NewDelegation(
                id=new_id("d"), task_id=f"{parent.row.task_id}/{agent.name}#{n}",
                parent_id=parent.id, attempt=1, agent=agent.name, surface=tuple(surface),
                args=payload, owner_id=self.owner_id, now=self.clock.wall(),
                parent_epoch=parent.row.epoch,
            ))
        except FenceRefused:
            raise parent.stop or Recalled(parent.id, "parent is fenced") from None
        parent.ordinals[agent.grant] += 1
        rt = ChildRuntime(row, agent, surface, parent=parent)
        parent.children.append(rt)
        if parent.stop is not None:  # fenced while the insert was queued: never run it
            rt.stop = parent.stop
        return await self._launch(rt, args, kwargs, self.redispatch)

    async def _launch(self, rt: ChildRuntime, args: Sequence[Any], kwargs: dict[str, Any],
                      policy: RedispatchPolicy) -> Handle:
        run = TaskRun(rt.row.task_id, policy, rt, [rt],
                      asyncio.get_running_loop().create_future(),
                      span=self.telemetry.delegation_span(rt.row.task_id, rt.agent.name))
        rt.run = rt.run or run
        if rt.row.epoch or rt.row.parent_id is not None:  # a new root task starts at 0
            rt.generation = await self.journal.cancel_generation(rt.row.task_id)
        await self.start_attempt(rt, args, kwargs, retry=False)
        self._spawn(drive(self, run, args, kwargs))
        return Handle(self, rt.row, run)

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
                    await self.journal.set_state(rt.id, DelegationState.CANCELLED,
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
        ending: tuple[DelegationState, Any, str | None, str | None]
        try:
            if rt.stop is not None:
                raise rt.stop
            value = await rt.agent.fn(Context(self, rt), *args, **kwargs)
            ending = (DelegationState.SUCCEEDED, value, None, None)
            outcome: tuple[bool, Any] = (True, value)
        except ControlSignal as signal:
            if rt.stop is None and rt.draining is None and not self.presumed_dead():
                # The journal fenced it before this process heard of the intent (a recall
                # from another shell): drain it now, or nobody would settle it.
                await self._adopt_latest(rt)
            return False, signal
        except asyncio.CancelledError:
            if rt.stop is None:
                raise
            return False, rt.stop  # stopped by a recall or terminate, not by our caller
        except StreamCut as cut:
            if cut.partial.usable:  # retrying would destroy what was salvaged
                ending = (DelegationState.SUCCEEDED_PARTIAL, cut.partial.to_json(), None,
                          ending_of(cut)[1])
                outcome = (True, cut.partial)
            else:
                ending = (DelegationState.FAILED, None, str(cut), ending_of(cut)[1])
                outcome = (False, cut)
        except Exception as exc:
            ending = (DelegationState.FAILED, None, f"{type(exc).__name__}: {exc}",
                      ending_of(exc)[1])
            outcome = (False, exc)
        finally:
            self._notify("ended", rt.id)
        try:
            state, result, error, failure = ending
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
                rt.id, state, self.clock.wall(), result=_json_or_marker(result), error=error,
                failure=failure)
        except AlreadyFinished:
            return
        except InvalidTransition:
            # A control intent was accepted first (RECALLING cannot become SUCCEEDED). If it
            # came from another process and the poll has not seen it yet, drain it now: the
            # journal says it must be settled, and nobody else here will.
            await self._adopt_latest(rt)
            return
        if doubtful:  # a tool raised: it may have applied; ask the outside world
            await probe_all(self.journal, doubtful, self._tools, self.clock,
                            self.policy.probe_timeout)
            await settle_subtree(self.journal, rt.id, self.clock, state)

    # -- control --------------------------------------------------------------------------------
    async def _control(self, delegation_id: str, kind: ControlKind, grace: float | None,
                       reason: str, seq: int | None = None) -> Report:
        if kind is ControlKind.RECALL:
            grace = check_grace(grace, self.policy)
        if not isinstance(reason, str):
            raise UserError("reason must be a string")
        issued = self.clock.wall()
        if seq is None:
            # The next sequence as this caller sees it, so that of two racing callers the
            # loser is told the current sequence (I4) rather than that the state moved.
            seq = (await self.journal.get(delegation_id)).control_seq + 1
        offered = seq

        def make(row: DelegationRow) -> Signed:  # runs in the journal's transaction
            return self.keys.signer.sign(ControlIntent(
                kind=kind, delegation_id=row.id, epoch=row.epoch, seq=offered, grace=grace,
                reason=reason, issued_at=issued))

        _, signed = await self.journal.sign_and_accept(delegation_id, make, self.keys.trusted,
                                                       self.owner_id, issued)
        rt = self._runtimes.get(delegation_id)
        if kind is ControlKind.TERMINATE and rt is not None and rt.draining is not None:
            self._cut(rt)  # cuts the recall's grace window short
            return await asyncio.shield(rt.draining)
        if rt is None:
            return await settle_elsewhere(self, delegation_id, signed)
        return await asyncio.shield(self._start_drain(rt, signed, self.clock.now()))

    async def _adopt_latest(self, rt: ChildRuntime) -> None:
        controls = await self.journal.controls(rt.id)
        if controls:
            self._adopt(rt, controls[-1])

    def _adopt(self, rt: ChildRuntime, row: ControlRow) -> None:
        """Drain for an intent another process wrote. Its acceptance time is wall-clock; the
        grace window runs on ``clock.now()``, so it is converted, not taken as is."""
        if rt.draining is None:
            elapsed = max(0.0, self.clock.wall() - row.accepted_at)
            self._start_drain(rt, row.signed, self.clock.now() - elapsed)

    def _start_drain(self, rt: ChildRuntime, signed: Signed,
                     accepted_at: float) -> asyncio.Future[Report]:
        rt.draining = self._spawn(self._drain(rt, signed, accepted_at))
        self._notify("drain", rt.id)
        return rt.draining

    def _cut(self, rt: ChildRuntime, *, actions: bool = True) -> None:
        """Stop the subtree now. A terminate also cancels in-flight actions; when a recall's
        grace ends they are left to finish on their own, so that a completion arriving after
        the window is still recorded (a late receipt) rather than lost with its task."""
        for node in rt.walk():
            node.stop = Terminated(node.id, "terminated")
            tasks = [*node.inflight.values(), node.task] if actions else [node.task]
            for task in tasks:
                if task is not None and not task.done():
                    task.cancel()

    async def _drain(self, rt: ChildRuntime, signed: Signed, accepted_at: float) -> Report:
        """Drive the drain protocol (``_core.drain``): every decision is made there."""
        intent = self.keys.trusted.verify(signed, ControlIntent)
        stop, cut_now = drain.start(intent.kind)
        for node in rt.walk():
            node.stop = node.stop or (Recalled if stop is drain.Stop.RECALLED
                                      else Terminated)(node.id, intent.reason)
        verdict, reason = Verdict.TERMINATE, "terminate requested"
        if not cut_now:
            verdict, reason = await self._grace_window(rt, signed, intent, accepted_at)
        plan = drain.ending(verdict, killed=cut_now or any(
            isinstance(n.stop, Terminated) for n in rt.walk()))
        if plan.terminate:
            self._cut(rt, actions=plan.cut_calls)
        children = [n.task for n in rt.walk() if n.task is not None and not n.task.done()]
        for task in children:  # nothing can start any more; stop waiting for model work
            task.cancel()
        if children:
            await first_of(self.clock, self.policy.ack_timeout,
                           asyncio.gather(*children, return_exceptions=True))
        if plan.mark_in_doubt:
            await self.journal.mark_in_doubt(rt.id, self.clock.wall())
        await self._account(rt.id, plan.fallback)
        self.journal.event(self.clock.wall(), "verdict", rt.id, verdict=verdict.value,
                           reason=reason)
        await self.journal.flush()
        return await build_report(self.journal, rt.id)

    async def _account(self, root_id: str, fallback: DelegationState) -> None:
        """Probe what is in doubt, settle the subtree, and keep checking in the background
        what may still apply (``drain.recheck_at``) until it is final."""
        await self.journal.flush()
        doubtful = await self.journal.unsettled(root_id)
        if doubtful:
            await probe_all(self.journal, doubtful, self._tools, self.clock,
                            self.policy.probe_timeout)
        await settle_subtree(self.journal, root_id, self.clock, fallback)
        await self._recheck_later(root_id, fallback)

    async def _recheck_later(self, root_id: str, fallback: DelegationState) -> None:
        open_calls = [a for a in await self.journal.unsettled(root_id)
                      if a.state is ActionState.IN_DOUBT]
        at = drain.recheck_at((a.deadline_at or 0.0 for a in open_calls), self.clock.wall())
        if at is not None and self._open and root_id not in self._rechecks:
            self._rechecks.add(root_id)
            self._spawn(self._recheck(root_id, fallback, at))

    async def _recheck(self, root_id: str, fallback: DelegationState, at: float) -> None:
        try:
            await self.clock.sleep(at - self.clock.wall())
        finally:
            self._rechecks.discard(root_id)
        await self._account(root_id, fallback)

    async def _grace_window(self, rt: ChildRuntime, signed: Signed, intent: ControlIntent,
                            accepted_at: float) -> tuple[Verdict, str]:
        """Acknowledge with the in-flight manifest, then wait while actions finish, at most
        until the grace window ends or a terminate cuts it short."""
        nodes = rt.walk()
        signer, trusted = self.keys.signer, self.keys.trusted
        ack = signer.sign(Acknowledgement(rt.id, intent.seq, tuple(
            a for n in nodes for a in n.inflight), acked_at=self.clock.wall()))
        await self.journal.record_ack(ack, trusted, self.clock.wall())
        receipt = None
        if sum(n.effects_started for n in nodes) == 0:
            receipt = signer.sign(NoEffectsReceipt(rt.id, intent.seq, self.clock.wall()))
            await self.journal.record_receipt(receipt, trusted, self.clock.wall())
        while True:
            # Counted before the journal is read: a call that ends after this count posted its
            # receipt before ending, so the flush below commits it before the read.
            running = rt.inflight_tasks()
            await self.journal.flush()
            facts = await self.journal.facts(rt.id)
            decision = evaluate_recall(RecallInput(
                signed, facts, accepted_at, self.clock.now(), self.policy, trusted, ack, receipt))
            step = drain.grace_step(decision, live=len(running), terminated=any(
                isinstance(n.stop, Terminated) for n in nodes))
            if step.wait is None:
                return step.verdict, step.reason
            waits = [asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)] if running else []
            await first_of(self.clock, step.wait, *waits)

    # -- recovery -------------------------------------------------------------------------------
    async def recover(self, delegation_id: str | None = None) -> list[Report]:
        """Reconcile live delegations whose owner is dead (crashed process or expired lease),
        and every action still in doubt. ``tether reconcile`` runs this."""
        live = await self.journal.delegations(live_only=True)
        by_id = {r.id: r for r in live}
        reports = []
        for row in live:
            if row.id in self._runtimes or (row.parent_id in by_id):
                continue
            if delegation_id is not None and row.id != delegation_id:
                continue
            if not await owner_alive(self, row.owner_id):
                entry = await self.journal.queue_entry(row.id)
                if entry is not None and entry.claimed_by is None:
                    continue  # queued: it waits for a worker, whoever queued it
                reports.append(await self._recover_one(row, f"owner {row.owner_id} is gone"))
        doubtful = [a for a in await self.journal.unsettled(delegation_id)
                    if a.delegation_id not in self._runtimes and a.id not in self._calls]
        if doubtful:
            await probe_all(self.journal, doubtful, self._tools, self.clock,
                            self.policy.probe_timeout)
            roots = {a.delegation_id for a in doubtful}
            for root in roots:
                row = await self.journal.get(root)
                await settle_subtree(self.journal, root, self.clock, row.state)
                await self._recheck_later(root, row.state)
                if all(r.delegation_id != root for r in reports):
                    reports.append(await build_report(self.journal, root))
        return reports

    async def _recover_one(self, row: DelegationRow, reason: str) -> Report:
        if not row.state.terminal and await self.journal.drained(row.id):
            # Its owner drained it before going away, leaving calls in doubt: finish the
            # accounting, without a second verdict that would hide the first.
            await self.journal.mark_in_doubt(row.id, self.clock.wall())
            await self._account(row.id, DelegationState.TERMINATED)
            await self.journal.flush()
            return await build_report(self.journal, row.id)
        if row.state in (DelegationState.RUNNING,):
            intent = ControlIntent(ControlKind.TERMINATE, row.id, row.epoch, row.control_seq + 1,
                                   None, f"recovery: {reason}", self.clock.wall())
            await self.journal.accept_control(self.keys.signer.sign(intent), self.keys.trusted,
                                              self.owner_id, self.clock.wall())
        await self.journal.mark_in_doubt(row.id, self.clock.wall())
        await self._account(row.id, DelegationState.TERMINATED)
        self.journal.event(self.clock.wall(), "verdict", row.id, verdict="RECOVERED",
                           reason=reason)
        await self.journal.flush()
        return await build_report(self.journal, row.id)

    # -- reports and compensation ---------------------------------------------------------------
    async def report(self, delegation_id: str) -> Report:
        await self.journal.flush()
        return await build_report(self.journal, delegation_id)

    async def compensate(self, report: Report) -> Report | None:
        """Run each tool's compensation for actions the report shows COMPLETED, never for
        UNKNOWN ones, as an ordinary journaled delegation with keys derived from the
        originals (so compensating twice is refused, not repeated)."""
        return await compensate(self, report, self._tools)

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
