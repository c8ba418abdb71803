"""Adversarial review of the outcome model's races (issue 11): timings that the
compare-and-set journal writes did not yet cover. PostgreSQL interleavings are made
deterministic by holding a row lock from a third connection, as in test_pg_races."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
from psycopg import sql

import tether
from tether._journal import ops
from tether._journal.journal import Journal
from tether._journal.rows import Begin, NewAction, NewDelegation

from .conftest import PG_URL
from .test_pg_races import _blocked, _schema_of


def _action(id_: str, delegation: str, now: float) -> NewAction:
    return NewAction(
        id=id_, delegation_id=delegation, epoch=0, ordinal=0, tool="pay",
        effect=tether.Effect.EXTERNAL, args_json="{}", args_hash="h", idem_key="k1", now=now,
        deadline_at=now + 1.0)


def _delegation(id_: str, task: str) -> NewDelegation:
    return NewDelegation(id=id_, task_id=task, parent_id=None, attempt=1, agent="agent",
                         surface=("pay",), args={}, owner_id="o", now=1.0)


async def test_a_late_receipt_racing_a_new_use_of_the_freed_key_is_kept(pg_url: str) -> None:
    """A call judged NOT_APPLIED (its dispatch deadline passed) lands after all, and its
    executor's receipt arrives while another process begins a new call with the key that
    NOT_APPLIED freed. On SQLite the receipt sees the new call and is kept as a
    ``contradicting_receipt`` event for a person. On PostgreSQL the receipt checked for a
    live use of the key before the new call committed, then its write met the unique index
    of live keys: the write failed, and a receipt (posted, never awaited) vanished without
    a trace, leaving the journal saying NOT_APPLIED for a call that applied."""
    tag = uuid.uuid4().hex[:8]
    names = (f"r11_a_{tag}", f"r11_b_{tag}")
    ja = Journal(f"{pg_url}&application_name={names[0]}")
    jb = Journal(f"{pg_url}&application_name={names[1]}")
    await ja.open()
    await jb.open()
    try:
        await ja.create_delegation(_delegation("d1", "t1"))
        await ja.create_delegation(_delegation("d2", "t2"))
        await ja.begin_action(_action("a1", "d1", 2.0))
        await ja.mark_in_doubt("d1", 2.5)
        # The probe, past the call's deadline: final.
        assert await ja.settle_action("a1", tether.ActionState.NOT_APPLIED, 6.0,
                                      evidence={"probe": "not found"}) \
            is tether.ActionState.NOT_APPLIED
        with psycopg.connect(PG_URL) as holder:
            holder.execute(sql.SQL("SELECT id FROM {}.actions WHERE id = 'a1' FOR UPDATE")
                           .format(sql.Identifier(_schema_of(pg_url))))
            # Awaited here (Journal.finish_action posts it, and a failed post is silent).
            receipt = asyncio.ensure_future(ja._write(
                ops.finish_action, "a1", tether.ActionState.COMPLETED, 7.0, "paid"))
            await _blocked(names[:1], 1)  # the receipt is on its way to the row
            begin = asyncio.ensure_future(jb.begin_action(_action("a2", "d2", 7.5)))
            await _until_blocked_or_done(names, begin)
            holder.commit()
        result: Any = await asyncio.gather(receipt, begin, return_exceptions=True)
        assert not [r for r in result if isinstance(r, BaseException)], result
        [a1] = [a for a in await ja.actions(["d1"])]
        events = [e.kind for e in await ja.events(["d1"])]
        if result[1].status is Begin.STARTED:
            # The new call took the key first: the receipt is kept for a person.
            assert "contradicting_receipt" in events, events
            assert (await ja.get("d1")).state is tether.DelegationState.NEEDS_ATTENTION
        else:
            # The receipt re-opened the key first: the new call replays it, never runs.
            assert result[1].status is Begin.REPLAY, result[1]
            assert a1.state is tether.ActionState.COMPLETED and a1.late, a1
    finally:
        await jb.close()
        await ja.close()


async def _until_blocked_or_done(names: tuple[str, ...], fut: asyncio.Future[Any]) -> None:
    """Until ``fut`` is done or both named connections wait for a lock."""
    waiter = asyncio.ensure_future(_blocked(names, 2))
    await asyncio.wait({waiter, fut}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


class _At:
    """A clock that reads a fixed wall time (the instant a probe is sent)."""

    def __init__(self, wall: float) -> None:
        self._wall = wall

    def now(self) -> float:
        return self._wall

    def wall(self) -> float:
        return self._wall

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)


async def test_a_dispatch_deadline_is_judged_on_the_clock_it_was_written_on(
        pg_url: str) -> None:
    """A worker whose clock runs 2 s behind the journal server's is within what it tolerates
    (a quarter of its default 10 s lease). It begins a call to a tool that promises nothing
    applies more than 1 s after the intent, and the request is in the network. Half a second
    later (on the server's clock) an orchestrator whose clock is right presumes the worker
    gone and probes: "not found". The call can still apply for another half second, so the
    answer must stay "not applied yet"; judged against a deadline written on the worker's
    clock it is final NOT_APPLIED, which frees the key for a second payment."""
    from tether._runtime.reconcile import probe_all

    j = Journal(pg_url)
    await j.open()
    try:
        server = await j.server_time()
        assert server is not None
        await j.create_delegation(_delegation("d1", "t1"))
        worker_now = server - 2.0  # the worker's clock
        await j.begin_action(NewAction(
            id="a1", delegation_id="d1", epoch=0, ordinal=0, tool="pay",
            effect=tether.Effect.EXTERNAL, args_json="{}", args_hash="h", idem_key="k1",
            now=worker_now, deadline_at=worker_now + 1.0))
        await j.mark_in_doubt("d1", server + 0.5)

        async def pay(*, idempotency_key: str) -> str:
            return "paid"

        async def not_found(*, idempotency_key: str) -> tether.ProbeResult:
            return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"found": False})

        tool = tether.Tool("pay", tether.Effect.EXTERNAL, pay, not_found,
                           dispatch_deadline=1.0)
        [action] = await j.actions(["d1"])
        await probe_all(j, [action], {"pay": tool}, _At(server + 0.5), 5.0)
        [action] = await j.actions(["d1"])
        assert action.state is tether.ActionState.IN_DOUBT, action
        again = await j.begin_action(_action("a2", "d1", server + 0.6))
        assert again.status is not Begin.STARTED, again
    finally:
        await j.close()


async def test_recovery_on_a_row_read_before_anothers_intent_still_settles(
        sup: tether.Supervisor) -> None:
    """An orchestrator finds a delegation whose owner is gone (a poll of the queue, or
    ``recover``), and before its recovery's terminate is offered, another process's recall is
    accepted (``tether recall``, or a second orchestrator recovering the same delegation).
    Recovery offered sequence 1 on the row it had read and got ``StaleSequence``: the
    orchestrator waiting on the task was handed an internal race as its error, and nothing
    of its recovery (in doubt, probes, settle) ran. The delegation is fenced either way:
    recovery must carry on and settle it."""
    clock = sup.clock
    await sup.journal.create_delegation(NewDelegation(
        id="d1", task_id="t1", parent_id=None, attempt=1, agent="agent", surface=("pay",),
        args={}, owner_id="gone", now=clock.wall()))
    row = await sup.journal.get("d1")  # the recovering process's read
    recall = tether.ControlIntent(tether.ControlKind.RECALL, "d1", 0, 1, 5.0, "r", clock.wall())
    await sup.journal.accept_control(sup.keys.signer.sign(recall), sup.keys.trusted, "cli",
                                     clock.wall())
    report = await sup.recover_delegation(row, "owner is gone")
    assert report.outcome.terminal, report


async def test_settling_a_subtree_never_lands_a_judgement_on_stale_facts(
        journal_url: str) -> None:
    """A child ended with a call UNKNOWN (a probe could not tell). Its owner's accounting
    settles the subtree: it reads the facts (UNKNOWN: NEEDS_ATTENTION), and before it writes,
    another process's later probe finds the call COMPLETED and re-settles the delegation
    RECONCILED. The accounting's NEEDS_ATTENTION, judged on the facts it had read, then
    overwrote RECONCILED (a move the model allows for a contradicting receipt): the
    delegation asked a person to look at a call whose outcome is known, and no later fact
    would ever move it back. Whatever the order, it must end RECONCILED."""
    from tether._runtime.reconcile import settle_subtree

    j, other = Journal(journal_url), Journal(journal_url)  # two processes
    await j.open()
    await other.open()
    try:
        await j.create_delegation(_delegation("d1", "t1"))
        await j.begin_action(_action("a1", "d1", 2.0))
        await j.mark_in_doubt("d1", 2.5)
        await j.settle_action("a1", tether.ActionState.UNKNOWN, 3.0,
                              evidence={"probe": "UNKNOWN", "reason": "timed out"})
        await j.end_delegation("d1", tether.DelegationState.SUCCEEDED, 4.0, result=1)
        assert (await j.get("d1")).state is tether.DelegationState.SUCCEEDED

        applied = False

        async def later_probe() -> None:
            nonlocal applied
            if not applied:
                applied = True
                await other.settle_action("a1", tether.ActionState.COMPLETED, 5.0,
                                          evidence={"probe": "COMPLETED"})

        # The other process's probe commits right after this one's accounting read the facts.
        read = j.actions

        async def actions_then_probe(ids: list[str]) -> Any:
            found = await read(ids)
            await later_probe()
            return found

        j.actions = actions_then_probe  # type: ignore[method-assign,assignment]
        await settle_subtree(j, "d1", _At(4.5), tether.DelegationState.TERMINATED)
        await later_probe()  # where the accounting read nothing in between: after it
        row = await j.get("d1")
        [a1] = await j.actions(["d1"])
        assert a1.state is tether.ActionState.COMPLETED
        assert row.state is tether.DelegationState.RECONCILED, row.state
    finally:
        await other.close()
        await j.close()
