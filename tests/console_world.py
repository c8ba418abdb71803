"""A busy journal as an operator's console finds it: hundreds of delegations over a working
day (succeeded, failed, still running, a few with children), each with a call, and payments
left UNKNOWN among them. Written through the journal's API in this one process, so that it
is built in seconds."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import tether
from tether._core.model import ActionState, DelegationState, Effect
from tether._journal.rows import NewAction, NewDelegation
from tether._runtime.state import new_id

from .operator_world import Stuck, stuck_payment

AGENTS = ("billing", "mailer", "search")
TOOLS = {"billing": "charge", "mailer": "send_email", "search": "lookup"}


@dataclass(frozen=True)
class Busy:
    old: Stuck  # the oldest call nobody could settle
    new: Stuck  # the newest one
    base: float  # the bulk's delegations were created in the 8 hours before this time
    ids: list[str]  # the bulk's delegations, oldest first
    parent: str  # a bulk delegation with two children
    children: tuple[str, str]


async def busy_journal(url: str, n: int = 500) -> Busy:
    """Two stuck payments (an older and a newer), then ``n`` delegations written directly,
    created one a minute over the ``n`` minutes before ``base``: every 7th FAILED, every 11th
    still RUNNING, the others SUCCEEDED; the one a fifth of the way has two children."""
    old = await stuck_payment(url, agent="refunder", tool="refund", order="O-OLD")
    # Before the bulk: a supervisor that starts finds the bulk's running delegations owned by
    # nobody alive, and would terminate them.
    new = await stuck_payment(url, agent="billing", tool="charge", order="O-NEW")
    base = time.time()
    ids = [new_id("d") for _ in range(n)]
    async with tether.Journal(url, create=False) as j:
        ring = tether.KeyRing.load(j.keys_dir)
        j.seal_with(ring.signer, ring.trusted)

        async def one(i: int, did: str, parent: str | None = None, end: bool = True) -> None:
            agent = AGENTS[i % len(AGENTS)]
            tool = TOOLS[agent]
            at = base - (n - i) * 60.0
            task = f"t_bulk{i:04d}" if parent is None else f"t_bulk{i:04d}_{did[-4:]}"
            await j.create_delegation(NewDelegation(
                id=did, task_id=task, parent_id=parent, attempt=1, agent=agent,
                surface=(tool,), args={"order": f"O-{i}"}, owner_id="o_bulk", now=at,
                parent_epoch=0 if parent else None))
            args = {"order_id": f"O-{i}", "cents": 100 + i}
            action = new_id("a")
            await j.begin_action(NewAction(
                id=action, delegation_id=did, epoch=0, ordinal=0, tool=tool,
                effect=Effect.EXTERNAL, args_json=json.dumps(args, sort_keys=True),
                args_hash=f"h{i}{did}", idem_key=f"{task}:{tool}:0", now=at + 1,
                deadline_at=at + 31))
            failed = i % 7 == 3
            j.finish_action(action, ActionState.FAILED if failed else ActionState.COMPLETED,
                            at + 2, None if failed else {"receipt": f"r-{i}"},
                            "card declined" if failed else None)
            if i % 11 == 5 or not end:
                return  # still running
            await j.end_delegation(did, DelegationState.FAILED if failed
                                   else DelegationState.SUCCEEDED, at + 3)

        # Concurrently: the writer commits them in a few batches, not 500 commits.
        k = n // 5  # the parent
        await asyncio.gather(*(one(i, did) for i, did in enumerate(ids) if i != k))
        parent = ids[k]
        kids = (new_id("d"), new_id("d"))
        await one(k, parent, end=False)
        for kid in kids:
            await one(k + 1, kid, parent)
        await j.end_delegation(parent, DelegationState.SUCCEEDED, base - (n - k) * 60.0 + 9)
        await j.flush()
    return Busy(old, new, base, ids, parent, kids)
