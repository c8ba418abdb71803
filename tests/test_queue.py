"""The queue and worker leases in the journal, on both backends: claims never overlap, a
recall beats a claim, and an owner whose lease ran out is fenced by the journal (I2)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import tether
from tether._journal import schema
from tether._journal.journal import Journal
from tether._journal.ops import FenceRefused
from tether._journal.queue import owner as queue_owner
from tether._journal.rows import Begin, NewAction, NewDelegation, OwnerRow
from tether._runtime.clock import SystemClock
from tether._runtime.remote import owner_alive
from tether.errors import LeaseLost
from tether.protocol import ControlIntent, ControlKind, SigningKey, TrustedKeys

from .test_trust import raw

KEY = SigningKey.from_raw(bytes(range(32)))
TRUSTED = TrustedKeys([KEY.public])


@pytest.fixture
async def journal(journal_url: str) -> AsyncIterator[Journal]:
    async with Journal(journal_url) as j:
        await j.genesis(KEY, 0.0)  # KEY roots the journal's key registry
        for owner in ("orchestrator", "w1", "w2"):
            await j.register_owner(OwnerRow(owner, 1, "host", 0.0, 0.0))
        yield j


def queued(did: str, agent: str = "agent", now: float = 1.0) -> NewDelegation:
    return NewDelegation(id=did, task_id=f"t-{did}", parent_id=None, attempt=1, agent=agent,
                         surface=("pay",), args={"args": [], "kwargs": {}},
                         owner_id="orchestrator", now=now, queued=True)


def action(aid: str, did: str, now: float) -> NewAction:
    args = '{"x":1}'
    return NewAction(id=aid, delegation_id=did, epoch=0, ordinal=0, tool="pay",
                     effect=tether.Effect.EXTERNAL, args_json=args,
                     args_hash=hashlib.sha256(args.encode()).hexdigest(), idem_key=aid, now=now,
                     deadline_at=now + 30.0)


async def recall(j: Journal, did: str, now: float) -> None:
    intent = ControlIntent(ControlKind.RECALL, did, 0, 1, 5.0, "r", now)
    await j.accept_control(KEY.sign(intent), TRUSTED, "orchestrator", now)


async def test_claims_are_disjoint_oldest_first_and_only_for_known_agents(
        journal: Journal) -> None:
    for n in range(5):
        await journal.create_delegation(queued(f"d{n}", now=float(n)))
    await journal.create_delegation(queued("other", agent="unknown"))
    for worker in ("w1", "w2"):
        assert await journal.renew_lease(worker, 10.0, 30.0)
    first = await journal.claim("w1", ("agent",), 10.0, 3)
    second = await journal.claim("w2", ("agent",), 10.0, 10)
    assert [r.id for r in first] == ["d0", "d1", "d2"]
    assert [r.id for r in second] == ["d3", "d4"]  # never "other", never one of w1's
    assert {r.owner_id for r in first} == {"w1"} and {r.owner_id for r in second} == {"w2"}
    assert await journal.claim("w2", ("agent",), 10.0, 10) == []
    entry = await journal.queue_entry("d0")
    assert entry is not None and entry.claimed_by == "w1" and entry.done_at is None


async def test_a_recall_before_any_claim_leaves_it_to_its_issuer(journal: Journal) -> None:
    await journal.create_delegation(queued("d1"))
    assert await journal.renew_lease("w1", 10.0, 30.0)
    await recall(journal, "d1", 11.0)
    assert await journal.claim("w1", ("agent",), 12.0, 5) == []  # fenced: not claimable
    assert await journal.unclaim("d1", "orchestrator", 12.0)
    assert not await journal.unclaim("d1", "orchestrator", 12.0)  # only once
    entry = await journal.queue_entry("d1")
    assert entry is not None and entry.claimed_by == "orchestrator" and entry.done_at == 12.0


async def test_a_claimed_delegation_is_not_taken_back(journal: Journal) -> None:
    await journal.create_delegation(queued("d1"))
    assert await journal.renew_lease("w1", 10.0, 30.0)
    assert len(await journal.claim("w1", ("agent",), 10.0, 5)) == 1
    await recall(journal, "d1", 11.0)
    assert not await journal.unclaim("d1", "orchestrator", 12.0)  # the worker drains it
    (control,) = await journal.controls_to_adopt("w1", 0)
    assert control.delegation_id == "d1" and control.kind is ControlKind.RECALL


async def test_a_claim_undone_by_hand_is_never_claimed_or_dequeued_again(
        journal: Journal) -> None:
    """An intruder with write access and no key clears the queue row of a task a worker runs
    (the row is not chained). The claim itself is on record (its chained event): no worker
    claims the delegation a second time (two copies of it ran), and the orchestrator does not
    take it off the queue as never started while the worker drains it."""
    await journal.create_delegation(queued("d1"))
    assert await journal.renew_lease("w1", 10.0, 30.0)
    assert await journal.renew_lease("w2", 10.0, 30.0)
    assert len(await journal.claim("w1", ("agent",), 10.0, 5)) == 1
    await raw(journal, "UPDATE queue SET claimed_by = NULL, claimed_at = NULL")
    assert await journal.claim("w1", ("agent",), 11.0, 5) == []
    assert await journal.claim("w2", ("agent",), 11.0, 5) == []
    await recall(journal, "d1", 12.0)
    assert not await journal.unclaim("d1", "orchestrator", 13.0)
    assert (await journal.get("d1")).owner_id == "w1"


async def test_an_expired_lease_fences_the_owner_in_the_journal(journal: Journal) -> None:
    """No recall, no reconciliation: a worker paused past its lease cannot act on waking."""
    await journal.create_delegation(queued("d1"))
    assert await journal.renew_lease("w1", 10.0, 5.0)  # lease until 15
    assert len(await journal.claim("w1", ("agent",), 10.0, 5)) == 1
    assert (await journal.begin_action(action("a1", "d1", 14.0))).status is Begin.STARTED
    late = await journal.begin_action(action("a2", "d1", 15.5))
    assert late.status is Begin.LEASE_EXPIRED
    with pytest.raises(FenceRefused):  # nor can it start a child
        await journal.create_delegation(dataclasses.replace(
            queued("c1"), task_id="t-c1", parent_id="d1", parent_epoch=0, queued=False,
            owner_id="w1", now=15.5))
    assert not await journal.renew_lease("w1", 15.5, 5.0)  # an expired lease stays expired
    assert await journal.claim("w1", ("agent",), 15.5, 5) == []
    assert [a.id for a in await journal.actions(["d1"])] == ["a1"]
    owners = {o.id: o for o in await journal.owners()}
    assert owners["w1"].lease_until == 15.0 and owners["orchestrator"].lease_until is None


async def test_a_version_1_journal_is_migrated_with_its_data(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    for statement in schema.MIGRATIONS[1]:
        for text in schema.statements(statement, "sqlite"):
            conn.execute(text)
    conn.executemany("INSERT INTO tether_meta VALUES (?, ?)",
                     [("app", "tether"), ("schema_version", "1")])
    conn.execute("INSERT INTO owners VALUES ('o', 1, 'h', 0, 0)")
    conn.commit()
    conn.close()
    async with Journal(f"sqlite:///{path}") as j:
        assert [o.id for o in await j.owners()] == ["o"]
        await j.create_delegation(queued("d1"))
        assert (await j.queue_entry("d1")) is not None
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM tether_meta WHERE key = 'schema_version'"
                        ).fetchone() == (str(schema.SCHEMA_VERSION),)
    conn.close()


async def test_a_worker_whose_agent_differs_refuses_to_run_it(journal_url: str) -> None:
    """The orchestrator granted one surface; a worker with another definition of the agent
    fails the delegation with the reason instead of acting outside what was granted."""

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def pay(*, idempotency_key: str) -> None: ...

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def wire(*, idempotency_key: str) -> None: ...

    async def body(ctx: tether.Context) -> None: ...

    granted = tether.Agent("payer", body, (pay,))
    widened = tether.Agent("payer", body, (pay, wire))
    async with tether.Supervisor(journal_url, recover=False) as sup:
        handle = await sup.delegate(granted, remote=True)
        async with tether.Worker(journal_url, [widened], poll=0.01) as worker:
            running = asyncio.ensure_future(worker.run())
            with pytest.raises(tether.DelegationError, match="grants"):
                await handle.result()
            worker.stop()
            await running
        row = await sup.journal.get(handle.id)
    assert row.state is tether.DelegationState.FAILED and row.failure == "error:surface"
    assert row.owner_id == worker.owner_id


async def test_a_queued_task_outlives_the_process_that_queued_it(journal_url: str) -> None:
    """Until a worker claims it, a queued task belongs to the queue: another supervisor's
    recovery does not terminate it because the orchestrator that queued it has gone."""

    async def body(ctx: tether.Context) -> str:
        return "done"

    agent = tether.Agent("later", body, ())
    async with tether.Supervisor(journal_url, recover=False) as first:
        handle = await first.delegate(agent, remote=True)
    async with tether.Supervisor(journal_url) as second:  # recovers on start
        assert await second.recover() == []
        assert (await second.journal.get(handle.id)).state is tether.DelegationState.RUNNING
        async with tether.Worker(journal_url, [agent], poll=0.01) as worker:
            running = asyncio.ensure_future(worker.run())
            result = await second.handle_for(handle.id).result()
            worker.stop()
            await running
    assert result == "done"


async def test_any_supervisor_reconciles_a_worker_whose_lease_ran_out(journal: Journal,
                                                                      journal_url: str) -> None:
    """What `tether reconcile` runs: a delegation claimed by a worker whose lease ended (at
    t=15, long ago for the wall clock) is terminated and its pending action put in doubt.
    The worker's writes are sealed with its key, as a worker's are: reconciliation refuses a
    delegation whose records nobody trusted sealed (docs/security.md, "The chain")."""
    pins = TrustedKeys([KEY.public])  # this test's configuration: its own memory
    journal.seal_with(KEY, pins)
    await journal.create_delegation(queued("d1"))
    assert await journal.renew_lease("w1", 10.0, 5.0)
    assert len(await journal.claim("w1", ("agent",), 10.0, 5)) == 1
    assert (await journal.begin_action(action("a1", "d1", 14.0))).status is Begin.STARTED
    await journal.close()
    async with tether.Supervisor(journal_url, recover=False,
                                 keys=tether.KeyRing(KEY, pins)) as sup:
        (report,) = await sup.recover()
        entry = await sup.journal.queue_entry("d1")
    assert report.delegation_id == "d1" and report.verdict == "RECOVERED"
    assert [a.state for a in report.actions] == [tether.ActionState.UNKNOWN]  # no probe: unknown
    assert entry is not None and entry.claimed_by == "w1"


def unreadable(did: str, owner_id: str) -> NewDelegation:
    # Arguments not in the shape tether writes (a row from another tool or version).
    return NewDelegation(id=did, task_id=f"t-{did}", parent_id=None, attempt=1, agent="fine",
                         surface=(), args={"argv": []}, owner_id=owner_id, now=1.0,
                         queued=True)


async def fine(ctx: tether.Context) -> str:
    return "ok"


async def test_a_fault_in_a_workers_handling_settles_the_delegation(journal_url: str) -> None:
    """A claimed delegation the worker fails to handle is settled at once, with the fault on
    record, rather than left to an orchestrator that would wait for as long as the worker
    lives; the worker goes on serving (I3)."""
    agent = tether.Agent("fine", fine, ())
    async with tether.Supervisor(journal_url, recover=False) as sup:
        await sup.journal.create_delegation(sup.sign_work(unreadable("d-bad", sup.owner_id)))
        async with tether.Worker(journal_url, [agent], poll=0.01) as worker:
            running = asyncio.ensure_future(worker.run())
            with pytest.raises(tether.DelegationError, match="TERMINATED"):
                await sup.handle_for("d-bad").result()
            after = await (await sup.delegate(agent, remote=True)).result()
            worker.stop()
            await running
        row = await sup.journal.get("d-bad")
        entry = await sup.journal.queue_entry("d-bad")
        events = await sup.journal.events(["d-bad"])
    assert row.state is tether.DelegationState.TERMINATED and after == "ok"
    assert entry is not None and entry.done_at is not None
    faults = [e.detail["error"] for e in events if e.kind == "worker_error"]
    assert faults == ["worker fault: KeyError('args')"]
    (verdict,) = [e.detail for e in events if e.kind == "verdict"]
    assert verdict == {"verdict": "RECOVERED", "reason": faults[0]}


async def test_a_worker_that_cannot_settle_a_fault_stops_and_keeps_its_lease(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """If settling the fault fails too, the worker cannot vouch for what it holds: it stops
    with LeaseLost without giving up its lease, so the delegation is reconciled like a dead
    worker's once the lease runs out (I3, I7)."""
    agent = tether.Agent("fine", fine, ())
    async with tether.Supervisor(journal_url, recover=False) as sup:
        await sup.journal.create_delegation(sup.sign_work(unreadable("d-bad", sup.owner_id)))
        async with tether.Worker(journal_url, [agent], poll=0.01, lease=600.0) as worker:

            async def cannot_settle(delegation_id: str, exc: Exception) -> None:
                raise RuntimeError("journal bookkeeping broke")

            monkeypatch.setattr(worker, "_settle_after_fault", cannot_settle)
            with pytest.raises(LeaseLost, match="worker fault"):
                await worker.run()
        owner = await sup.journal.peek(queue_owner, worker.owner_id)
        row = await sup.journal.get("d-bad")
    assert owner is not None and owner.lease_until is not None
    assert owner.lease_until > sup.clock.wall() + 60  # not given up: it runs out on its own
    assert row.state is tether.DelegationState.RUNNING and row.owner_id == worker.owner_id


