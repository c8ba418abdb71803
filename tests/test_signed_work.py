"""Signed work: a worker runs only queued work that a key the deployment trusts signed, over
exactly the agent, arguments, surface and parent of the row it claims; and never work that was
recalled before any claim and whose rows were then rolled back by hand, nor when the
delegation's chain and sealed head are rolled back with them (the configuration remembers the
later head: tests/test_rollback.py has the other rollbacks). Both backends."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.test_trust import raw
from tether.testing import PaymentService

PAY = PaymentService(latency=0.0)


@tether.tool(effect=tether.Effect.EXTERNAL, probe=PAY.lookup)
async def pay(order_id: str, cents: int, *, idempotency_key: str) -> str:
    return await PAY.refund(order_id, cents, idempotency_key=idempotency_key)


@tether.agent(tools=[pay])
async def payer(ctx: tether.Context, order_id: str, cents: int) -> str:
    ref: str = await ctx.call(pay, order_id=order_id, cents=cents)
    return ref


async def ended(journal: tether.Journal, ids: list[str], within: float = 30.0) -> list[Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        rows = [await journal.get(i) for i in ids]
        if all(r.state.terminal for r in rows):
            return rows
        assert loop.time() < deadline, [(r.id, r.state) for r in rows]
        await asyncio.sleep(0.02)


async def served(url: str, agents: list[Any], keys: tether.KeyRing, journal: tether.Journal,
                 ids: list[str]) -> list[Any]:
    """Run a ``tether.Worker`` on ``url`` until the delegations ``ids`` have ended."""
    async with tether.Worker(url, agents, keys=keys, poll=0.02) as worker:
        serving = asyncio.create_task(worker.run())
        rows = await ended(journal, ids)
        worker.stop()
        await serving
    return rows


async def test_a_worker_refuses_work_nobody_trusted_signed(journal_url: str,
                                                            tmp_path: Path) -> None:
    """Case 3: a process with journal write access but no trusted key queues payments with
    remote=True (and forges and alters queue entries); the worker refuses every one, records
    why, and pays nothing; the deployment's own queued payment is paid."""
    run = uuid.uuid4().hex[:6]  # order ids of this run (the provider outlives it)
    deployment = tether.KeyRing.ephemeral()
    async with tether.Supervisor(journal_url, keys=deployment, tools=[pay]) as sup:
        honest = await sup.delegate(payer, f"H-1{run}", 100, remote=True)
        altered = await sup.delegate(payer, f"A-1{run}", 100, remote=True)
        # Tampering with signed work: same row, other arguments.
        await raw(sup.journal, "UPDATE delegations SET args = ? WHERE id = ?",
                  f'{{"args":["A-1{run}",99999],"kwargs":{{}}}}', altered.id)
        async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral(),
                                     tools=[pay]) as intruder:
            queued = [await intruder.delegate(payer, f"X-{i}{run}", 500, remote=True)
                      for i in range(5)]
            # A queue entry written by hand: no signature at all.
            forged = await intruder.delegate(payer, f"F-1{run}", 700, remote=True)
            await raw(intruder.journal, "UPDATE delegations SET work_body = NULL, "
                      "work_key = NULL, work_sig = NULL WHERE id = ?", forged.id)
        refused = [*(h.id for h in queued), forged.id, altered.id]
        rows = await served(journal_url, [payer], deployment, sup.journal,
                            [honest.id, *refused])
    assert rows[0].state is tether.DelegationState.SUCCEEDED
    for row in rows[1:]:
        assert row.state is tether.DelegationState.FAILED, row
        assert row.failure == "refused:work" and row.error is not None
    assert "not trusted" in rows[1].error
    assert "no signed work order" in rows[-2].error
    assert "does not match" in rows[-1].error
    assert PAY.refund_count(f"H-1{run}") == 1
    assert all(PAY.refund_count(f"{o}{run}") == 0 for o in ("X-0", "X-4", "F-1", "A-1"))


async def test_a_worker_whose_key_is_not_trusted_does_not_start(journal_url: str) -> None:
    """It would claim work it cannot settle (its terminates would be refused): it refuses to
    start with one line, claiming nothing."""
    async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral(),
                                 tools=[pay]) as sup:
        queued = await sup.delegate(payer, f"U-{uuid.uuid4().hex[:6]}", 1, remote=True)
        with pytest.raises(tether.errors.UserError, match=r"cannot serve: key \w+ is not trusted"):
            async with tether.Worker(journal_url, [payer], keys=tether.KeyRing.ephemeral()):
                pass
        entry = await sup.journal.queue_entry(queued.id)
    assert entry is not None and entry.claimed_by is None


