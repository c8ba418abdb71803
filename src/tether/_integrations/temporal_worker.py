"""tether's gateway on a Temporal worker: every activity of a workflow passes it.

A workflow run is a delegation, hosted by the worker process whose tether ``Supervisor`` first
runs one of its activities: its task is ``temporal:<workflow id>``, so every run of one
workflow id is the same task at a new epoch, and a new run replays by idempotency key what an
earlier run completed. The delegation's body only waits (as the MCP proxy's does): it lives
until the run closes, and each activity is one ``ctx.call`` of it, so the gateway journals the
intent before the activity's code runs, fences it, keys it, shields it from cancellation and
records its receipt. Nothing here decides the protocol; it maps Temporal's calls onto the
gateway.

Everything here runs in the worker's activity tasks, outside the workflow sandbox: workflow
code stays deterministic and never touches the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import temporalio.activity
import temporalio.client
import temporalio.plugin
import temporalio.worker
from temporalio.exceptions import ApplicationError

from tether._core.errors import (
    ControlSignal,
    KeyInUse,
    Tampered,
    ToolRejected,
    UserError,
)
from tether._core.model import Effect
from tether._core.redispatch import UNRESTRICTED
from tether._integrations.temporal_activities import (
    BUSY,
    PENDING,
    REFUSED,
    ActivityProbe,
    Pending,
    activity,
    forward,
    json_args,
    refused,
    tool_arguments,
)
from tether._integrations.temporal_ancestry import Ancestry
from tether._integrations.temporal_runs import (
    RunRefused,
    lineage,
    open_child,
    open_run,
    stopped,
    watch_controls,
)
from tether._integrations.temporal_task import CHILD_APART, call_key, run_of, task_of
from tether._journal import queue
from tether._journal.rows import DelegationRow
from tether._runtime.gateway import Context, replaced
from tether._runtime.handle import Handle
from tether._runtime.remote import owner_alive
from tether._runtime.state import ChildRuntime
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Agent, Tool, check_surface

STOPPED = "worker stopped"  # a hosted run's body's result when this worker stops


# Pauses between looks at a run refused for now, within one attempt (well inside a heartbeat
# timeout of a few seconds: tether's plugin sends no heartbeat of its own).
_AGAIN = (0.05, 0.1, 0.2, 0.4)


@dataclass(eq=False)
class _Hosted:
    """One workflow run's delegation, hosted here."""

    workflow_id: str
    run_id: str
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # this worker is stopping
    ctx: Context | None = None
    handle: Handle | None = None
    # A run another live process hosts: this worker makes its calls as a guest, in that
    # delegation (the journal's fence, epoch and lease gate them as any), for one activity.
    guest: ChildRuntime | None = None
    # Delegations hosted elsewhere whose control intents a guest's call watches while it
    # runs (its host's and their ancestors), each with the control sequence it had when the
    # guest judged the host.
    watched: tuple[tuple[str, int], ...] = ()
    # A child workflow's run: its parent's run, whose chain and ancestors' each of its calls
    # looks at first (a fence does not reach it where its tree's root is apart).
    parent_run: tuple[str, str] | None = None

    def live(self, sup: Supervisor) -> bool:
        return self.handle is not None and sup.runtime(self.handle.id) is not None


