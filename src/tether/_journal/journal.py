"""The async journal facade: the operations a supervisor, a worker, the shell and the console
run, over ``JournalAccess`` (how they reach the backend). A backend only runs operations in
transactions; the rules live in ``ops`` so that every backend enforces the same ones."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tether._core.chain import ROLLED_BACK, ChainVerdict
from tether._core.documents import (
    Acknowledgement,
    ControlIntent,
    KeyGrant,
    NoEffectsReceipt,
)
from tether._core.errors import ControlRefused, Tampered, UnknownKey
from tether._core.headmark import HeadMark
from tether._core.model import ActionState, DelegationState
from tether._core.report import ActionRecord
from tether._core.signing import Signed, SigningKey, TrustedKeys
from tether._core.trust import Registry
from tether._core.verdict import JournalFacts
from tether._journal import chainops, ops, queue, retention, triage, trustops
from tether._journal.access import DEFAULT_URL, JournalAccess, _bind
from tether._journal.rows import (
    BeginResult,
    ControlRow,
    DelegationRow,
    DocumentRow,
    EventRow,
    NewAction,
    NewDelegation,
    OwnerRow,
    QueueEntry,
    QueueProgress,
)

__all__ = ["DEFAULT_URL", "Journal"]

T = TypeVar("T")
_REREAD = 3  # registry re-reads of a chain check that failed while the registry changed
log = logging.getLogger("tether.journal")


def _refused(exc: ControlRefused, issuer: str, delegation_id: str | None = None) -> None:
    log.warning("intent refused: %s", exc, extra={
        "delegation": delegation_id, "issuer": issuer, "refusal": type(exc).__name__})


class Journal(JournalAccess):
    """Durable record of delegations, actions, control intents and events."""

    # -- owners and delegations -------------------------------------------------------------
    async def register_owner(self, owner: OwnerRow) -> None:
        await self._write(ops.register_owner, owner)

    def heartbeat(self, owner_id: str, now: float) -> None:
        self._post(ops.heartbeat, owner_id, now)

    async def owners(self) -> list[OwnerRow]:
        return await self._read(ops.owners)

    async def create_delegation(self, new: NewDelegation) -> DelegationRow:
        return await self._write(ops.create_delegation, new)

    async def get(self, delegation_id: str, *, urgent: bool = False) -> DelegationRow:
        """``urgent``: the read before a control intent, ahead of queued writes (SQLite's
        reads share the writer's queue)."""
        fut = self._runner.submit(_bind(ops.get_delegation, (delegation_id,), {}),
                                  write=False, urgent=urgent)
        assert fut is not None
        return await fut

    async def delegations(self, live_only: bool = False) -> list[DelegationRow]:
        return await self._read(ops.list_delegations, live_only)

    async def subtree(self, root_id: str) -> list[DelegationRow]:
        return await self._read(ops.subtree, root_id)

    async def kin(self, ids: list[str]) -> list[str]:
        """``ops.kin``: the delegations whose records a new attempt or epoch of these replays."""
        return await self._read(ops.kin, ids)

    async def set_state(self, delegation_id: str, state: DelegationState, now: float,
                        result: Any = None, error: str | None = None,
                        failure: str | None = None) -> DelegationRow:
        row = await self._move(delegation_id, ops.set_state, state, now, result, error,
                               failure)
        if state.terminal:
            self._persist()
        return row

    async def settle_tree(self, root_id: str, now: float,
                          verdict: Mapping[str, str | int] | None = None) -> None:
        """Every node of the subtree, deepest first, to its settled state, in one transaction;
        with the verdict of the drain or recovery that settles it, if any, in the same one:
        whoever reads the verdict (``drained``) finds the settle committed, and whoever finds
        the delegation settled reads why."""
        await self._move(root_id, ops.settle_tree, now, verdict)
        self._persist()

    async def end_delegation(self, delegation_id: str, state: DelegationState, now: float,
                             result: Any = None, error: str | None = None,
                             failure: str | None = None
                             ) -> tuple[DelegationRow, list[ActionRecord]]:
        ended = await self._move(delegation_id, ops.end_delegation, state, now, result,
                                 error, failure)
        self._persist()
        return ended

    async def work_of(self, delegation_id: str) -> Signed | None:
        return await self.peek(ops.work_of, delegation_id)

    async def bump_cancel(self, task_id: str, now: float, why: str) -> int:
        return await self._write(ops.bump_cancel, task_id, now, why)

    async def cancel_generation(self, task_id: str) -> int:
        return await self._read(ops.cancel_generation, task_id)

    async def tools_ran(self, root_id: str) -> int:
        return await self._read(ops.tools_ran, root_id)

    # -- control ------------------------------------------------------------------------------
    async def accept_control(self, signed: Signed, pins: TrustedKeys, issuer: str,
                             now: float | Callable[[], float], *, urgent: bool = False,
                             owner: str | None = None) -> tuple[ControlIntent, ControlRow]:
        """Verify the signature against the deployment's key registry as ``pins`` root it
        (I5), then CAS, move and fence, all in one transaction. Given a clock, ``now`` is read
        once the delegation's row is locked (``ops.accept_control``). ``urgent``: the fence
        skips the writes queued before it (``runner.Backlog``); only for a caller that knows
        none of them moves the delegation's tree (``moving``). ``owner``: only while the
        delegation still has this owner (``OwnerChanged``)."""

        def op(db: Any) -> tuple[ControlIntent, ControlRow]:
            intent = trustops.registry(db, pins).verify(signed, ControlIntent)
            return intent, ops.accept_control(db, signed, intent, issuer, now, owner)

        try:
            return await self._written(op, urgent)
        except ControlRefused as exc:
            _refused(exc, issuer)
            raise

    async def sign_and_accept(self, delegation_id: str,
                              make: Callable[[DelegationRow], Signed], pins: TrustedKeys,
                              issuer: str, now: float | Callable[[], float], *,
                              urgent: bool = False) -> tuple[ControlIntent, Signed]:
        """Read the delegation, sign the intent ``make`` builds from it (its epoch and next
        sequence number), verify it against the deployment's key registry as ``pins`` root
        it, and accept it: one transaction, one round trip. An untrusted signer changes
        nothing. ``urgent``: as for ``accept_control``."""

        def op(db: Any) -> tuple[ControlIntent, Signed]:
            signed = make(ops.get_delegation(db, delegation_id))
            intent = trustops.registry(db, pins).verify(signed, ControlIntent)
            ops.accept_control(db, signed, intent, issuer, now)
            return intent, signed

        try:
            return await self._written(op, urgent)
        except ControlRefused as exc:
            _refused(exc, issuer, delegation_id)
            raise

    # -- the key registry ---------------------------------------------------------------------
    async def registry(self, pins: TrustedKeys) -> Registry:
        """The keys this journal's registry trusts, as a configuration pinning ``pins`` reads
        it (read beside the writer: other processes' grants count at once)."""
        return await self.peek(trustops.registry, pins)

    async def genesis(self, signer: SigningKey, now: float) -> None:
        """Record ``signer`` as the journal's root key if none is recorded yet."""
        await self._write(trustops.genesis, signer, now)

    async def change_trust(self, signer: SigningKey, pins: TrustedKeys, op: str, key_id: str,
                           public: str, label: str, now: float) -> Registry:
        """Trust or revoke a key: an entry signed by ``signer``, accepted only if ``signer``
        is trusted by the registry."""
        grant = KeyGrant(op, key_id, public, label, now)
        if pins.memory is not None and all(m is not pins.memory for m in self._registry_memories):
            self._registry_memories.append(pins.memory)
        return await self._write(trustops.add, signer.sign(grant), grant, pins, now)

    async def controls_to_adopt(self, owner_id: str, after_id: int) -> list[ControlRow]:
        """Intents an owner must drain. SQLite commits in id order, so "after the last id seen"
        is exact and cheap; PostgreSQL assigns ids before commit, so there the owner's own
        delegations under recall or terminate are read instead."""
        if self._pg is None:
            return await self._read(ops.controls_after, after_id)
        return await self._read(queue.controls_for_owner, owner_id)

    async def controls(self, delegation_id: str) -> list[ControlRow]:
        return await self._read(ops.controls, delegation_id)

    async def controls_after(self, after_id: int) -> list[ControlRow]:
        return await self._read(ops.controls_after, after_id)

    async def last_control_id(self) -> int:
        return await self._read(ops.last_control_id)

    async def record_ack(self, signed: Signed, trusted: TrustedKeys, now: float,
                         receipt: Signed | None = None) -> None:
        """A drain's acknowledgement, with its no-effects receipt when it has one: one
        transaction, the acknowledgement first."""
        docs: list[tuple[Acknowledgement | NoEffectsReceipt, Signed]] = [
            (trusted.verify(signed, Acknowledgement), signed)]
        if receipt is not None:
            docs.append((trusted.verify(receipt, NoEffectsReceipt), receipt))

        def op(db: Any) -> None:
            for doc, body in docs:
                ops.record_document(db, doc.delegation_id, doc.seq, doc.TYPE, body, now)

        await self._write(op)

    async def documents(self, delegation_id: str) -> list[DocumentRow]:
        return await self._read(ops.documents, delegation_id)

    # -- actions ------------------------------------------------------------------------------
    async def begin_action(self, new: NewAction) -> BeginResult:
        return await self._write(ops.begin_action, new, self.clock_tolerance)

    def finish_action(self, action_id: str, outcome: ActionState, now: float, result: Any = None,
                      error: str | None = None) -> None:
        """A receipt. Not awaited: a receipt lost to a crash is recovered by reconciliation, so
        the write-ahead intent stays the only commit on an action's critical path."""
        self._post(ops.finish_action, action_id, outcome, now, result, error)

    async def settle_action(self, action_id: str, outcome: ActionState, now: float,
                            evidence: dict[str, Any], result: Any = None) -> ActionState:
        """A probe's verdict, with its evidence."""
        return await self._write(ops.finish_action, action_id, outcome, now, result,
                                 None, evidence)

    async def receipts_missing(self, root_id: str | None = None) -> list[ActionRecord]:
        return await self._read(ops.receipts_missing, root_id)

    async def settle_pending(self, action_id: str, now: float, why: str) -> bool:
        return await self._write(ops.action_in_doubt, action_id, now, why)

    async def mark_in_doubt(self, root_id: str, now: float) -> list[str]:
        return await self._write(ops.mark_in_doubt, root_id, now)

    async def action(self, action_id: str) -> ActionRecord:
        """One action as committed (read beside the writer: other processes' progress)."""
        return await self.peek(ops.get_action, action_id)

    async def actions(self, delegation_ids: list[str]) -> list[ActionRecord]:
        return await self._read(ops.actions, delegation_ids)

    async def unsettled(self, root_id: str | None = None) -> list[ActionRecord]:
        return await self._read(ops.unsettled_actions, root_id)

    async def facts(self, root_id: str) -> JournalFacts:
        return await self._read(ops.facts, root_id)

    def event(self, at: float, what: str, delegation_id: str | None = None,
              action_id: str | None = None, /, **detail: Any) -> None:
        self._post(ops.event, at, what, delegation_id, action_id, **detail)

    async def record_event(self, at: float, what: str, delegation_id: str,
                           **detail: Any) -> None:
        """An event committed before this returns (``event`` rides the next batch): one
        another process must find once this process goes on."""
        await self._write(ops.event, at, what, delegation_id, None, **detail)

    async def drained(self, delegation_id: str) -> bool:
        return await self.peek(ops.drained, delegation_id)

    async def last_verdict(self, delegation_id: str) -> dict[str, Any] | None:
        return await self._read(ops.last_verdict, delegation_id)

    async def report_rows(self, root_id: str) -> tuple[list[DelegationRow], list[ActionRecord],
                                                       dict[str, Any] | None]:
        """What a report is made of, in one read (one round trip; one snapshot on SQLite):
        the subtree's rows, their actions, the root's last verdict."""

        def op(db: Any) -> tuple[list[DelegationRow], list[ActionRecord], dict[str, Any] | None]:
            rows = ops.subtree(db, root_id)
            return rows, ops.actions(db, [r.id for r in rows]), ops.last_verdict(db, root_id)

        return await self._read(op)

    async def events(self, delegation_ids: list[str]) -> list[EventRow]:
        return await self._read(ops.events, delegation_ids)

    # -- a person's decisions (``_journal.resolutions``) ----------------------------------------
    async def resolve(self, signed: Signed, pins: TrustedKeys, now: float) -> ActionRecord:
        """Verify a signed Resolution against the journal's key registry as ``pins`` root it
        (I5, as for a control intent: a key that merely pins itself is not believed), then
        record it and re-settle, in one transaction."""
        from tether._core.resolution import Resolution, decode_resolution
        from tether._journal.resolutions import resolve_action

        tolerance = self.clock_tolerance

        def op(db: Any) -> tuple[Resolution, ActionRecord]:
            reg = trustops.registry(db, pins)
            if signed.key_id not in reg.keys:
                raise UnknownKey(reg.explain(signed.key_id))
            reg.keys.verify_bytes(signed)
            res = decode_resolution(signed.body)
            return res, resolve_action(db, signed, res, now, tolerance)

        res, action = await self._write(op)
        log.info("%s resolved as %s by %s", res.action_id, res.outcome.value, res.operator,
                 extra={"action": res.action_id, "delegation": res.delegation_id,
                        "outcome": res.outcome.value, "operator": res.operator,
                        "key_id": signed.key_id})
        return action

    async def resolutions(self, delegation_ids: list[str]) -> list[dict[str, Any]]:
        from tether._journal.resolutions import resolutions

        return await self._read(resolutions, delegation_ids)

    # -- the tamper-evident chain (``_core.chain``) -------------------------------------------
    async def chain_verdicts(self, delegation_ids: list[str], pins: TrustedKeys
                             ) -> list[ChainVerdict]:
        """Each delegation's records judged against its sealed chain, the seals against the
        journal's registry as ``pins`` root it, the head against the latest one the pins'
        configuration remembers (``pins.heads``: a rollback); read in one transaction."""

        own = self._sealer.signer
        witness = pins.heads
        seen: dict[str, HeadMark | None] = {}
        if witness is not None:
            # Taken before the read begins: each head remembered then had committed before
            # it, so the read sees it or a longer one (one noted while the read ran might be
            # newer than what it reads: no rollback, only a later commit).
            witness.refresh()
            seen = {d: witness.seen(d) for d in delegation_ids}
            self._reader_witness = witness

        def trusted(reg: Registry) -> Registry:
            if own is not None and own.key_id not in reg.keys:
                # A process believes its own seals (a worker whose key the registry does
                # not trust yet): nobody else can make them. `tether verify` still names them.
                reg = dataclasses.replace(reg, keys=reg.keys.plus(own.public))
            return reg

        wanted = set(delegation_ids)

        def op(db: Any) -> tuple[list[ChainVerdict], dict[str, HeadMark],
                                 tuple[str, int] | None]:
            reg = trustops.registry(db, pins)
            found = chainops.verdicts(db, delegation_ids, trusted(reg), seen, witness,
                                      self._connection())
            for _ in range(_REREAD):
                # At READ COMMITTED (PostgreSQL) a key trusted after the registry was read,
                # and a seal it made since, read as a seal by an unknown key: judged again
                # against the registry as it is now, for as long as it keeps changing.
                if all(v.ok for v in found):
                    break
                again = trustops.registry(db, pins)  # the same object while unchanged
                if again is reg or again == reg:
                    break
                reg = again
                found = chainops.verdicts(db, delegation_ids, trusted(reg), seen, witness,
                                      self._connection())
            if self._pg is None or witness is None:
                return found, {}, None
            # What this read accepted, placed in the server's log in the same transaction:
            # a reader that never writes remembers it once the log is on disk past it.
            token = self._connection()
            accepted = {d: m for d, m in witness.pending(token).items() if d in wanted}
            return found, accepted, db.log_position(flushed=False) if accepted else None

        verdicts, accepted, place = await self._read(op)
        self.placed(accepted, place)
        return verdicts

    async def epoch_gaps(self, delegation_ids: list[str]) -> dict[str, list[int]]:
        """``ops.epoch_gaps``: tasks of these delegations with an epoch deleted as a whole."""
        return await self._read(ops.epoch_gaps, delegation_ids)

    async def untampered(self, delegation_ids: list[str], pins: TrustedKeys,
                         doing: str) -> None:
        """Tampered, naming every record that fails, if any of these delegations' records
        fail verification: what reconciliation and re-delegation check before acting."""
        bad = [v for v in await self.chain_verdicts(delegation_ids, pins) if not v.ok]
        gaps = await self.epoch_gaps(delegation_ids)
        if not bad and not gaps:
            return
        named = {v.delegation_id: [p.record for p in v.problems] for v in bad}
        named.update({f"task {t}": [f"epoch {n} (deleted as a whole)" for n in missing]
                      for t, missing in gaps.items()})
        shown = "; ".join(f"{d}: {', '.join(recs)}" for d, recs in named.items())
        # A rollback leaves every record as it was sealed: what is wrong is said, not named.
        rolled = "".join(f"; {v.delegation_id} {p.problem}" for v in bad for p in v.problems
                         if p.problem.startswith(ROLLED_BACK))
        raise Tampered(f"refusing to {doing}: records of {len(named)} delegation(s) fail "
                       f"verification against their signed chain ({shown}){rolled}; run "
                       "'tether verify' to see each, and decide by hand", named)

    # -- the operator's triage (``_journal.triage``) --------------------------------------------
    async def page(self, query: triage.DelegationQuery) -> list[DelegationRow]:
        return await self._read(triage.page_delegations, query)

    async def find_actions(self, query: triage.ActionQuery
                           ) -> list[tuple[ActionRecord, str, str]]:
        return await self._read(triage.find_actions, query)

    async def count_actions(self, query: triage.ActionQuery) -> int:
        return await self._read(triage.count_actions, query)

    async def last_event_id(self) -> int:
        return await self.peek(triage.last_event_id)

    # -- retention (``_journal.retention``) -----------------------------------------------------
    async def roots(self, *, since: float | None, until: float | None, after: str | None,
                    limit: int, settled_only: bool = False) -> list[str]:
        return await self._read(lambda db: retention.roots(
            db, since=since, until=until, after=after, limit=limit, settled_only=settled_only))

    async def tree_records(self, root_id: str) -> list[dict[str, Any]]:
        return await self._read(retention.tree_records, root_id)

    async def prunable(self, root_ids: list[str], before: float, now: float) -> list[str]:
        """The roots of ``root_ids`` that may be pruned, each with every root whose tree goes
        with it (trees that share a task go together): what ``prune`` then takes, and an
        archive must hold."""

        def op(db: Any) -> list[str]:
            found: dict[str, None] = {}
            judged: set[str] = set()  # the ids of every group judged: each judged once
            for root in root_ids:
                if root in judged:
                    continue
                ids = retention.tree_prunable(db, root, before, now, self.clock_tolerance,
                                              judged)
                judged.add(root)
                if ids is not None:
                    found[root] = None
                    found.update(dict.fromkeys(sorted(retention.roots_of(db, ids))))
            return list(found)

        return await self._read(op)

    async def prune(self, root_ids: list[str], before: float, now: float,
                    archive: dict[str, Any] | None) -> dict[str, Any]:
        return await self._write(retention.prune, root_ids, before, now, archive,
                                 self.clock_tolerance)


    # -- workers ------------------------------------------------------------------------------
    async def renew_lease(self, owner_id: str, now: float | Callable[[], float],
                          lease: float, *, until: float | None = None,
                          on_server: bool = False) -> bool:
        """``now`` may be a clock, read when the renewal runs: one that waited for the
        journal to come back is judged at that time, never at the time it was asked.
        ``until``: a time on the runner's clock (the event loop's) after which the renewal,
        run late, writes nothing and answers False (its worker has given the lease up by
        then). ``on_server``: judged
        and written on the database server's clock where there is one, as everyone else
        judges a lease (``remote.judge_alive``), so a worker whose clock lags cannot renew
        a lease that ran out there."""
        clock = self._runner.monotonic

        def renew(db: Any) -> bool:
            if until is not None and clock() >= until:
                return False
            at = now() if callable(now) else now
            server = queue.server_time(db) if on_server else None
            return queue.renew_lease(db, owner_id, at if server is None else server, lease)

        return await self._write(renew)

    async def claim(self, owner_id: str, agents: tuple[str, ...], now: float,
                    limit: int) -> list[DelegationRow]:
        return await self._write(queue.claim, owner_id, agents, now, limit)

    async def unclaim(self, delegation_id: str, owner_id: str, now: float) -> bool:
        return await self._write(queue.unclaim, delegation_id, owner_id, now)

    async def queue_done(self, delegation_id: str, now: float) -> None:
        await self._write(queue.queue_done, delegation_id, now)
        self._persist()  # a worker finished it: a rollback to "unclaimed" must not run it again

    async def queue_entry(self, delegation_id: str) -> QueueEntry | None:
        return await self.peek(queue.queue_entry, delegation_id)

    async def latest_attempt(self, delegation_id: str) -> DelegationRow:
        return await self.peek(queue.latest_attempt, delegation_id)

    async def queue_progress(self, delegation_id: str) -> QueueProgress:
        return await self.peek(queue.progress, delegation_id)

    async def liveness(self, owner_id: str) -> tuple[OwnerRow | None, float | None]:
        return await self.peek(queue.liveness, owner_id)

    async def server_time(self) -> float | None:
        """The database server's clock (PostgreSQL), or None (SQLite: one host, one clock)."""
        return await self.peek(queue.server_time)
