"""The accounting of a supervisor: the tool calls of this process still running, the re-probes
scheduled for calls that may still apply, and recovery of delegations whose owner is gone.

It holds that state for its supervisor and reaches the rest (journal, keys, background tasks)
through ``ports.Accounts``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tether._core import drain
from tether._core.documents import ControlIntent
from tether._core.errors import (
    InvalidTransition,
    KeyInUse,
    NotFound,
    OwnerChanged,
    StaleSequence,
    Tampered,
)
from tether._core.model import ControlKind, DelegationState
from tether._core.outcome import PriorCall, final_at, holds_key, probe_again
from tether._core.report import ActionRecord, Report
from tether._core.verdict import Verdict
from tether._journal.rows import DelegationRow
from tether._runtime.clock import first_of
from tether._runtime.declared import HOW
from tether._runtime.logs import logger
from tether._runtime.reconcile import build_report, deadline_of, probe_all, settle_subtree
from tether._runtime.remote import owner_alive, settle_unclaimed
from tether._runtime.tools import Tool

if TYPE_CHECKING:
    from tether._runtime import ports


log = logger("supervisor")


class Accounting:
    def __init__(self, sup: ports.Accounts, tools: Mapping[str, Tool]) -> None:
        self._sup = sup
        self._tools = tools  # the supervisor's, as it learns more: probes find them here
        # Every tool call of this process still running, by action id, whether or not its
        # delegation is still tracked: a call left running after a recall's grace window must
        # still record its receipt.
        self._calls: dict[str, asyncio.Task[Any]] = {}
        self._deadlines: dict[str, float] = {}  # the dispatch deadline of each call in _calls
        self._rechecks: set[str] = set()  # roots with a re-probe scheduled
        self._refusals: dict[str, str] = {}  # the current recovery's: delegation -> why
        self.undeclared: set[str] = set()  # names of tools asked for that nobody declared

    async def _probe(self, actions: list[ActionRecord]) -> None:
        """Probe ``actions`` with the tools this supervisor knows. A call of a tool nobody
        declared to this process stays UNKNOWN: said once per tool, in one line, naming how
        to declare it (a silent NEEDS_ATTENTION would look like the probe's own answer)."""
        sup = self._sup
        for name in sorted({a.tool for a in actions} - set(self._tools) - self.undeclared):
            self.undeclared.add(name)
            log.warning("no tool named %r is declared to this process, so its calls in doubt "
                        "stay UNKNOWN: %s", name, HOW, extra={"tool": name})
        await probe_all(sup.journal, actions, self._tools, sup.clock, sup.policy.probe_timeout,
                        sup.telemetry.probed, tolerance=sup.policy.clock_tolerance)

    def track_call(self, action_id: str, task: asyncio.Task[Any], deadline_at: float) -> None:
        self._calls[action_id] = task
        self._deadlines[action_id] = deadline_at
        task.add_done_callback(lambda _: self._forget_call(action_id))

    def _forget_call(self, action_id: str) -> None:
        self._calls.pop(action_id, None)
        self._deadlines.pop(action_id, None)

    async def await_call(self, action_id: str, key: str) -> None:
        """Wait until an earlier action with idempotency key ``key`` has an outcome that lets
        a new call with the key decide (replay, run again, or fail): at most until the earlier
        call's dispatch deadline (plus the clock tolerance: another process's clock wrote it),
        after which a probe's answer is final."""
        sup = self._sup
        tolerance = sup.policy.clock_tolerance
        while True:
            action = await sup.journal.action(action_id)
            deadline = deadline_of(action, self._tools)
            final = final_at(deadline, tolerance)
            now = sup.clock.wall()
            if now >= final and self._probe_again(action):
                # Past its deadline nothing can apply any more: the next probe is final (also
                # for an UNKNOWN whose probe failed while the call could still apply). Its
                # answer is a fact, recorded even if this caller stops waiting meanwhile (an
                # ``asyncio.timeout`` around the call): the probe is this process's work.
                await asyncio.shield(sup.spawn(self._probe([action])))
                action = await sup.journal.action(action_id)
            if not holds_key(PriorCall(action.id, action.tool, "", action.state,
                                       deadline_at=deadline), now, tolerance):
                return  # the journal decides again: replay, run, or an UNKNOWN's KeyInUse
            if now >= final:
                raise KeyInUse(key, action_id, action.state.value)
            task = self._calls.get(action_id)
            # This process runs it: its receipt is posted before the task ends. Otherwise
            # another process's progress is polled. Either way, at most until the deadline.
            waits = [task] if task is not None else [sup.wake(sup.control_poll)]
            await first_of(sup.clock, min(final - now, sup.policy.lease), *waits)
            if task is not None and task.done():
                await sup.journal.flush()

    def _probe_again(self, action: ActionRecord) -> bool:
        tool = self._tools.get(action.tool)
        evidence = action.evidence or {}
        # When the last probe was sent; evidence written before it was kept has only the
        # time it answered.
        asked_at = evidence.get("asked_at", evidence.get("probed_at"))
        return probe_again(action.state, deadline_at=deadline_of(action, self._tools),
                           asked_at=asked_at if isinstance(asked_at, int | float) else None,
                           tolerance=self._sup.policy.clock_tolerance,
                           can_probe=tool is not None and tool.probe is not None)

    async def settle_here(self, root_id: str, kind: ControlKind, *, seq: int | None = None,
                          reason: str = "") -> Report:
        """A control intent for a delegation this process owns but no longer tracks: its code
        ended, calls it left running may not have. A terminate cuts them now. ``seq``: the
        intent the verdict answers (None: every one before it)."""
        sup = self._sup
        rows = await sup.journal.subtree(root_id)
        for action in await sup.journal.actions([r.id for r in rows]):
            task = self._calls.get(action.id)
            if kind is ControlKind.TERMINATE and task is not None:
                task.cancel()
        terminate = kind is ControlKind.TERMINATE
        return await self.conclude(
            root_id, kind.settled, in_doubt=terminate,
            verdict=Verdict.TERMINATE if terminate else Verdict.RECALLED_CLEAN,
            reason=reason or f"{kind.value.lower()} of a delegation whose code had ended",
            seq=seq)

    async def let_calls_finish(self) -> None:
        """Calls still running (left to finish after a recall's grace window, or by a lost
        lease) get a bounded while to record their receipts; whatever is still running then is
        declared in doubt, so that the next supervisor on the journal probes it."""
        sup = self._sup
        running = [t for t in self._calls.values() if not t.done()]
        if running:
            # Past the last deadline nothing they do can apply any more: no reason to wait.
            last = max(self._deadlines.values(), default=0.0) - sup.clock.wall()
            bound = min(sup.policy.ack_timeout + sup.policy.probe_timeout, max(0.0, last))
            await first_of(sup.clock, bound, asyncio.gather(*running, return_exceptions=True))
        left = [a for a, t in self._calls.items() if not t.done()]
        with contextlib.suppress(Exception):  # a lost journal: recovery still finds them
            for action_id in left:
                await sup.journal.settle_pending(action_id, sup.clock.wall(),
                                                 "its supervisor closed while it ran")
            await sup.journal.flush()

    async def conclude(self, root_id: str, fallback: DelegationState, *, in_doubt: bool,
                       verdict: Verdict | None, reason: str = "",
                       seq: int | None = None) -> Report:
        """The end of every settling (a drain, a stop of ended code, a recovery): calls left
        running declared in doubt (``in_doubt``), the subtree accounted for, the verdict
        journaled (a drain's names the newest intent it answers, ``seq``), all of it
        committed, and the report read back."""
        sup = self._sup
        if in_doubt:
            await sup.journal.mark_in_doubt(root_id, sup.clock.wall())
        await self.account(root_id, fallback, verdict, reason, seq)
        await sup.journal.flush()
        return await build_report(sup.journal, root_id)

    async def account(self, root_id: str, fallback: DelegationState,
                      verdict: Verdict | None = None, reason: str = "",
                      seq: int | None = None) -> None:
        """Probe what is in doubt, settle the subtree (with the verdict, if any), and keep
        checking in the background what may still apply (``drain.recheck_at``) until it is
        final."""
        sup = self._sup
        # A read queues behind every receipt posted before it and answers once its batch
        # committed: it reads them, committed, without a flush first.
        doubtful = await sup.journal.unsettled(root_id)
        if doubtful:
            await self._probe(doubtful)
        # The verdict commits with the settle, in one transaction: whoever finds the
        # delegation settled (a terminate from another process builds its report then) reads
        # why, and whoever finds the verdict (``drained``) finds the settle done.
        await settle_subtree(sup.journal, root_id, sup.clock, fallback, verdict, reason, seq)
        await self._recheck_later(root_id, fallback)

    async def _recheck_later(self, root_id: str, fallback: DelegationState) -> None:
        sup = self._sup
        open_calls = [a for a in await sup.journal.unsettled(root_id) if self._probe_again(a)]
        at = drain.recheck_at((deadline_of(a, self._tools) for a in open_calls),
                              sup.clock.wall(), sup.policy.clock_tolerance)
        if at is not None and sup.is_open and root_id not in self._rechecks:
            self._rechecks.add(root_id)
            sup.spawn(self._recheck(root_id, fallback, at))

    async def _recheck(self, root_id: str, fallback: DelegationState, at: float) -> None:
        try:
            await self._sup.clock.sleep(at - self._sup.clock.wall())
        finally:
            self._rechecks.discard(root_id)
        if self._sup.presumed_dead():
            # Its lease ran out, or its clock was found off the server's: it judges nothing
            # any more; whoever reconciles its delegations probes them.
            return
        await self.account(root_id, fallback)

    async def recover(self, delegation_id: str | None = None,
                      refused: dict[str, str] | None = None) -> list[Report]:
        """``Supervisor.recover``: delegations whose owner is dead, then actions in doubt.
        Those left alone because their records fail their chain go into ``refused``."""
        sup = self._sup
        self._refusals = refused if refused is not None else {}
        if delegation_id is not None:  # named by a person: a refusal is their answer
            with contextlib.suppress(NotFound):  # an unknown id has nothing to reconcile
                tree = [r.id for r in await sup.journal.subtree(delegation_id)]
                await sup.journal.untampered(tree, sup.keys.trusted,
                                             f"reconcile {delegation_id}")
        live = await sup.journal.delegations(live_only=True)
        by_id = {r.id: r for r in live}
        reports = []
        for row in live:
            if sup.runtime(row.id) is not None or (row.parent_id in by_id):
                continue
            if delegation_id is not None and row.id != delegation_id:
                continue
            if not await owner_alive(sup, row.owner_id):
                if await self._refused(row.id):
                    continue
                entry = await sup.journal.queue_entry(row.id)
                if entry is not None and entry.claimed_by is None:
                    # Queued: it waits for a worker, whoever queued it; unless it was fenced
                    # before any worker claimed it, when nothing ran and it is settled here.
                    if row.fenced:
                        never = await settle_unclaimed(sup, row.id, ControlKind.RECALL
                                                       if row.state is DelegationState.RECALLING
                                                       else ControlKind.TERMINATE)
                        if never is not None:
                            reports.append(never)
                    continue
                why = f"owner {row.owner_id} is gone"
                try:
                    reports.append(await self.recover_delegation(row, why, verified=True))
                except OwnerChanged:
                    continue  # a worker claimed it since it was listed: that worker runs it
        for lost in await sup.journal.receipts_missing(delegation_id):
            # Its delegation ended without its receipt (the disk refused it): in doubt now.
            if sup.runtime(lost.delegation_id) is None and lost.id not in self._calls:
                await sup.journal.settle_pending(lost.id, sup.clock.wall(),
                                                 "its receipt was never recorded")
        doubtful = [a for a in await sup.journal.unsettled(delegation_id)
                    if sup.runtime(a.delegation_id) is None and a.id not in self._calls]
        # Delegations in the journal's order, never a set's: that would follow the process's
        # string hashing, and a simulated trial would not replay from its seed.
        tampered = {d: await self._refused(d)
                    for d in dict.fromkeys(a.delegation_id for a in doubtful)}
        doubtful = [a for a in doubtful if not tampered[a.delegation_id]]
        if doubtful:
            await self._probe(doubtful)
            for root in dict.fromkeys(a.delegation_id for a in doubtful):
                row = await sup.journal.get(root)
                await settle_subtree(sup.journal, root, sup.clock, row.state)
                await self._recheck_later(root, row.state)
                if all(r.delegation_id != root for r in reports):
                    reports.append(await build_report(sup.journal, root))
        return reports

    async def _refused(self, delegation_id: str) -> bool:
        """Whether the records of ``delegation_id`` (and its subtree) fail their chain: then
        recovery leaves it alone, says so, and a person decides (``tether verify``)."""
        sup = self._sup
        try:
            await sup.journal.untampered([r.id for r in await sup.journal.subtree(
                delegation_id)], sup.keys.trusted, f"reconcile {delegation_id}")
        except Tampered as exc:
            log.error("%s", exc, extra={"delegation": delegation_id})
            sup.journal.event(sup.clock.wall(), "reconcile_refused", delegation_id, None,
                              why=str(exc))
            self._refusals[delegation_id] = str(exc)
            return True
        return False

    async def recover_delegation(self, row: DelegationRow, reason: str, *,
                                 verified: bool = False) -> Report:
        """Settle a delegation nobody here runs and whose owner is gone (or cannot settle it):
        terminate it in the journal if it still runs, then probe and settle its calls. Not if
        its records fail their chain (or were rolled back past what this configuration saw):
        ``Tampered``, and a person decides, whichever path got here (``verified``: the caller
        has just checked)."""
        sup = self._sup
        if not verified:
            await sup.journal.untampered([r.id for r in await sup.journal.subtree(row.id)],
                                         sup.keys.trusted, f"reconcile {row.id}")
        if not row.state.terminal and await sup.journal.drained(row.id):
            # Its owner drained it before going away, leaving calls in doubt: finish the
            # accounting, without a second verdict that would hide the first.
            return await self.conclude(row.id, ControlKind.TERMINATE.settled, in_doubt=True,
                                       verdict=None)
        gone = row.owner_id  # judged gone by the caller: a worker's claim since hands it on
        while row.state is DelegationState.RUNNING:
            intent = ControlIntent(ControlKind.TERMINATE, row.id, row.epoch, row.control_seq + 1,
                                   None, f"recovery: {reason}", sup.clock.wall(),
                                   recovery=True)
            try:
                await sup.journal.accept_control(sup.keys.signer.sign(intent),
                                                 sup.keys.trusted, sup.owner_id,
                                                 sup.clock.wall, owner=gone)
            except (StaleSequence, InvalidTransition):
                # The row was read before another process moved it (its recall, a second
                # recovery, the child's own end): it is fenced or ended all the same, so the
                # recovery goes on with what it holds now, never hands the race to its caller.
                row = await sup.journal.get(row.id)
            else:
                break
        report = await self.conclude(row.id, ControlKind.TERMINATE.settled, in_doubt=True,
                                     verdict=Verdict.RECOVERED, reason=reason)
        log.warning("recovered %s: %s; settled %s", row.id, reason, report.outcome.value,
                    extra={"delegation": row.id, "outcome": report.outcome.value,
                           "verdict": Verdict.RECOVERED.value})
        return report
