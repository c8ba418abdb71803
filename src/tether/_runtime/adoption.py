"""Intents other processes wrote for this process's children (``tether recall`` from a shell,
a worker's supervisor elsewhere), and this owner's heartbeat: the supervisor's watch loop.

An intent another process wrote is acted on only if it is signed by a key the deployment
trusts and names the very row it is attached to; a refused row is journaled once and never
acted on (docs/security.md).
"""

from __future__ import annotations

from tether._core.documents import ControlIntent
from tether._core.errors import ClockSkew, ControlRefused, JournalError, TetherError
from tether._core.model import ControlKind
from tether._core.trust import bound
from tether._journal.rows import ControlRow
from tether._runtime.clockcheck import check_clock
from tether._runtime.draining import cut_in
from tether._runtime.logs import logger
from tether._runtime.ports import Adopts
from tether._runtime.remote import settle_unclaimed
from tether._runtime.state import ChildRuntime

log = logger("supervisor")


class Adoption:
    def __init__(self, sup: Adopts) -> None:
        self._sup = sup
        self.last_control = 0  # the newest control row seen
        self._refused: set[int] = set()  # control rows refused (journaled once)
        self._untracked: set[int] = set()  # control rows acted on, or handed on

    async def watch(self) -> None:
        """Learn of control intents written by other processes and keep this owner's
        heartbeat. Real time: this is a poll loop, not a deadline."""
        sup = self._sup
        beats = 0
        every = max(1, int(sup.policy.lease / 3 / sup.control_poll))
        # An intent on one of this owner's delegations; kept if it comes during a read.
        with sup.bells.listening(sup.owner_id) as bell:
            while True:
                await bell.wait(sup.control_poll)
                if sup.presumed_dead():
                    continue  # whoever reconciles our delegations settles them, not us
                try:
                    rows = await sup.journal.controls_to_adopt(sup.owner_id, self.last_control)
                except JournalError:
                    continue  # the journal is away longer than it reconnects for: poll again
                for row in rows:
                    rt = sup.runtime(row.delegation_id)
                    if row.issuer != sup.owner_id and rt is not None:
                        try:
                            admitted = await self.admit(rt, row)
                        except TetherError as exc:
                            # Trust could not be decided (the configuration's registry.json is
                            # unreadable, say): this row is judged again at the next poll, and
                            # the loop, with its heartbeat, goes on.
                            log.error("cannot judge control row %d: %s", row.id, exc,
                                      extra={"delegation": row.delegation_id})
                            break
                        if admitted:
                            self.adopt(rt, row)
                            self._untracked.add(row.id)  # drained here, never settled again
                    elif row.issuer != sup.owner_id and row.id not in self._untracked:
                        # No drain runs for it here (it ended with calls left running, or nothing
                        # was ever run): if this process owns it, it settles it as for its own
                        # intent, a terminate cutting those calls.
                        self._untracked.add(row.id)
                        sup.spawn(self.settle_untracked(row))
                    self.last_control = max(self.last_control, row.id)
                else:
                    # Kept only while a poll can list the row again (PostgreSQL lists the newest
                    # intent of each delegation under recall; SQLite only rows after the last):
                    # a long-lived process forgets each one it is done with.
                    self._untracked &= {row.id for row in rows}
                beats += 1
                if beats % every == 0:
                    sup.journal.heartbeat(sup.owner_id, sup.clock.wall())
                    await self._recheck_clock()

    async def _recheck_clock(self) -> None:
        """At each heartbeat: a clock that drifted off the server's (or was set wrong) since
        this process started stops it, as a lost lease stops a worker: its children stop, and
        whoever reconciles its delegations settles them on clocks that can be trusted."""
        sup = self._sup
        try:
            await check_clock(sup.journal, sup.clock, sup.policy.clock_tolerance / 2,
                              f"orchestrator {sup.owner_id} stopped")
        except ClockSkew as exc:
            log.error("%s", exc, extra={"owner": sup.owner_id, "offset": exc.offset})
            sup.journal.event(sup.clock.wall(), "clock_skew", None, None,
                              owner=sup.owner_id, offset=exc.offset, limit=exc.limit)
            sup.abandon()
        except JournalError:
            pass  # the journal is away: checked again at the next heartbeat

    async def latest(self, rt: ChildRuntime) -> None:
        """Drain ``rt`` for the newest intent on it, if that intent is admitted."""
        controls = await self._sup.journal.controls(rt.id)
        if controls and await self.admit(rt, controls[-1]):
            self.adopt(rt, controls[-1])

    async def admit(self, rt: ChildRuntime, row: ControlRow) -> bool:
        """Whether to act on a control row another process wrote: signed by a key the
        deployment trusts, and naming this very row (delegation, epoch, sequence, kind)."""
        return await self._admitted(rt.id, rt.row.epoch, row)

    async def _admitted(self, delegation_id: str, epoch: int, row: ControlRow) -> bool:
        if row.id in self._refused:
            return False
        sup = self._sup
        try:
            intent = (await sup.current_trust()).verify(row.signed, ControlIntent)
            bound(intent, row.delegation_id, row.seq, row.kind, epoch)
        except ControlRefused as exc:
            self._refused.add(row.id)
            sup.journal.event(sup.clock.wall(), "control_refused", delegation_id, None,
                              row=row.id, seq=row.seq, error=str(exc))
            return False
        return True

    async def settle_untracked(self, row: ControlRow) -> None:
        """Another process's intent for a delegation this process no longer tracks: if it
        owns it (its drain ended with calls left running, or no worker claimed it), it settles
        it here as for its own intent, once the intent is admitted; a terminate cuts the
        calls still running."""
        sup = self._sup
        target = await sup.journal.get(row.delegation_id)
        if target.owner_id != sup.owner_id or target.state.terminal or \
                sup.runtime(target.id) is not None:
            return
        if await sup.journal.drained(target.id):  # its newest intent has its verdict already
            return
        if not await self._admitted(target.id, target.epoch, row):
            return
        entry = await sup.journal.queue_entry(target.id)
        if entry is not None and entry.claimed_by != sup.owner_id:
            # Queued: settled here only if no one took it off the queue first (a worker that
            # claimed it drains it; the issuer may have settled it). One this worker claimed
            # and ran is its own to settle, as any other it owns.
            await settle_unclaimed(sup, target.id, row.kind)
            return
        await sup.settle_here(target.id, row.kind)

    def adopt(self, rt: ChildRuntime, row: ControlRow) -> None:
        """Drain for an intent another process wrote. Its acceptance time is wall-clock; the
        grace window runs on ``clock.now()``, so it is converted, not taken as is."""
        sup = self._sup
        if rt.draining is None:
            elapsed = max(0.0, sup.clock.wall() - row.accepted_at)
            sup.start_drain(rt, row.signed, sup.clock.now() - elapsed)
        elif row.kind is ControlKind.TERMINATE:  # a recall's drain is under way
            sup.spawn(cut_in(sup, rt, row.seq))
