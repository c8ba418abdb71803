"""Tools shared by a process the tests kill and the process that reconciles after it.

The payment ledger lives in a SQLite file named by TETHER_TEST_LEDGER, so both processes see
the provider's own record, as they would a real provider's."""

from __future__ import annotations

import asyncio
import os
import sys

import tether
from tether.testing import PaymentService

pay = PaymentService(latency=0.0, reply_delay=3600.0,
                     path=os.environ.get("TETHER_TEST_LEDGER", ":memory:"))


@tether.tool(effect=tether.Effect.EXTERNAL, probe=pay.lookup)
async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
    return await pay.refund(order_id, cents, idempotency_key=idempotency_key)


@tether.agent(tools=[refund])
async def refund_agent(ctx: tether.Context, order_id: str) -> str:
    ref: str = await ctx.call(refund, order_id=order_id, cents=700)
    return ref


tools = [refund]


async def main(journal_url: str) -> None:
    """Delegate, wait until the provider applied the refund, say so, then hang (the reply
    never comes) until killed."""
    async with tether.Supervisor(journal_url) as sup:
        pay.mark()
        child = await sup.delegate(refund_agent, "K-9")
        await pay.applied()
        print(f"applied {child.id}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
