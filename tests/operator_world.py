"""Journals as an operator finds them: a payment left in doubt (UNKNOWN), names and reasons
that carry markup, escape sequences and control characters."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import tether
from tether._journal.journal import Journal
from tether._journal.rows import NewDelegation, OwnerRow

# Rich markup (a closing tag that crashes a naive renderer, a link), an ANSI colour sequence,
# a bell, a carriage return, a backspace and a right-to-left override.
HOSTILE = "pay[/bold] [red]x[/red] [link=http://evil]y[/link] \x1b[31mred\x1b[0m \x07\r\b\u202e!"


@dataclass(frozen=True)
class Stuck:
    delegation: str
    action: str
    key: str


async def stuck_payment(url: str, *, agent: str = "payer", tool: str = "charge",
                        reason: str = "customer withdrew", order: str = "O-1",
                        deadline: float = 30.0) -> Stuck:
    """A delegation terminated with a payment in flight whose tool has no probe: the payment
    ends UNKNOWN and the delegation NEEDS_ATTENTION, as after a 3 a.m. incident."""
    entered = asyncio.Event()

    @tether.tool(name=tool, dispatch_deadline=deadline)
    async def charge(order_id: str, cents: int, *, idempotency_key: str) -> str:
        entered.set()
        await asyncio.Event().wait()
        return "never"

    async def payer(ctx: tether.Context) -> None:
        await ctx.call(charge, order_id=order, cents=1250)

    async with tether.Supervisor(url, tools=[charge]) as sup:
        child = await sup.delegate(tether.Agent(agent, payer, (charge,)), tools=[charge])
        # The charge starts, or the child ended without it (its error says why): never a wait
        # for a call that will not come.
        ended = asyncio.ensure_future(child.wait())
        await asyncio.wait([ended, asyncio.ensure_future(entered.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if not entered.is_set():
            await child.result()  # raises the child's failure
            raise AssertionError("the child ended without starting its charge")
        report = await child.terminate(reason)
        ended.cancel()
    (action,) = report.actions
    assert action.state is tether.ActionState.UNKNOWN, report
    return Stuck(child.id, action.id, action.idempotency_key)


def dead_pid() -> int:
    """The id of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def orphan(url: str) -> str:
    """A running delegation whose owner, on this host, has exited (its heartbeat is fresh)."""
    async with Journal(url) as j:
        now = time.time()
        # The journal's root and the owner's seal, as a supervisor records them.
        ring = tether.KeyRing.load_or_init(j.keys_dir)
        await j.genesis(ring.signer, now)
        j.seal_with(ring.signer, ring.trusted)
        owner = f"o_dead{os.getpid()}"
        await j.register_owner(OwnerRow(owner, dead_pid(), socket.gethostname(), now, now))
        row = await j.create_delegation(NewDelegation(
            id="d_orphan", task_id="t_orphan", parent_id=None, attempt=1, agent="gone",
            surface=(), args={}, owner_id=owner, now=now))
        return row.id