async def test_queued_work_recalled_before_any_claim_is_not_run_after_a_rollback(
        journal_url: str) -> None:
    """The orchestrator queues a payment and recalls it before any worker claims it: the
    report says nothing ran. A process with write access (no key) puts the rows back as they
    were before the recall (fenced 0, the controls row gone, the queue entry unclaimed): the
    signed work order is genuine, so a worker claimed it and paid. An action caused, and the
    ghost action tether exists to prevent. Now the worker checks the delegation's chain: the
    row differs from its sealed entry and the controls row is gone, so the work is refused.
    (A rollback of the chain and its sealed head along with the rows is the next test.)"""
    order = f"R-{uuid.uuid4().hex[:6]}"
    deployment = tether.KeyRing.ephemeral()
    async with tether.Supervisor(journal_url, keys=deployment, tools=[pay]) as sup:
        h = await sup.delegate(payer, order, 100, remote=True)
        report = await h.recall(1.0, "changed my mind")
        assert report.outcome is tether.DelegationState.RECALLED
        await raw(sup.journal, "DELETE FROM controls WHERE delegation_id = ?", h.id)
        await raw(sup.journal, "UPDATE delegations SET state = 'RUNNING', fenced = 0, "
                  "control_seq = 0 WHERE id = ?", h.id)
        await raw(sup.journal, "UPDATE queue SET claimed_by = NULL, claimed_at = NULL, "
                  "done_at = NULL WHERE delegation_id = ?", h.id)
        await served(journal_url, [payer], deployment, sup.journal, [h.id])
    assert PAY.refund_count(order) == 0


async def test_queued_work_is_not_run_after_a_rollback_of_its_chain_too(
        journal_url: str) -> None:
    """The same rollback by an intruder who also saved the delegation's chain head before the
    recall and restores it (deleting the later entries and events): every record and the
    head's seal are genuine, as they were before the recall. The configuration remembers the
    later head (docs/security.md, "Rollback"): the worker refuses the work, naming it."""
    from tether._core.chain import COLUMNS

    order = f"R-{uuid.uuid4().hex[:6]}"
    deployment = tether.KeyRing.ephemeral()
    cols = COLUMNS["delegations"].split(", ")
    async with tether.Supervisor(journal_url, keys=deployment, tools=[pay]) as sup:
        h = await sup.delegate(payer, order, 100, remote=True)
        await sup.journal.flush()

        def snapshot(db: Any) -> tuple[Any, Any, Any]:
            run = db.execute
            return (run(f"SELECT {COLUMNS['delegations']} FROM delegations WHERE id = ?",
                        (h.id,)).fetchone(),
                    run("SELECT length, hash, path, seal, signer, signature FROM chain_heads "
                        "WHERE delegation_id = ?", (h.id,)).fetchone(),
                    run("SELECT MAX(id) FROM events").fetchone()[0])

        row, head, last_event = await sup.journal._read(snapshot)
        report = await h.recall(1.0, "changed my mind")
        assert report.outcome is tether.DelegationState.RECALLED
        await raw(sup.journal, "DELETE FROM controls WHERE delegation_id = ?", h.id)
        await raw(sup.journal, f"UPDATE delegations SET {', '.join(f'{c} = ?' for c in cols)} "
                  "WHERE id = ?", *row, h.id)
        await raw(sup.journal, "DELETE FROM chain WHERE delegation_id = ? AND seq > ?",
                  h.id, head[0])
        await raw(sup.journal, "UPDATE chain_heads SET length = ?, hash = ?, path = ?, "
                  "seal = ?, signer = ?, signature = ? WHERE delegation_id = ?", *head, h.id)
        await raw(sup.journal, "DELETE FROM events WHERE id > ? AND delegation_id = ?",
                  last_event, h.id)
        await raw(sup.journal, "UPDATE queue SET claimed_by = NULL, claimed_at = NULL, "
                  "done_at = NULL WHERE delegation_id = ?", h.id)
        (refused,) = await served(journal_url, [payer], deployment, sup.journal, [h.id])
    assert PAY.refund_count(order) == 0
    assert refused.failure == "refused:work" and "rolled back" in (refused.error or ""), refused