class Host:
    """The workflow runs whose delegations this worker process hosts."""

    def __init__(self, supervisor: Supervisor, tools: Sequence[Tool],
                 effects: Mapping[str, Effect] | None = None,
                 probes: Mapping[str, ActivityProbe] | None = None) -> None:
        if not isinstance(supervisor, Supervisor):
            raise UserError("tether.temporal.Plugin needs an open tether.Supervisor")
        self.sup = supervisor
        self.declared = check_surface(tools, "tether.temporal.Plugin(tools=...)")
        if any(not isinstance(t, Tool) for t in self.declared.values()):
            raise UserError("tether.temporal.Plugin(tools=...): tools only (a Temporal "
                            "workflow is the agent)")
        # The effect of an activity registered by someone else (a framework's model request
        # is READ_ONLY, say): EXTERNAL for any activity not named here.
        self.effects = dict(effects or {})
        for name, effect in self.effects.items():
            if not isinstance(name, str) or not isinstance(effect, Effect):
                raise UserError("tether.temporal.Plugin(effects=...): activity names to "
                                f"tether.Effect values, not {name!r}: {effect!r}")
            if name in self.declared:
                raise UserError(f"tether.temporal.Plugin: {name} is a tool, whose effect "
                                "its declaration gives; leave it out of effects")
        # The probe of an activity registered by someone else (a framework's tool call), with
        # the deadline its answers are judged against; without one, a call left in doubt
        # stays UNKNOWN, and its run's next attempt of it is refused until a person decides.
        self.probes = dict(probes or {})
        for name, probe in self.probes.items():
            if not isinstance(name, str) or not isinstance(probe, ActivityProbe):
                raise UserError("tether.temporal.Plugin(probes=...): activity names to "
                                f"tether.temporal.ActivityProbe values, not {name!r}: "
                                f"{probe!r}")
            if name in self.declared:
                raise UserError(f"tether.temporal.Plugin: {name} is a tool, whose probe its "
                                "declaration gives; leave it out of probes")
            if not self.effects.get(name, Effect.EXTERNAL).journaled:
                raise UserError(f"tether.temporal.Plugin: {name} is "
                                f"{self.effects[name].value}, which is never in doubt: it "
                                "needs no probe")
        # What the gateway calls: each activity as a proxy tool with its declared effect,
        # probe and deadline, forwarding to Temporal's chain; filled in by ``learn``.
        self.surface: dict[str, Tool | str] = {}
        self.runs: dict[tuple[str, str], _Hosted] = {}
        # The worker's client, which each hosted run's body watches the run with (the SDK offers one
        # to ``async def`` activities only); set as the worker is configured.
        self.client: temporalio.client.Client | None = None
        self.ancestry = Ancestry(supervisor)
        self._lock = asyncio.Lock()

    def learn(self, activities: Sequence[Callable[..., Any]]) -> None:
        """The worker's activities: a declared tool's proxy keeps its effect and probe; any
        other activity has the effect ``effects`` names (else EXTERNAL: fail closed, as
        everywhere in tether) and the probe ``probes`` names (else none)."""
        for fn in activities:
            # The SDK's private definition (within the pinned range, tested): it has no public
            # way to read an activity's registered name.
            defn = temporalio.activity._Definition.from_callable(fn)
            if defn is None:
                continue
            if defn.name is None:  # a dynamic activity: any name may come
                self.surface[UNRESTRICTED] = UNRESTRICTED
                continue
            declared = self.declared.get(defn.name)
            self.surface[defn.name] = (
                replaced(declared, forward) if isinstance(declared, Tool)
                else self._undeclared(defn.name))
        unknown = sorted(set(self.probes) - set(self.surface))
        if unknown:  # a dynamic activity's names get no probe
            raise UserError(f"tether.temporal.Plugin(probes=...): no activity {unknown[0]} "
                            "is registered on this worker (tether's plugin goes after the "
                            "plugins that register activities)")
        proxies = [t for t in self.surface.values() if isinstance(t, Tool)]
        for proxy in proxies:
            known = self.sup._known.get(proxy.name)
            if known is not None and (known.probe, known.effect, known.dispatch_deadline) != (
                    proxy.probe, proxy.effect, proxy.dispatch_deadline):
                # Whichever the supervisor kept would probe the other's calls.
                raise UserError(f"tether.temporal.Plugin: the supervisor knows a tool "
                                f"{proxy.name} with another effect, probe or deadline than "
                                "this worker's activity of that name")
        # Known to the supervisor before any run is opened here: recovering a dead worker's
        # run probes its calls in doubt with them, before this process delegates anything.
        self.sup._learn(proxies)

    def _undeclared(self, name: str) -> Tool:
        effect, probe = self.effects.get(name, Effect.EXTERNAL), self.probes.get(name)
        if probe is None:
            return Tool(name, effect, forward)
        return Tool(name, effect, forward, probe=probe.probe,
                    dispatch_deadline=probe.dispatch_deadline)

    def _tool(self, name: str) -> Tool:
        found = self.surface.get(name)
        if isinstance(found, Tool):
            return found
        if UNRESTRICTED in self.surface:
            return self._undeclared(name)
        raise refused(f"activity {name} is not registered with tether's plugin")

    async def call(self, next: temporalio.worker.ActivityInboundInterceptor,
                   input: temporalio.worker.ExecuteActivityInput) -> Any:
        info = temporalio.activity.info()
        if info.workflow_id is None or info.workflow_run_id is None:
            raise refused(f"activity {info.activity_type} has no workflow: tether mediates "
                           "the activities of workflows")
        tool = self._tool(info.activity_type)
        declared = self.declared.get(tool.name)
        try:
            kwargs = (tool_arguments(declared, input.args) if isinstance(declared, Tool)
                      else {"args": json_args(input.args)})
        except UserError as exc:
            raise refused(str(exc)) from None
        hosted = await self._hosted(info.workflow_id, info.workflow_run_id)
        assert hosted.ctx is not None
        # The call's place in its workflow (``call_key``): a retry or a re-run finds the
        # first call's record.
        client = self.client or temporalio.activity.client()
        hop = await self.ancestry.hop(client, info.workflow_id, info.workflow_run_id)
        key = call_key(hosted.ctx.task_id, tool.name, info.activity_id, hop)
        if hosted.parent_run is not None:
            # A stop of an ancestor is looked for before each call (one accepted during its
            # grace included): its fence may not reach this run.
            try:
                await self.ancestry.still_wanted(client, hosted.parent_run)
            except (RunRefused, Tampered) as exc:
                raise refused(str(exc)) from None
        token = PENDING.set(Pending(next, input))
        watch = None if hosted.guest is None else asyncio.create_task(
            watch_controls(self.sup, hosted.guest, hosted.watched))
        try:
            result = await hosted.ctx.call(tool, idempotency_key=key, **kwargs)
            # Committed before Temporal hears of the result: the receipt, or the replay's
            # event, is what a stop reading Temporal's history finds the call by.
            await self.sup.journal.flush()
            return result
        except ControlSignal as signal:
            why = f"{type(signal).__name__.lower()}: {signal}"
            if not await stopped(self.sup, hosted.ctx.delegation_id):
                # Its delegation ended without anyone's intent (its host stopped, or was
                # settled as gone), or an ancestor's fence reached it: a retry judges the run
                # again, and opens its next epoch or is refused.
                if self.runs.get((info.workflow_id, info.workflow_run_id)) is hosted:
                    del self.runs[(info.workflow_id, info.workflow_run_id)]
                raise refused(f"{why}; the run is judged again", BUSY) from None
            raise refused(why) from None
        except (UserError, KeyInUse) as exc:
            raise refused(str(exc)) from None
        except ToolRejected as exc:  # certainly not applied: Temporal may retry it
            raise ApplicationError(f"tether: {exc}", type="tether.ToolRejected") from exc
        except asyncio.CancelledError:
            if not temporalio.activity.is_cancelled():
                # Cut by a terminate, not by Temporal: the call is in doubt and probed; the
                # workflow is told, and never retries it. (Cancelled by Temporal, the call
                # runs on, shielded, and its receipt is kept.)
                try:
                    hosted.ctx.check()
                except ControlSignal as signal:
                    raise refused(f"{type(signal).__name__.lower()}: {signal}; the call's "
                                   "outcome is being reconciled") from None
            raise
        finally:
            PENDING.reset(token)
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    async def _hosted(self, workflow_id: str, run_id: str) -> _Hosted:
        found = self.runs.get((workflow_id, run_id))
        if found is not None and found.live(self.sup):
            return found
        # Asked of Temporal before the lock, which a slow answer would hold for every run.
        client = self.client or temporalio.activity.client()
        parent = (await self.ancestry.describe(client, workflow_id, run_id)).parent
        while parent is not None:
            parent = (await self.ancestry.describe(client, *parent)).parent
        # A passing refusal (an earlier run's delegation still ending, another process
        # opening the run) is looked at again within the attempt a few times before the
        # activity is told to retry: Temporal keeps only an activity's last failure, so a
        # stop that finds a run the journal holds no call of counts a third attempt as one
        # that may have run unseen.
        for pause in (*_AGAIN, None):
            async with self._lock:
                try:
                    return await self._open(workflow_id, run_id)
                except RunRefused as exc:
                    if not exc.retry or pause is None:
                        raise refused(str(exc), BUSY if exc.retry else REFUSED) from None
                except Tampered as exc:  # a person decides: a retry would be refused the same
                    raise refused(str(exc)) from None
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")  # the last pass returns or raises

    async def _open(self, workflow_id: str, run_id: str) -> _Hosted:
        """The run's delegation, hosted here (under ``self._lock``), or the host's, as its
        guest. A child workflow's run is a child delegation of its parent run's where that is
        hosted here (opened first if need be): a recall of the parent then fences the child's
        activities too, and its drain waits for them (one tree, in one process)."""
        sup = self.sup
        key = (workflow_id, run_id)
        found = self.runs.get(key)
        if found is not None and found.live(sup):
            return found
        client = self.client or temporalio.activity.client()
        run = await self.ancestry.describe(client, workflow_id, run_id)
        stop = await self.ancestry.stopped(client, workflow_id, run_id)
        if stop is not None:  # (this run's, or an earlier one's of its chain)
            raise RunRefused(f"workflow {workflow_id}: its run {run_of(stop)} was recalled or "
                             f"terminated (delegation {stop.id}, control sequence "
                             f"{stop.control_seq}); run {run_id} continues it")
        parent_key = run.parent
        parent, elsewhere = (None, None) if parent_key is None else await self._parent(
            client, workflow_id, parent_key)
        hosted = _Hosted(workflow_id, run_id, parent_run=parent_key)

        async def body(ctx: Context, workflow_id: str, run_id: str) -> str:
            hosted.ctx = ctx
            hosted.ready.set()
            try:
                status = await _until_closed(client, hosted)
                if status != STOPPED:
                    _detach(sup, ctx.delegation_id)
                return status
            finally:  # a long-lived worker keeps no record of the runs it served
                if self.runs.get(key) is hosted:
                    del self.runs[key]

        agent = Agent(f"temporal:{run.workflow_type}", body, tuple(self.surface.values()))
        self.runs[key] = hosted
        try:
            if parent is None or parent.handle is None:
                if elsewhere is not None:
                    # Noted (committed) on the parent's delegation before the child's opens:
                    # a stop of the parent lists it from there, closed since or not, and one
                    # that lists it too early was accepted before the child's first look.
                    await sup.journal.record_event(
                        sup.clock.wall(), CHILD_APART, elsewhere, workflow_id=workflow_id,
                        run_id=run_id)
                hosted.handle = await open_run(sup, workflow_id, run_id, agent)
            else:
                hosted.handle = await open_child(sup, parent.handle.id, workflow_id, run_id,
                                                 agent)
            await hosted.ready.wait()
        except RunRefused as exc:
            if exc.host is None:
                raise
            guest = self._guest(workflow_id, run_id, exc.host, agent)
            guest.watched = await lineage(sup, exc.host)
            guest.parent_run = parent_key
            return guest
        finally:
            if not hosted.ready.is_set() and self.runs.get(key) is hosted:
                del self.runs[key]
        return hosted

    async def _parent(self, client: temporalio.client.Client, workflow_id: str,
                      parent_key: tuple[str, str]) -> tuple[_Hosted | None, str | None]:
        """The parent run's delegation a child run opens under, hosted here (opened now if the
        parent runs and nobody hosts it); None where the child is a delegation of its own: its
        parent's is hosted by another live worker (one tree is one process: then its id
        second), or its parent's run has closed (an abandoned child goes on on its own, as in
        Temporal). Refused for a child of a run someone recalled or terminated."""
        sup = self.sup
        parent_id, parent_run = parent_key
        stop = await self.ancestry.stopped(client, parent_id, parent_run)
        if stop is not None:
            raise RunRefused(f"workflow {workflow_id} is a child of workflow {parent_id}, "
                             f"whose run {parent_run} was recalled or terminated (delegation "
                             f"{stop.id})")
        found = self.runs.get(parent_key)
        if found is not None and found.live(sup):
            return found, None
        described = await client.get_workflow_handle(parent_id, run_id=parent_run).describe()
        if described.status is not temporalio.client.WorkflowExecutionStatus.RUNNING:
            return None, None
        head = await sup.journal.peek(queue.task_head, task_of(parent_id))
        if head is not None and run_of(head) == parent_run and not head.fenced \
                and not head.state.terminal and head.owner_id != sup.owner_id \
                and await owner_alive(sup, head.owner_id):
            return None, head.id
        parent = await self._open(parent_id, parent_run)
        if parent.guest is not None:
            return None, parent.guest.id
        return parent, None

    def _guest(self, workflow_id: str, run_id: str, row: DelegationRow,
               agent: Agent) -> _Hosted:
        """A run another live process hosts: this activity's call is made here, as a guest
        in its delegation (a runtime of this call alone: the host drains the delegation)."""
        rt = ChildRuntime(row, agent, check_surface(agent.tools, agent.name))
        guest = _Hosted(workflow_id, run_id, guest=rt, ctx=Context(self.sup, rt))
        guest.ready.set()
        return guest

    async def close(self) -> None:
        """The worker stopped: each hosted run's delegation ends here without a fence, so
        that a later activity of its run, on another worker, continues at a new epoch."""
        for hosted in self.runs.values():
            hosted.stopped.set()
        handles = [s.handle for s in self.runs.values() if s.handle is not None]
        for handle in handles:
            with contextlib.suppress(Exception):
                await handle.wait()
        self.runs.clear()


