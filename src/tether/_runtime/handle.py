"""The orchestrator's handle on one delegation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tether._core.errors import AlreadyFinished, DelegationError, InvalidTransition, UserError
from tether._core.model import ControlKind
from tether._core.report import Report
from tether._journal.rows import DelegationRow, NewDelegation
from tether._runtime.gateway import ChildRuntime, new_id

if TYPE_CHECKING:
    from tether._runtime.supervisor import Supervisor


class Handle:
    def __init__(self, supervisor: Supervisor, row: DelegationRow) -> None:
        self._sup = supervisor
        self.id = row.id
        self.task_id = row.task_id
        self.epoch = row.epoch
        self.attempt = row.attempt

    @classmethod
    def detached(cls, supervisor: Supervisor, delegation_id: str) -> Handle:
        """A handle known only by id; its fields fill in from the journal when used."""
        handle = cls.__new__(cls)
        handle._sup = supervisor
        handle.id = delegation_id
        handle.task_id = ""
        handle.epoch = -1
        handle.attempt = 0
        return handle

    def __repr__(self) -> str:
        return f"<tether.Handle {self.id} task={self.task_id} epoch={self.epoch}>"

    async def recall(self, grace: float, reason: str = "", *, seq: int | None = None) -> Report:
        """Stop new work; let in-flight actions finish within ``grace`` seconds; then account
        for every action. A delegation that already finished returns its report unchanged."""
        try:
            return await self._sup._control(self.id, ControlKind.RECALL, grace, reason, seq)
        except AlreadyFinished:
            return await self.report()

    async def terminate(self, reason: str = "", *, seq: int | None = None) -> Report:
        """Kill now; in-flight actions become IN_DOUBT and are probed."""
        try:
            return await self._sup._control(self.id, ControlKind.TERMINATE, None, reason, seq)
        except AlreadyFinished:
            return await self.report()

    async def wait(self) -> None:
        """Wait until the child's own code has ended (returned, raised or been stopped)."""
        rt = self._sup.runtime(self.id)
        if rt is None or rt.task is None:
            raise UserError(f"delegation {self.id} does not run in this process")
        await rt.task
        if rt.draining is not None:
            await rt.draining

    async def result(self) -> Any:
        """The child's return value; DelegationError if it failed or was stopped."""
        rt = self._sup.runtime(self.id)
        if rt is None or rt.task is None:
            raise UserError(f"delegation {self.id} does not run in this process")
        ok, value = await rt.task
        if ok:
            return value
        reason = type(value).__name__ if isinstance(value, BaseException) else str(value)
        raise DelegationError(self.id, self.task_id, self.attempt, f"{reason}: {value}") from value

    async def report(self) -> Report:
        return await self._sup.report(self.id)

    async def redelegate(self) -> Handle:
        """Run the same task again at epoch + 1. Only one caller can move a task from the epoch
        it saw (compare-and-set in the journal); the old child stays fenced."""
        sup = self._sup
        row = await sup.journal.get(self.id)
        if not (row.state.terminal or row.fenced):
            raise InvalidTransition(self.id, row.state.value, "re-delegated (recall it first)")
        rt = sup.runtime(self.id)
        if rt is None or row.parent_id is not None:
            raise UserError(f"delegation {self.id} is not a root delegation run by this process")
        new = await sup.journal.create_delegation(NewDelegation(
            id=new_id("d"), task_id=row.task_id, parent_id=None, attempt=row.attempt,
            agent=row.agent, surface=row.surface, args=row.args, owner_id=sup.owner_id,
            now=sup.clock.wall(), redelegate_from_epoch=self.epoch,
        ))
        return await sup._launch(ChildRuntime(new, rt.agent, rt.surface),
                                 row.args["args"], row.args["kwargs"])
