"""The orchestrator's handle on one delegated task, across its attempts."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from tether._core.errors import AlreadyFinished, DelegationError, InvalidTransition, UserError
from tether._core.model import ControlKind, DelegationState
from tether._core.report import Report
from tether._core.waiting import Interrupted
from tether._journal.rows import DelegationRow, NewDelegation
from tether._runtime.arguments import child_payload
from tether._runtime.attempts import result_of
from tether._runtime.remote import queued_result, wait_queued
from tether._runtime.state import ChildRuntime, TaskRun, new_id
from tether._runtime.tools import OutputCodec

if TYPE_CHECKING:
    from tether._runtime import ports


_NO_ANSWER: Any = object()


def _with_answers(row: DelegationRow, resume: Any) -> dict[str, Any]:
    """The arguments a re-delegation runs with: the task's, and for an interrupted task the
    answers (its agent's ``resume`` keyword), journaled with them. Only an INTERRUPTED task
    waits: another's result shaped like questions is a result (a task whose probe left a call
    UNKNOWN is NEEDS_ATTENTION; re-delegated, a graph asks its questions again)."""
    asked = Interrupted.from_json(row.result) \
        if row.state is DelegationState.INTERRUPTED else None
    if resume is _NO_ANSWER:
        if asked is not None:
            raise UserError(f"task {row.task_id} waits for input: redelegate(resume=answer)")
        return dict(row.args)
    if asked is None:
        raise UserError(f"task {row.task_id} does not wait for input: redelegate() without "
                        "resume")
    kwargs = {**row.args["kwargs"], "resume": asked.answers(resume)}
    return child_payload(row.args["args"], kwargs, f"the answer to {row.task_id}")


class Handle:
    """``id``, ``attempt`` and the control methods follow the task's current attempt: a
    re-dispatched child is a fresh delegation, and the handle moves on to it."""

    def __init__(self, supervisor: ports.Handles, row: DelegationRow,
                 run: TaskRun | None = None, *, queued: bool = False,
                 output: OutputCodec | None = None) -> None:
        self._sup = supervisor
        self._row = row
        self._run = run
        self._queued = queued  # run by whichever worker claims it, not by this process
        self._first_id = row.id  # a queued task's queue key; its attempts may move on
        self._output = output  # rebuilds a queued task's structured output from its JSON

    @classmethod
    def for_run(cls, supervisor: ports.Handles, run: TaskRun) -> Handle:
        """A handle on a task this process runs, as its first attempt was launched."""
        return cls(supervisor, run.attempts[0].row, run)

    @classmethod
    def detached(cls, supervisor: ports.Handles, delegation_id: str) -> Handle:
        """A handle known only by id (say, from ``tether ls``), for control and reports."""
        handle = cls.__new__(cls)
        handle._sup, handle._run, handle._queued = supervisor, None, False
        handle._output = None
        handle._first_id = delegation_id
        handle._row = DelegationRow(delegation_id, "", None, -1, 0, "", (), None, "",
                                    DelegationState.RUNNING, False, 0, 0.0, 0.0, None, None)
        return handle

    @property
    def _current(self) -> DelegationRow:
        return self._run.current.row if self._run is not None else self._row

    @property
    def id(self) -> str:
        return self._current.id

    @property
    def task_id(self) -> str:
        return self._current.task_id

    @property
    def epoch(self) -> int:
        return self._current.epoch

    @property
    def attempt(self) -> int:
        return self._current.attempt

    @property
    def attempts(self) -> list[str]:
        """Delegation ids of every attempt forked so far, first to last."""
        return [rt.id for rt in self._run.attempts] if self._run else [self.id]

    def __repr__(self) -> str:
        return f"<tether.Handle {self.id} task={self.task_id} attempt={self.attempt}>"

    async def _stop(self, kind: ControlKind, grace: float | None, reason: str,
                    seq: int | None) -> Report:
        target = self.id
        if await self._is_queued():  # a worker may have re-dispatched it: stop the newest
            self._row = await self._sup.journal.latest_attempt(self._row.id)
            target = self._row.id
        try:
            return await self._sup.issue_control(target, kind, grace, reason, seq)
        except AlreadyFinished:
            # Between attempts nothing runs, yet the request must stop a re-dispatch, whoever
            # drives it (this process or another): the journal's cancel generation tells it.
            await self._cancel_gap(f"{kind.value.lower()}: {reason}", target)
            # A re-dispatch driven elsewhere may have forked before the request landed (a
            # local one re-checks the generation after its fork).
            latest = await self._sup.journal.latest_attempt(target)
            if (self._run is None and latest.id != target and not latest.state.terminal
                    and seq is None):
                # A re-dispatch forked before the request landed: stop the new attempt too.
                with contextlib.suppress(AlreadyFinished):
                    return await self._sup.issue_control(latest.id, kind, grace, reason, None)
            return await self.report()

    async def _cancel_gap(self, why: str, target: str | None = None) -> None:
        if self._run is not None and self._run.done.done():
            return
        row = await self._sup.journal.get(target or self.id)
        await self._sup.journal.bump_cancel(row.task_id, self._sup.clock.wall(), why)
        if self._run is not None:
            self._run.cut_short.set()

    async def recall(self, grace: float, reason: str = "", *, seq: int | None = None) -> Report:
        """Stop new work; let in-flight actions finish within ``grace`` seconds; then account
        for every action. A delegation that already finished returns its report unchanged."""
        return await self._stop(ControlKind.RECALL, grace, reason, seq)

    async def terminate(self, reason: str = "", *, seq: int | None = None) -> Report:
        """Kill now; in-flight actions become IN_DOUBT and are probed."""
        return await self._stop(ControlKind.TERMINATE, None, reason, seq)

    async def cancel(self, reason: str = "") -> Report:
        """Terminate the current attempt if it runs, and in any case stop any re-dispatch."""
        await self._cancel_gap(f"cancel: {reason}")
        return await self._stop(ControlKind.TERMINATE, None, reason, None)

    async def _is_queued(self) -> bool:
        """A handle from ``handle_for`` learns from the journal whether its task was queued."""
        if not self._queued and self._run is None:
            self._queued = await self._sup.journal.queue_entry(self._first_id) is not None
        return self._queued

    def _local(self) -> TaskRun:
        if self._run is None:
            raise UserError(f"delegation {self.id} does not run in this process")
        return self._run

    async def wait(self) -> None:
        """Wait until the task's last attempt has ended and been accounted for."""
        if await self._is_queued():
            self._row = await wait_queued(self._sup, self._first_id)
            return
        run = self._local()
        await asyncio.wait([run.done])
        if run.current.draining is not None:
            await asyncio.gather(run.current.draining, return_exceptions=True)

    async def result(self) -> Any:
        """The last attempt's result, unchanged (a ``Partial`` for a salvaged cut stream), or
        for a framework's structured output the value rebuilt from its stored JSON;
        DelegationError if the task failed or was stopped. A queued task's result is the JSON
        its worker recorded, rebuilt the same way when this handle came from ``delegate``
        (a handle from ``handle_for`` does not know the agent: it gives the JSON)."""
        if await self._is_queued():
            row = await wait_queued(self._sup, self._first_id)
            value = queued_result(row)
            if self._output is None or row.state is not DelegationState.SUCCEEDED:
                return value
            try:
                return self._output.load(value)
            except UserError as exc:  # the agent here declares types its worker's did not
                raise DelegationError(row.id, row.task_id, row.attempt,
                                      f"UserError: the result of {row.agent} cannot be "
                                      f"rebuilt: {exc}") from None
        run = self._local()
        ok, value = await asyncio.shield(run.done)
        return result_of(ok, value, run.current)

    async def report(self) -> Report:
        return await self._sup.report(self.id)

    async def redelegate(self, *, resume: Any = _NO_ANSWER) -> Handle:
        """Run the same task again at epoch + 1. Only one caller can move a task from the epoch
        it saw (compare-and-set in the journal); the old child stays fenced. A task that ended
        INTERRUPTED (waiting for input) is run on with ``resume``, the answer: the value for
        its one question, or a mapping from question ids to answers."""
        sup = self._sup
        row = await sup.journal.get(self.id)
        if not (row.state.terminal or row.fenced):
            raise InvalidTransition(self.id, row.state.value, "re-delegated (recall it first)")
        args = _with_answers(row, resume)
        # The new epoch replays completed calls by their idempotency keys and trusts what the
        # old ones' records say (every epoch of the task, and of its children's tasks): never
        # on records that fail their chain (Tampered).
        await sup.journal.untampered(await sup.journal.kin([self.id]), sup.keys.trusted,
                                     f"re-delegate {self.id}")
        if await self._is_queued():
            new = await sup.journal.create_delegation(sup.sign_work(NewDelegation(
                id=new_id("d"), task_id=row.task_id, parent_id=None, attempt=row.attempt,
                agent=row.agent, surface=row.surface, args=args, owner_id=sup.owner_id,
                now=sup.clock.wall(), redelegate_from_epoch=row.epoch, model=row.model,
                queued=True)))
            return Handle(sup, new, queued=True, output=self._output)
        rt = self._run.current if self._run is not None else sup.runtime(self.id)
        if rt is None or row.parent_id is not None:
            raise UserError(f"delegation {self.id} is not a root delegation run by this process")
        new = await sup.journal.create_delegation(NewDelegation(
            id=new_id("d"), task_id=row.task_id, parent_id=None, attempt=row.attempt,
            agent=row.agent, surface=row.surface, args=args, owner_id=sup.owner_id,
            now=sup.clock.wall(), redelegate_from_epoch=self.epoch, model=row.model,
        ))
        policy = rt.run.policy if rt.run else sup.redispatch
        run = await sup.launch(ChildRuntime(new, rt.agent, rt.surface), args["args"],
                               args["kwargs"], policy)
        return Handle.for_run(sup, run)

