"""The simulator's journal: in memory, each operation one atomic step.

Every rule is decided by the same core functions ``tether._journal.ops`` uses, in the same
places: ``begin_action`` is ``judge_gate`` + ``decide_key`` + insert; ``finish_action`` is
``judge_receipt`` and, for a late receipt or a probe's answer, ``settle``; ``accept_control``
is the sequence compare-and-set, the epoch check, ``check_delegation_move``, the subtree
fence and the cancel-generation bump. Core functions are looked up on their modules at each
call, so a test can swap one for a broken one and watch the simulator catch it.

Each write gets a commit number (``Journal.seq``): the judge orders intents and fences by it,
never by clocks that may disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tether._core import model, outcome
from tether._core.documents import Acknowledgement, ControlIntent, NoEffectsReceipt
from tether._core.errors import (
    AlreadyFinished,
    IdempotencyConflict,
    InvalidTransition,
    KeyInUse,
    NotFound,
    StaleEpoch,
    StaleSequence,
)
from tether._core.model import ActionState, ControlKind, DelegationState, Effect
from tether._core.signing import Signed, TrustedKeys
from tether._core.verdict import JournalFacts
from tether._journal.rows import Begin
from tether._sim.world import CLOCK_TOLERANCE

_A = ActionState
_S = DelegationState


@dataclass(slots=True, eq=False)
class DRow:
    id: str
    task_id: str
    parent_id: str | None
    epoch: int
    attempt: int
    agent: str
    owner_id: str
    seq: int  # commit number of its insert
    state: DelegationState = _S.RUNNING
    fenced: bool = False
    control_seq: int = 0
    children: list[str] = field(default_factory=list)
    queued: bool = False
    claimed_by: str | None = None
    done: bool = False
    fence_seq: int | None = None  # commit number of the first fence that closed on it


@dataclass(slots=True, eq=False)
class ARow:
    id: str
    delegation_id: str
    ordinal: int
    tool: str
    effect: Effect
    key: str
    args_hash: str
    started_at: float
    deadline_at: float
    seq: int
    logical: str
    state: ActionState = _A.PENDING
    result: Any = None
    probed: bool = False
    asked_at: float | None = None  # when the last probe recorded was sent
    late: bool = False


@dataclass(slots=True, eq=False)
class Control:
    delegation_id: str
    seq: int
    kind: ControlKind
    signed: Signed
    accepted_at: float
    issuer: str
    commit: int


@dataclass(slots=True)
class Owner:
    id: str
    heartbeat_at: float
    lease_until: float | None


@dataclass(slots=True)
class Task:
    epoch: int = 0
    cancel_gen: int = 0


@dataclass(frozen=True, slots=True)
class NewAction:
    id: str
    delegation_id: str
    epoch: int
    ordinal: int
    tool: str
    effect: Effect
    args_hash: str
    key: str
    now: float
    deadline_at: float
    logical: str


class FenceRefused(Exception):
    """A child or an attempt refused: its parent is fenced or stale (I2, I10)."""


class Journal:
    def __init__(self, trusted: TrustedKeys) -> None:
        self.trusted = trusted
        self.seq = 0
        self.tasks: dict[str, Task] = {}
        self.rows: dict[str, DRow] = {}
        self.actions: dict[str, ARow] = {}
        self.by_key: dict[str, list[ARow]] = {}
        self.controls: dict[str, list[Control]] = {}
        self.owners: dict[str, Owner] = {}
        self.documents: list[tuple[str, int, str]] = []
        self.reads: dict[str, int] = {}  # READ_ONLY calls per delegation (I6: tools ran)
        self.notes: list[tuple[str, str]] = []  # notifications to deliver: (channel, payload)
        self.early: list[tuple[str, str, str]] = []  # stops settled with calls still open
        # Rules the simulator found missing, now in the code; a test removes one (see FIXES).
        self.fixes: frozenset[str] = frozenset(FIXES)

    def _commit(self) -> int:
        self.seq += 1
        return self.seq

    # -- owners ---------------------------------------------------------------------------
    def register_owner(self, owner_id: str, now: float, lease: float | None) -> None:
        self._commit()
        self.owners[owner_id] = Owner(owner_id, now, None if lease is None else now + lease)

    def heartbeat(self, owner_id: str, now: float) -> None:
        owner = self.owners.get(owner_id)
        if owner is not None:
            owner.heartbeat_at = now

    def renew_lease(self, owner_id: str, now: float, lease: float) -> bool:
        """Only a lease that has not run out is extended (queue.renew_lease)."""
        owner = self.owners.get(owner_id)
        if owner is None or (owner.lease_until is not None and owner.lease_until <= now):
            return False
        self._commit()
        owner.lease_until, owner.heartbeat_at = now + lease, now
        return True

    def _lease_of(self, owner_id: str) -> float | None:
        owner = self.owners.get(owner_id)
        return None if owner is None else owner.lease_until

    def owner_facts(self, owner_id: str) -> outcome.OwnerFacts | None:
        owner = self.owners.get(owner_id)
        if owner is None:
            return None
        return outcome.OwnerFacts(owner.heartbeat_at, owner.lease_until, False, None)

    # -- delegations ----------------------------------------------------------------------
    def get(self, delegation_id: str) -> DRow:
        row = self.rows.get(delegation_id)
        if row is None:
            raise NotFound(f"no delegation {delegation_id!r}")
        return row

    def create_root(self, did: str, task_id: str, agent: str, owner_id: str, now: float,
                    from_epoch: int | None = None) -> DRow:
        """A fresh task at epoch 0, or a re-delegation at epoch + 1 (compare-and-set)."""
        task = self.tasks.get(task_id)
        if from_epoch is not None:
            if task is None:
                raise NotFound(f"no task {task_id!r}")
            if task.epoch != from_epoch:
                raise StaleEpoch(task_id, from_epoch, task.epoch)
            task.epoch += 1
        elif task is not None:
            raise InvalidTransition(did, "exists", "created again")
        else:
            task = self.tasks[task_id] = Task()
        row = DRow(did, task_id, None, task.epoch, 1, agent, owner_id, self._commit(),
                   queued=True)
        self.rows[did] = row
        self.notes.append(("queued", ""))
        return row

    def create_child(self, did: str, task_id: str, agent: str, parent_id: str,
                     parent_epoch: int, owner_id: str, now: float) -> DRow:
        """A child under a parent neither fenced nor stale, nor of a lapsed lease (I2, I10):
        the same gate as an action intent, checked by the insert itself."""
        parent = self.get(parent_id)
        gate = outcome.judge_gate(
            fenced=parent.fenced, epoch=parent.epoch, task_epoch=self.tasks[parent.task_id].epoch,
            caller_epoch=parent_epoch, lease_until=self._lease_of(parent.owner_id), now=now)
        if gate is not outcome.Gate.OPEN:
            raise FenceRefused(gate.value)
        task = self.tasks.get(task_id)
        if task is None:
            task = self.tasks[task_id] = Task()
        else:  # a re-delegated parent starts its children again: same keys, next epoch
            task.epoch += 1
        row = DRow(did, task_id, parent_id, task.epoch, 1, agent, owner_id, self._commit())
        self.rows[did] = row
        parent.children.append(did)
        return row

    def create_attempt(self, did: str, retry_of: str, owner_id: str, now: float) -> DRow:
        """The next attempt of a failed one (ops._create_attempt): only if the failed attempt
        is FAILED, at its task's current epoch, with no successor yet, and its lease holds."""
        prior = self.get(retry_of)
        lease = self._lease_of(prior.owner_id)
        newer = any(r.task_id == prior.task_id and r.epoch == prior.epoch
                    and r.attempt > prior.attempt for r in self.rows.values())
        if (prior.state is not _S.FAILED or prior.epoch != self.tasks[prior.task_id].epoch
                or newer or (lease is not None and lease <= now)):
            raise InvalidTransition(prior.id, prior.state.value, "re-dispatched")
        if "attempt_fence" in self.fixes and prior.parent_id is not None:
            parent = self.get(prior.parent_id)
            gate = outcome.judge_gate(
                fenced=parent.fenced, epoch=parent.epoch,
                task_epoch=self.tasks[parent.task_id].epoch, caller_epoch=parent.epoch,
                lease_until=self._lease_of(parent.owner_id), now=now)
            if gate is not outcome.Gate.OPEN:
                raise InvalidTransition(prior.id, f"parent {gate.value}", "re-dispatched")
        row = DRow(did, prior.task_id, prior.parent_id, prior.epoch, prior.attempt + 1,
                   prior.agent, owner_id, self._commit())
        self.rows[did] = row
        if prior.parent_id is not None:
            self.rows[prior.parent_id].children.append(did)
        return row

    def subtree(self, root_id: str) -> list[DRow]:
        """Parents before children."""
        out = [self.get(root_id)]
        i = 0
        while i < len(out):
            out.extend(self.rows[c] for c in out[i].children)
            i += 1
        return out

    def set_state(self, delegation_id: str, new: DelegationState, now: float) -> DRow:
        row = self.get(delegation_id)
        if row.state is new:
            return row
        model.check_delegation_move(delegation_id, row.state, new)
        self._commit()
        if new.terminal and row.state in (_S.RECALLING, _S.TERMINATING):
            # A stop's report is final: none of the node's calls may still apply (I3, I8).
            open_calls = [a.id for a in self._actions_of(delegation_id)
                          if a.state in outcome.UNSETTLED]
            if open_calls:
                self.early.append((delegation_id, new.value, ", ".join(open_calls)))
        row.state = new
        if new.terminal:
            row.fenced = True
        return row

    def end_delegation(self, delegation_id: str, new: DelegationState,
                       now: float) -> list[ARow]:
        self.set_state(delegation_id, new, now)
        return [a for a in self._actions_of(delegation_id)
                if a.state in (_A.IN_DOUBT, _A.UNKNOWN)]

    def bump_cancel(self, task_id: str) -> int:
        self._commit()
        task = self.tasks[task_id]
        task.cancel_gen += 1
        return task.cancel_gen

    def cancel_generation(self, task_id: str) -> int:
        return self.tasks[task_id].cancel_gen

    def tools_ran(self, root_id: str) -> int:
        nodes = self.subtree(root_id)
        return (sum(len(self._actions_of(n.id)) + self.reads.get(n.id, 0) for n in nodes)
                + len(nodes) - 1)

    def latest_attempt(self, delegation_id: str) -> DRow:
        first = self.get(delegation_id)
        best = first
        for r in self.rows.values():
            if (r.task_id == first.task_id and r.epoch == first.epoch
                    and r.parent_id == first.parent_id and r.attempt > best.attempt):
                best = r
        return best

    def latest_root(self, task_id: str) -> DRow | None:
        """The first attempt of the task's newest epoch (its queue row)."""
        best: DRow | None = None
        for r in self.rows.values():
            if r.task_id == task_id and r.parent_id is None and (
                    best is None or r.epoch > best.epoch):
                best = r
        return best

    # -- the queue ------------------------------------------------------------------------
    def claim(self, owner_id: str, now: float, limit: int) -> list[DRow]:
        lease = self._lease_of(owner_id)
        if lease is None or lease <= now or limit <= 0:
            return []
        out = []
        for row in self.rows.values():
            if row.queued and row.claimed_by is None and not row.fenced:
                self._commit()
                row.owner_id = row.claimed_by = owner_id
                out.append(row)
                if len(out) == limit:
                    break
        return out

    def unclaim(self, delegation_id: str, owner_id: str) -> bool:
        row = self.get(delegation_id)
        if not (row.queued and row.claimed_by is None and row.fenced):
            return False
        self._commit()
        row.claimed_by, row.done = owner_id, True
        return True

    def queue_done(self, delegation_id: str) -> None:
        row = self.get(delegation_id)
        if not row.done:
            self._commit()
            row.done = True
            self.notes.append(("done", ""))

    # -- control --------------------------------------------------------------------------
    def sign_and_accept(self, delegation_id: str, sign: Any, issuer: str,
                        now: float) -> tuple[ControlIntent, Signed]:
        """Read the row, sign the intent built from it, verify, accept: one transaction."""
        signed: Signed = sign(self.get(delegation_id))
        intent = self.trusted.verify(signed, ControlIntent)
        self.accept_control(signed, intent, issuer, now)
        return intent, signed

    def accept_control(self, signed: Signed, intent: ControlIntent, issuer: str,
                       accepted_at: float) -> Control:
        """Sequence compare-and-set, epoch check, state move, subtree fence and cancel bump:
        one step (I2, I4, I10)."""
        row = self.get(intent.delegation_id)
        if intent.seq != row.control_seq + 1:
            raise StaleSequence(intent.delegation_id, intent.seq, row.control_seq)
        if intent.epoch != row.epoch:
            raise StaleEpoch(row.task_id, intent.epoch, row.epoch)
        target = intent.kind.target
        model.check_delegation_move(intent.delegation_id, row.state, target)
        commit = self._commit()
        row.control_seq, row.state, row.fenced = intent.seq, target, True
        self.tasks[row.task_id].cancel_gen += 1
        for node in self.subtree(row.id):
            if node.fence_seq is None:
                node.fence_seq = commit
            if node is not row:
                node.fenced = True
                if node.state in (_S.RUNNING, _S.RECALLING):
                    node.state = target
        control = Control(row.id, intent.seq, intent.kind, signed, accepted_at, issuer, commit)
        self.controls.setdefault(row.id, []).append(control)
        self.notes.append(("owner", row.owner_id))
        return control

    def controls_for_owner(self, owner_id: str) -> list[Control]:
        out: list[Control] = []
        for did, cs in self.controls.items():
            row = self.rows[did]
            if row.owner_id == owner_id and row.state in (_S.RECALLING, _S.TERMINATING):
                out.extend(c for c in cs if c.seq == row.control_seq)
        return out

    def record_ack(self, signed: Signed) -> None:
        doc = self.trusted.verify(signed, Acknowledgement)
        self._commit()
        self.documents.append((doc.delegation_id, doc.seq, doc.TYPE))

    def record_receipt(self, signed: Signed) -> None:
        doc = self.trusted.verify(signed, NoEffectsReceipt)
        self._commit()
        self.documents.append((doc.delegation_id, doc.seq, doc.TYPE))

    # -- actions --------------------------------------------------------------------------
    def begin_action(self, new: NewAction) -> tuple[Begin, str, Any]:
        """The write-ahead intent (I1) behind the fence (I2) with the Stripe rule (I7)."""
        row = self.get(new.delegation_id)
        gate = outcome.judge_gate(
            fenced=row.fenced, epoch=row.epoch, task_epoch=self.tasks[row.task_id].epoch,
            caller_epoch=new.epoch, lease_until=self._lease_of(row.owner_id), now=new.now)
        if gate is not outcome.Gate.OPEN:
            return Begin(gate.value), new.id, None
        prior = [outcome.PriorCall(a.id, a.tool, a.args_hash, a.state, a.result, a.deadline_at)
                 for a in self.by_key.get(new.key, ())]
        decision = outcome.decide_key(new.tool, new.args_hash, prior, new.now, CLOCK_TOLERANCE)
        found = decision.prior
        verdict = decision.verdict
        if verdict is outcome.KeyVerdict.CONFLICT:
            assert found is not None
            raise IdempotencyConflict(new.key, found.tool)
        if verdict is outcome.KeyVerdict.REPLAY:
            assert found is not None
            return Begin.REPLAY, found.action_id, found.result
        if verdict is outcome.KeyVerdict.WAIT:
            assert found is not None
            return Begin.WAIT, found.action_id, None
        if verdict is outcome.KeyVerdict.UNKNOWN:
            assert found is not None
            raise KeyInUse(new.key, found.action_id, found.state.value)
        action = ARow(new.id, new.delegation_id, new.ordinal, new.tool, new.effect, new.key,
                      new.args_hash, new.now, new.deadline_at, self._commit(), new.logical)
        self.actions[new.id] = action
        self.by_key.setdefault(new.key, []).append(action)
        return Begin.STARTED, new.id, None

    def read_event(self, delegation_id: str) -> None:
        self.reads[delegation_id] = self.reads.get(delegation_id, 0) + 1

    def finish_action(self, action_id: str, new: ActionState, now: float, result: Any = None,
                      probed: bool = False, asked_at: float | None = None) -> ActionState:
        """An executor's receipt, or (``probed``) a probe's answer. A fence refuses intents,
        never receipts: a late receipt is kept, flagged, and re-opens the accounting."""
        action = self.actions[action_id]
        old = action.state
        verdict = outcome.judge_receipt(old, new, from_probe=probed,
                                        fills_result=action.result is None and result is not None)
        if verdict is outcome.Receipt.IGNORE:
            return old
        late = verdict is outcome.Receipt.LATE
        self._commit()
        action.state = new
        if result is not None:
            action.result = result
        action.late = action.late or late
        action.probed = action.probed or probed
        if probed:
            action.asked_at = asked_at
        if late or probed:
            self.resettle(action.delegation_id, now)
        return new

    def resettle(self, delegation_id: str, now: float) -> None:
        """``ops.resettle``: the node, then its ancestors once it is settled."""
        row = self.get(delegation_id)
        new = outcome.settle(row.state, self._facts_of(delegation_id), row.state,
                             children_settled=self._children_settled(delegation_id))
        if new is not row.state:
            self.set_state(delegation_id, new, now)
        row = self.get(delegation_id)
        if row.parent_id is not None and row.state.terminal:
            self.resettle(row.parent_id, now)

    def _children_settled(self, delegation_id: str) -> bool:
        return all(r.state.terminal for r in self.rows.values() if r.parent_id == delegation_id)

    def mark_in_doubt(self, root_id: str) -> list[str]:
        ids = []
        for node in self.subtree(root_id):
            for a in self._actions_of(node.id):
                if a.state is _A.PENDING:
                    self._commit()
                    a.state = _A.IN_DOUBT
                    ids.append(a.id)
        return ids

    def action_in_doubt(self, action_id: str) -> bool:
        action = self.actions[action_id]
        if action.state is not _A.PENDING:
            return False
        self._commit()
        action.state = _A.IN_DOUBT
        return True

    def _actions_of(self, delegation_id: str) -> list[ARow]:
        return [a for a in self.actions.values() if a.delegation_id == delegation_id]

    def _facts_of(self, delegation_id: str) -> list[outcome.ActionFacts]:
        return [outcome.ActionFacts(a.state, a.probed) for a in self._actions_of(delegation_id)]

    def unsettled(self, root_id: str | None) -> list[ARow]:
        ids = None if root_id is None else {n.id for n in self.subtree(root_id)}
        return [a for a in self.actions.values() if a.state in (_A.IN_DOUBT, _A.UNKNOWN)
                and (ids is None or a.delegation_id in ids)]

    def facts(self, root_id: str) -> JournalFacts:
        root = self.get(root_id)
        ids = {n.id for n in self.subtree(root_id)}
        mine = [a for a in self.actions.values() if a.delegation_id in ids]
        return JournalFacts(
            root_id, root.control_seq,
            frozenset(a.id for a in mine if a.state is _A.PENDING),
            frozenset(a.id for a in mine if a.state in (_A.IN_DOUBT, _A.UNKNOWN)),
            sum(1 for a in mine if a.effect.side_effecting))

    def settle_subtree(self, root_id: str, fallback: DelegationState, now: float) -> None:
        """Every node, deepest first, to its settled state (reconcile.settle_subtree)."""
        for row in reversed(self.subtree(root_id)):
            row = self.get(row.id)
            new = outcome.settle(row.state, self._facts_of(row.id), fallback,
                                 children_settled=self._children_settled(row.id))
            if new is not row.state:
                self.set_state(row.id, new, now)

    def live(self) -> list[DRow]:
        return [r for r in self.rows.values() if not r.state.terminal]


__all__ = ["FIXES", "ARow", "AlreadyFinished", "Control", "DRow", "FenceRefused", "Journal",
           "NewAction", "Owner", "Task"]

# Rules of the journal and runtime that the simulator found missing (each defect is fixed in the
# code now); ``tether sim --without NAME`` removes one from the model to show what it prevents:
FIXES = {
    "attempt_fence": "ops._create_attempt forks a re-dispatched child under a parent that is "
                     "fenced: a recall or terminate of the parent bumps only the parent's "
                     "task's cancel generation, so the child's attempt runs after the stop",
    "queued_fenced": "Supervisor.recover skips a queued, unclaimed delegation even when it is "
                     "fenced: no worker will claim it, and if its issuer died before unclaim "
                     "nobody settles it, and remote.wait_queued never returns",
    "probe_time": "reconcile.probe_all judges a probe's answer at the time it came back: a "
                  "probe sent before the dispatch deadline and answered (or its process "
                  "resumed) after it is taken as final NOT_APPLIED, though the call may have "
                  "applied after the provider looked; judge at the time the probe was sent",
}