class SkewedClock(SystemClock):
    """This host's clock, off by ``offset`` seconds: a host NTP has not reached."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def wall(self) -> float:
        return time.time() + self.offset


async def test_a_worker_whose_clock_is_off_the_servers_does_not_start(pg_url: str) -> None:
    """Leases are written on the worker's clock and judged on the server's: a worker an hour
    off refuses to start (and claims nothing) rather than hold a lease others misjudge (I7)."""
    agent = tether.Agent("fine", fine, ())
    async with tether.Supervisor(pg_url, recover=False) as sup:
        handle = await sup.delegate(agent, remote=True)
        with pytest.raises(LeaseLost, match=r"clock is \+3600\.\d s off"):
            async with tether.Worker(pg_url, [agent], clock=SkewedClock(3600.0)):
                pass
        entry = await sup.journal.queue_entry(handle.id)
    assert entry is not None and entry.claimed_by is None


async def test_an_orchestrator_ahead_of_the_server_does_not_presume_a_live_worker_dead(
        pg_url: str) -> None:
    """An orchestrator whose clock runs an hour ahead judges leases on the server's clock: it
    leaves a worker with a lease alone and reconciles only one whose lease really ran out."""
    async with Journal(pg_url) as j:
        for owner in ("w-live", "w-gone"):
            await j.register_owner(OwnerRow(owner, 1, "elsewhere", 0.0, 0.0))
        now = time.time()
        assert await j.renew_lease("w-live", now, 60.0)
        assert await j.renew_lease("w-gone", now - 100.0, 10.0)
    # A tolerance wide enough for the hour (by default it would refuse to start: test_clocks).
    async with tether.Supervisor(pg_url, recover=False, clock=SkewedClock(3600.0),
                                 policy=tether.Policy(clock_tolerance=3 * 3600.0)) as sup:
        assert await owner_alive(sup, "w-live")
        assert not await owner_alive(sup, "w-gone")


async def test_a_worker_whose_clock_drifts_off_stops_at_its_next_renewal(pg_url: str) -> None:
    agent = tether.Agent("fine", fine, ())
    clock = SkewedClock(0.0)
    async with tether.Worker(pg_url, [agent], clock=clock, lease=3.0) as worker:
        clock.offset = -3600.0  # from now on: checked at the next renewal, a second away
        with pytest.raises(LeaseLost, match=r"clock is -3600\.\d s off"):
            await worker.run()
    assert worker.supervisor.abandoned
