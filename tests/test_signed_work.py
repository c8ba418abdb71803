"""Signed work: a worker runs only queued work that a key the deployment trusts signed, over
exactly the agent, arguments, surface and parent of the row it claims. Both backends."""

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
        with pytest.raises(tether.UserError, match=r"cannot serve: key \w+ is not trusted"):
            async with tether.Worker(journal_url, [payer], keys=tether.KeyRing.ephemeral()):
                pass
        entry = await sup.journal.queue_entry(queued.id)
    assert entry is not None and entry.claimed_by is None
