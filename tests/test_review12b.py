"""Adversarial review of the tamper-evident journal (issue 12): an intruder with write access
to the journal and no trusted key, and a misconfigured operator. Both backends."""

from __future__ import annotations

import uuid

import pytest

import tether
from tests.test_chain import PAY, refund
from tests.test_trust import raw


async def test_redelegation_refuses_when_an_earlier_epoch_holding_the_key_was_tampered(
        journal_url: str) -> None:
    """A task's idempotency keys are shared by all its epochs, and a replay adds no row: the
    COMPLETED refund stays the first epoch's record. Re-delegating the second epoch must not
    believe the first one's flipped row (NOT_APPLIED frees the key), or it pays again."""
    order = f"E-{uuid.uuid4().hex[:6]}"

    async def once(ctx: tether.Context) -> str:
        await ctx.call(refund, order_id=order, cents=100)
        return "ok"

    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        agent = tether.Agent("refunder", once, (refund,))
        first = await sup.delegate(agent, tools=[refund])
        assert await first.result() == "ok"
        second = await first.redelegate()
        assert await second.result() == "ok"
        assert PAY.refund_count(order) == 1
        (done,) = (await first.report()).actions
        await raw(sup.journal, "UPDATE actions SET state = 'NOT_APPLIED' WHERE id = ?",
                  done.id)
        with pytest.raises(tether.JournalError, match="fail verification") as refused:
            await second.redelegate()
        assert f"action {done.id}" in str(refused.value)
    assert PAY.refund_count(order) == 1
