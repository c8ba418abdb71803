"""Writers in different processes racing on one delegation row (PostgreSQL at READ COMMITTED).

SQLite serializes writers, so these interleavings exist only on PostgreSQL: two transactions
read the same row, then update it one after the other. Each transition must be a
compare-and-set on the state it was judged against, or the second writer silently overwrites
the first (a recall accepted for a delegation that had just ended, which then nobody drains).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import tether
from tether._journal import ops
from tether._journal.journal import Journal
from tether._journal.rows import Begin, NewAction, NewDelegation
from tether.errors import AlreadyFinished, InvalidTransition, StaleSequence
from tether.protocol import ControlIntent, ControlKind, Signed, SigningKey, TrustedKeys

from .conftest import PG_URL
from .journal_helpers import pay_action, root_delegation

KEY = SigningKey.generate()
TRUSTED = TrustedKeys([KEY.public])


def _schema_of(url: str) -> str:
    return url.split("schema=")[1].split("&")[0]


async def _blocked(names: tuple[str, ...], expect: int) -> None:
    """Until ``expect`` of the named connections wait for a lock (a condition, not a sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20.0
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = ANY(%s) "
                "AND cardinality(pg_blocking_pids(pid)) > 0", (list(names),)).fetchone()
            assert row is not None
            if int(row[0]) >= expect:
                return
            assert loop.time() < deadline, "the writers never reached the locked row"
            await asyncio.sleep(0.01)


async def _race(url: str, first: Any, second: Any, *, table: str = "delegations",
                row: str = "d1", setup: Any = None,
                release: Any = None) -> tuple[Journal, list[Any]]:
    """Run ``first(journal_a)`` and ``second(journal_b)`` so that both have read the row
    before either writes it: a third connection holds the row lock until both wait on it.
    ``first`` queues for the lock before ``second`` does, so it is granted the lock first."""
    tag = uuid.uuid4().hex[:8]
    names = (f"race_a_{tag}", f"race_b_{tag}")
    ja = Journal(f"{url}&application_name={names[0]}")
    jb = Journal(f"{url}&application_name={names[1]}")
    await ja.open()
    await jb.open()
    await ja.genesis(KEY, 0.0)  # KEY roots the journal's key registry
    await ja.create_delegation(NewDelegation(
        id="d1", task_id="t1", parent_id=None, attempt=1, agent="agent", surface=("pay",),
        args={}, owner_id="o", now=1.0))
    if setup is not None:
        await setup(ja)
    schema = _schema_of(url)
    with psycopg.connect(PG_URL) as holder:  # not autocommit: the lock lasts until commit
        holder.execute(sql.SQL("SELECT id FROM {}.{} WHERE id = %s FOR UPDATE")
                       .format(sql.Identifier(schema), sql.Identifier(table)), (row,))
        a: Awaitable[Any] = asyncio.ensure_future(first(ja))
        await _blocked(names[:1], 1)
        b: Awaitable[Any] = asyncio.ensure_future(second(jb))
        await _blocked(names, 2)
        if release is not None:
            release()  # what happens while both wait, before the lock is released
        holder.commit()
    results = list(await asyncio.gather(a, b, return_exceptions=True))
    await jb.close()
    return ja, results


def _recall() -> Signed:
    return KEY.sign(ControlIntent(ControlKind.RECALL, "d1", 0, 1, 5.0, "r", 3.0))


async def test_a_recall_and_the_childs_own_end_cannot_both_win(pg_url: str) -> None:
    """The child ends (SUCCEEDED) while another process's recall is accepted: exactly one
    wins, and the row says which. Both winning left the delegation RECALLING with its owner
    believing it had ended: a recall nobody drained."""
    ja, (ended, accepted) = await _race(
        pg_url,
        lambda j: j.end_delegation("d1", tether.DelegationState.SUCCEEDED, 4.0, result=1),
        lambda j: j.accept_control(_recall(), TRUSTED, "cli", 4.0))
    try:
        row = await ja.get("d1")
        controls = await ja.controls("d1")
        winners = [r for r in (ended, accepted) if not isinstance(r, BaseException)]
        assert len(winners) == 1, (ended, accepted)
        if isinstance(accepted, BaseException):
            assert isinstance(accepted, AlreadyFinished), accepted
            assert row.state is tether.DelegationState.SUCCEEDED and controls == []
        else:
            assert isinstance(ended, InvalidTransition), ended
            assert row.state is tether.DelegationState.RECALLING and len(controls) == 1
    finally:
        await ja.close()