def _detach(sup: Supervisor, delegation_id: str) -> None:
    """The run closed: its delegation ends now. A child workflow still running (Temporal's
    ABANDON) goes on on its own, as it does in Temporal, instead of keeping its parent's
    delegation, and so the parent's next run (continued as new, say), from its task."""
    rt = sup.runtime(delegation_id)
    if rt is None:
        return
    for child in [c for c in rt.children if c.run is not None and not c.run.done.done()]:
        rt.children.remove(child)
        child.parent = None  # a root here from now on: closing this process terminates it


async def _until_closed(client: temporalio.client.Client, hosted: _Hosted) -> str:
    """A hosted run's body: it lasts until its workflow run closes (its status then), or this worker
    stops (``worker stopped``)."""
    handle = client.get_workflow_handle(hosted.workflow_id, run_id=hosted.run_id)
    result = asyncio.ensure_future(handle.result(follow_runs=False))
    stopped = asyncio.ensure_future(hosted.stopped.wait())
    try:
        await asyncio.wait([result, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (result, stopped):
            waiter.cancel()
        await asyncio.gather(result, stopped, return_exceptions=True)
    if not result.done() or result.cancelled():
        return STOPPED
    status = (await handle.describe()).status
    return status.name if status is not None else "CLOSED"


class _Interceptor(temporalio.worker.Interceptor):
    def __init__(self, host: Host) -> None:
        self.host = host

    def intercept_activity(self, next: temporalio.worker.ActivityInboundInterceptor
                           ) -> temporalio.worker.ActivityInboundInterceptor:
        return _Inbound(next, self.host)


class _Inbound(temporalio.worker.ActivityInboundInterceptor):
    def __init__(self, next: temporalio.worker.ActivityInboundInterceptor, host: Host) -> None:
        super().__init__(next)
        self.host = host

    async def execute_activity(self, input: temporalio.worker.ExecuteActivityInput) -> Any:
        return await self.host.call(self.next, input)


class Plugin(temporalio.plugin.SimplePlugin):
    """tether on a Temporal worker: ``Worker(client, ..., plugins=[Plugin(sup, tools=[...])])``.

    Registers each tool as an activity of its name, and runs every activity of the worker
    through tether's gateway on ``supervisor``'s journal: a declared tool with its effect and
    probe, an activity named in ``effects`` with that effect (a framework's own activities:
    ``{"agent__support__model_request": Effect.READ_ONLY}``), any other as EXTERNAL; such an
    activity's probe, and the deadline it is judged against, is an ``ActivityProbe`` in
    ``probes``, else a call of it left in doubt stays UNKNOWN. Listed after the plugins that
    register activities."""

    def __init__(self, supervisor: Supervisor, *, tools: Sequence[Tool] = (),
                 effects: Mapping[str, Effect] | None = None,
                 probes: Mapping[str, ActivityProbe] | None = None) -> None:
        self.host = Host(supervisor, tools, effects, probes)
        declared = [activity(t) for t in self.host.declared.values() if isinstance(t, Tool)]
        super().__init__("tether.temporal", interceptors=[_Interceptor(self.host)],
                         activities=self._activities(declared), run_context=self._running)

    def configure_worker(self, config: temporalio.worker.WorkerConfig
                         ) -> temporalio.worker.WorkerConfig:
        self.host.client = config.get("client")
        return super().configure_worker(config)

    def _activities(self, declared: list[Callable[..., Awaitable[Any]]]
                    ) -> Callable[[Sequence[Callable[..., Any]] | None],
                                  Sequence[Callable[..., Any]]]:
        def configure(given: Sequence[Callable[..., Any]] | None) -> Sequence[Callable[..., Any]]:
            every = [*(given or ()), *declared]
            self.host.learn(every)
            return every

        return configure

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        sup = self.host.sup
        if not sup.is_open:
            raise UserError("tether.temporal.Plugin: the supervisor is not open: run the "
                            "worker inside 'async with Supervisor(...)'")
        if sup._recover_on_start and any(p in self.host.surface for p in self.host.probes):
            # The supervisor's recovery on start ran before these probes were known to it: a
            # dead worker's call of such an activity was left UNKNOWN, and the run's retry
            # would wait out its dispatch deadline. Probed now, before the first poll.
            await sup.recover()
        try:
            yield
        finally:
            await self.host.close()