async def test_a_fence_is_stamped_once_it_holds_the_row(pg_url: str) -> None:
    """Found by `tether chaos` (cancel_in_delay, PostgreSQL): another process's recall read
    its clock, then queued on the row behind an intent that committed first; the journal then
    said the intent began after the fence. The fence's time is read once it holds the row, so
    an intent that committed ahead of it is never later than it."""
    wall = {"now": 4.0}  # the recall's process reads 4.0 as it sends the intent

    def moves_on() -> None:
        wall["now"] = 6.0  # ... and 6.0 by the time the row is its own

    ja, (begun, accepted) = await _race(
        pg_url,
        lambda j: j.begin_action(pay_action("a1", "d1", 5.0)),
        lambda j: j.accept_control(_recall(), TRUSTED, "cli", lambda: wall["now"]),
        release=moves_on)
    try:
        assert not isinstance(begun, BaseException) and begun.status is Begin.STARTED, begun
        assert not isinstance(accepted, BaseException), accepted
        (fence,) = await ja.controls("d1")
        (action,) = await ja.actions(["d1"])
        assert fence.accepted_at == 6.0
        assert action.started_at <= fence.accepted_at
    finally:
        await ja.close()


async def test_two_ends_of_one_delegation_cannot_both_win(pg_url: str) -> None:
    """Two writers ending one delegation differently (its owner, and a recovery that found
    the owner gone): one state, judged against what the row held when it was written."""
    ja, (one, two) = await _race(
        pg_url,
        lambda j: j.end_delegation("d1", tether.DelegationState.SUCCEEDED, 4.0, result=1),
        lambda j: j.end_delegation("d1", tether.DelegationState.FAILED, 4.0, error="x"))
    try:
        row = await ja.get("d1")
        winners = [r for r in (one, two) if not isinstance(r, BaseException)]
        assert len(winners) == 1, (one, two)
        loser = one if isinstance(one, BaseException) else two
        assert isinstance(loser, AlreadyFinished), loser
        assert row.state is winners[0][0].state
    finally:
        await ja.close()


@pytest.mark.parametrize("kinds", [("RECALL", "TERMINATE"), ("TERMINATE", "RECALL")])
async def test_racing_intents_one_accepted_the_other_told_the_sequence(
        pg_url: str, kinds: tuple[str, str]) -> None:
    """Two processes offer sequence 1 at once: one is accepted, the other is refused with
    the current sequence (I4), never both accepted."""
    def intent(kind: str) -> Signed:
        k = ControlKind(kind)
        return KEY.sign(ControlIntent(k, "d1", 0, 1, 5.0 if k is ControlKind.RECALL
                                             else None, "r", 3.0))

    ja, results = await _race(
        pg_url,
        lambda j: j.accept_control(intent(kinds[0]), TRUSTED, "a", 4.0),
        lambda j: j.accept_control(intent(kinds[1]), TRUSTED, "b", 4.0))
    try:
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(refused) == 1, results
        assert isinstance(refused[0], StaleSequence), refused[0]
        assert len(await ja.controls("d1")) == 1
    finally:
        await ja.close()


async def _in_doubt(j: Journal) -> None:
    await j.begin_action(NewAction(
        id="a1", delegation_id="d1", epoch=0, ordinal=0, tool="pay",
        effect=tether.Effect.EXTERNAL, args_json="{}", args_hash="h", idem_key="k1", now=2.0,
        deadline_at=3.0))
    await j.mark_in_doubt("d1", 2.5)


async def _receipt(j: Journal) -> None:
    j.finish_action("a1", tether.ActionState.COMPLETED, 5.0, result="paid")
    await j.flush()


@pytest.mark.parametrize("probe_first", [True, False])
async def test_a_receipt_racing_a_probe_is_never_lost(pg_url: str, probe_first: bool) -> None:
    """A probe answers "not applied" (past the call's deadline) while the executor's receipt
    says it completed, from two processes at once. The receipt is a fact: whichever write
    takes the row first, the action ends COMPLETED. Before, a probe that wrote first made the
    receipt's compare-and-set match nothing, and the receipt vanished without a trace."""
    async def probe(j: Journal) -> tether.ActionState:
        return await j.settle_action("a1", tether.ActionState.NOT_APPLIED, 6.0,
                                     evidence={"probe": "not found"})

    first, second = (probe, _receipt) if probe_first else (_receipt, probe)
    ja, results = await _race(pg_url, first, second, table="actions", row="a1",
                              setup=_in_doubt)
    try:
        assert not [r for r in results if isinstance(r, BaseException)], results
        [action] = await ja.actions(["d1"])
        assert action.state is tether.ActionState.COMPLETED, action
        told = results[0] if probe_first else results[1]
        # The probe's caller is told what the row holds when it returned, never a write that
        # did not happen.
        assert told in (tether.ActionState.NOT_APPLIED, tether.ActionState.COMPLETED)
        if not probe_first:
            assert told is tether.ActionState.COMPLETED
    finally:
        await ja.close()


async def test_a_late_receipt_racing_a_new_use_of_the_freed_key_is_kept(pg_url: str) -> None:
    """A call judged NOT_APPLIED (its dispatch deadline passed) lands after all, and its
    executor's receipt arrives while another process begins a new call with the key that
    NOT_APPLIED freed. On SQLite the receipt sees the new call and is kept as a
    ``contradicting_receipt`` event for a person. On PostgreSQL the receipt checked for a
    live use of the key before the new call committed, then its write met the unique index
    of live keys: the write failed, and a receipt (posted, never awaited) vanished without
    a trace, leaving the journal saying NOT_APPLIED for a call that applied."""
    tag = uuid.uuid4().hex[:8]
    names = (f"key_a_{tag}", f"key_b_{tag}")
    ja = Journal(f"{pg_url}&application_name={names[0]}")
    jb = Journal(f"{pg_url}&application_name={names[1]}")
    await ja.open()
    await jb.open()
    try:
        await ja.create_delegation(root_delegation("d1", "t1"))
        await ja.create_delegation(root_delegation("d2", "t2"))
        await ja.begin_action(pay_action("a1", "d1", 2.0))
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
            begin = asyncio.ensure_future(jb.begin_action(pay_action("a2", "d2", 7.5)))
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


async def _final_tree(j: Journal) -> None:
    """d1 SUCCEEDED, past every deadline: a1 NOT_APPLIED (its key freed), a2 the key's
    next use, COMPLETED. A receipt saying a1 completed contradicts a2: a person must look."""
    def call(action_id: str, ordinal: int, now: float) -> NewAction:
        return NewAction(id=action_id, delegation_id="d1", epoch=0, ordinal=ordinal, tool="pay",
                         effect=tether.Effect.EXTERNAL, args_json="{}", args_hash="h",
                         idem_key="k1", now=now, deadline_at=3.0)

    await j.begin_action(call("a1", 0, 2.0))
    await j.mark_in_doubt("d1", 2.5)
    await j.settle_action("a1", tether.ActionState.NOT_APPLIED, 4.0, evidence={"probe": "no"})
    await j.begin_action(call("a2", 1, 4.5))
    j.finish_action("a2", tether.ActionState.COMPLETED, 4.6, result="paid")
    await j.end_delegation("d1", tether.DelegationState.SUCCEEDED, 5.0)
    assert await j.prunable(["d1"], 10.0, 10.0) == ["d1"]


async def _prune(j: Journal) -> dict[str, Any]:
    return await j.prune(["d1"], 10.0, 10.0, None)


def _events(url: str, kind: str) -> list[Any]:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        return conn.execute(sql.SQL("SELECT action_id, detail FROM {}.events WHERE kind = %s")
                            .format(sql.Identifier(_schema_of(url))), (kind,)).fetchall()


async def test_a_receipt_committed_while_a_prune_checks_keeps_its_tree(pg_url: str) -> None:
    """The receipt takes the action first: the prune must judge the tree on it (a person must
    now look), never delete it and the receipt with it."""
    ja, results = await _race(pg_url, _receipt, _prune, table="actions", row="a1",
                              setup=_final_tree)
    try:
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert results[1]["kept"] == ["d1"], results[1]
        row = await ja.get("d1")
        assert row.state is tether.DelegationState.NEEDS_ATTENTION
        assert [a for a, _ in _events(pg_url, "contradicting_receipt")] == ["a1"]
    finally:
        await ja.close()


async def test_a_receipt_for_an_action_pruned_meanwhile_is_kept_as_an_event(
        pg_url: str) -> None:
    """The prune takes the action first and deletes it: the receipt that waited finds no
    action, and is recorded as an event with its outcome instead of dropped in the writer."""
    ja, results = await _race(pg_url, _prune, _receipt, table="actions", row="a1",
                              setup=_final_tree)
    try:
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert results[0]["delegations"] == 1
        [(action, detail)] = _events(pg_url, "receipt_for_pruned_action")
        assert action == "a1" and json.loads(detail)["outcome"] == "COMPLETED", detail
        assert json.loads(detail)["result"] == "paid", detail
    finally:
        await ja.close()
