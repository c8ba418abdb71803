"""Adversarial review of "honest outcomes under every timing": timings and faults the project's
own tests did not choose. Each test is deterministic (a virtual clock that moves only when the
test advances it, events and gates), and judges by the provider's own ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import tether
from tether.testing import VirtualClock

from .test_outcome_edges import (
    Held,
    eventually,
    payer,
    reaches_key,
    recall_mid_call,
    run_clock,
    spy_waits,
    supervising,
    within,
)

A = tether.ActionState
S = tether.DelegationState


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


class Flaky(Held):
    """A held provider whose first ``failures`` probes fail (a timeout at the provider's API),
    after which it answers from its ledger."""

    def __init__(self, failures: int, **kw: Any) -> None:
        self.failures = failures
        self.probes = 0
        super().__init__(**kw)

    async def lookup(self, order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        self.probes += 1
        if self.probes <= self.failures:
            raise TimeoutError("provider API timed out")
        return await super().lookup(order_id, idempotency_key=idempotency_key)


# -- a key whose earlier call's probe failed once ------------------------------------------------

async def test_a_key_whose_earlier_probe_failed_is_probed_again_at_its_deadline(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call is cut by a terminate (never applied); the probe that follows fails
    once (UNKNOWN). The re-delegated child reaches the key while the call may still apply and
    waits. At the call's deadline a probe's answer is final, so it must ask again, and run the
    call ("runs the call if it was finally not applied"), not fail with KeyInUse as though the
    outcome had stayed unknown: nobody had asked since the provider's API came back."""
    held = Flaky(failures=1, dispatch_deadline=1.0)
    held.release.set()  # the second call goes through at once
    first_release = asyncio.Event()

    async def pay(order_id: str, *, idempotency_key: str) -> str:
        if not held.sent:
            held.sent.append(idempotency_key)
            held.entered.set()
            try:
                await first_release.wait()  # never released: the terminate cuts it
            except asyncio.CancelledError:
                held.cancelled.append(idempotency_key)
                raise
        return await Held.pay(held, order_id, idempotency_key=idempotency_key)

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=held.lookup,
                       dispatch_deadline=1.0)(pay)
    async with supervising(journal_url, vclock, keys, [tool]) as sup:
        waiting = spy_waits(monkeypatch, sup)
        child = await sup.delegate(payer(tool), tools=[tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        report = await within(child.terminate(reason="kill it"), 5.0, "the terminate")
        (earlier,) = report.actions
        assert earlier.state is A.UNKNOWN, earlier  # the probe failed
        assert held.cancelled == [earlier.idempotency_key]
        again = await child.redelegate()
        result = asyncio.ensure_future(again.result())
        await reaches_key(result, waiting)
        assert not result.done(), f"ended before the deadline: {result.exception()!r}"
        await run_clock(vclock, result, step=0.05, limit=2.0)  # final at t = 1.0 + 0.25
        assert result.done(), f"at t = {vclock.now():g} the re-delegated child still waits"
        failure = result.exception()
        assert failure is None, (
            f"the earlier call's outcome could be known at its deadline (a probe would say "
            f"NOT_APPLIED, final), yet the re-delegated child failed without asking: "
            f"{failure!r} caused by {failure.__cause__!r}")
        first = (await sup.report(child.id)).actions[0]
    key = earlier.idempotency_key
    assert held.applied == {key: result.result()}  # applied once, by the second call
    assert first.state is A.NOT_APPLIED


async def test_an_owner_probes_again_at_the_deadline_after_a_probe_failed(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """The probe after a terminate fails (the provider's API timed out) while the cut call may
    still apply: UNKNOWN, NEEDS_ATTENTION. The owner keeps checking: at the call's deadline
    (plus the clock tolerance) it asks again, and the final answer settles the delegation,
    without a person and without ``tether reconcile``."""
    held = Flaky(failures=1, dispatch_deadline=1.0)
    async with supervising(journal_url, vclock, keys, [held.tool]) as sup:
        child = await sup.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        report = await within(child.terminate(reason="kill it"), 5.0, "the terminate")
        assert [a.state for a in report.actions] == [A.UNKNOWN]
        assert report.outcome is S.NEEDS_ATTENTION
        vclock.advance(1.5)  # past the deadline + tolerance (t = 1.25)
        final = await eventually(lambda: sup.report(child.id),
                                 lambda r: r.actions[0].state is not A.UNKNOWN,
                                 "the owner to probe the call again at its deadline")
    assert [a.state for a in final.actions] == [A.NOT_APPLIED]
    assert final.outcome is S.RECONCILED
    assert held.applied == {}


# -- two processes reaching one key at once (PostgreSQL) -----------------------------------------

# The first intent for the key stops after its insert, before its commit, until the test lets
# it go (a trigger waiting on an advisory lock the test holds).
STALL = (
    """CREATE FUNCTION stall_first_use() RETURNS trigger AS $$
    BEGIN
        IF NEW.idem_key = 'order-K' THEN PERFORM pg_advisory_xact_lock(4242); END IF;
        RETURN NEW;
    END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER stall_first_use AFTER INSERT ON actions
        FOR EACH ROW EXECUTE FUNCTION stall_first_use()""",
)


def _waiting(kind: str) -> int:
    """Backends waiting for a lock of this kind (advisory, transactionid)."""
    import psycopg

    from .conftest import PG_URL

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        row = conn.execute("SELECT COUNT(*) FROM pg_locks WHERE locktype = %s AND NOT granted",
                           (kind,)).fetchone()
    assert row is not None
    return int(row[0])


async def test_two_processes_reaching_one_key_at_once_wait_and_replay(
        pg_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """Two orchestrators' children use the same idempotency key (same arguments) at the same
    moment: the second reads the key while the first's intent is written but not committed.
    The journal must not fail the second with a raw unique-index error; it waits for the first
    call's outcome and replays it (the provider applies the key once)."""
    import psycopg

    from .conftest import PG_URL
    from .test_outcome_edges import run_sql

    held = Held()
    async with supervising(pg_url, vclock, keys, [held.tool]) as first, \
            supervising(pg_url, vclock, keys, [held.tool]) as second:
        for statement in STALL:
            run_sql(pg_url, statement)
        with psycopg.connect(PG_URL, autocommit=True) as gate:
            gate.execute("SELECT pg_advisory_lock(4242)")
            a = await first.delegate(payer(held.tool, key="order-K"), tools=[held.tool])
            await eventually(lambda: asyncio.to_thread(_waiting, "advisory"), lambda n: n == 1,
                             "the first intent to be written and held before its commit")
            b = await second.delegate(payer(held.tool, key="order-K"), tools=[held.tool])
            await eventually(lambda: asyncio.to_thread(_waiting, "transactionid"),
                             lambda n: n == 1, "the second intent to wait on the first's")
            gate.execute("SELECT pg_advisory_unlock(4242)")
        await within(held.entered.wait(), 5.0, "the first call to be sent")
        second_result = asyncio.ensure_future(b.result())
        held.release.set()
        first_value = await within(a.result(), 5.0, "the first child's result")
        second_value = await within(second_result, 10.0, "the second child's replay")
    assert held.sent == ["order-K"]
    assert second_value == first_value == held.applied["order-K"]


# -- a late "it did not apply" from the executor ------------------------------------------------

async def test_a_late_rejection_settles_a_call_nobody_could_probe(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """A recall's grace ends with the call still running; the tool has no probe, so the call is
    UNKNOWN and the delegation NEEDS_ATTENTION. Then the provider rejects it: the executor's
    receipt says, with certainty, that it did not apply (ToolRejected). A fence refuses new
    intents, never receipts, and a late receipt re-opens the accounting: the action is FAILED
    (late) and the delegation RECONCILED, not left before a person for ever."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def pay(order_id: str, *, idempotency_key: str) -> str:
        entered.set()
        await release.wait()
        raise tether.ToolRejected("card declined")

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay")(pay)
    async with supervising(journal_url, vclock, keys, [tool]) as sup:
        child = await sup.delegate(payer(tool), tools=[tool])
        await within(entered.wait(), 5.0, "the payment to be sent")
        report = await recall_mid_call(child, vclock, sleepers=1)
        assert [a.state for a in report.actions] == [A.UNKNOWN]
        assert report.outcome is S.NEEDS_ATTENTION
        release.set()
        final = await eventually(lambda: sup.report(child.id),
                                 lambda r: r.actions[0].state is not A.UNKNOWN,
                                 "the executor's late rejection to be recorded", seconds=3.0)
    (action,) = final.actions
    assert (action.state, action.late) == (A.FAILED, True)
    assert final.outcome is S.RECONCILED


class HangsOnce(Held):
    """A held provider whose first probe hangs (its API never answers), after which it
    answers from its ledger."""

    def __init__(self, **kw: Any) -> None:
        self.probing = asyncio.Event()
        self.probes = 0
        super().__init__(**kw)

    async def lookup(self, order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        self.probes += 1
        if self.probes == 1:
            self.probing.set()
            await asyncio.Event().wait()  # cut by the probe timeout
        return await super().lookup(order_id, idempotency_key=idempotency_key)


async def test_a_probe_asked_before_the_deadline_that_times_out_after_it_is_asked_again(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """The probe after a terminate is sent while the cut call may still apply, and times out
    only after the deadline: UNKNOWN, answered past the deadline. What it could not tell was
    asked about a time the call could still apply, so the owner asks again (the next answer is
    final), instead of leaving the delegation NEEDS_ATTENTION for a person."""
    held = HangsOnce(dispatch_deadline=1.0)
    async with supervising(journal_url, vclock, keys, [held.tool]) as sup:
        child = await sup.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        sent = vclock.now()
        stopping = asyncio.ensure_future(child.terminate(reason="kill it"))
        await within(held.probing.wait(), 5.0, "the probe to be sent")
        assert vclock.now() - sent < 1.0  # asked while the call could still apply
        timeout = sup.policy.probe_timeout
        vclock.advance(timeout + 1.0)  # the probe times out well past the deadline
        report = await within(stopping, 5.0, "the terminate")
        assert [a.state for a in report.actions] == [A.UNKNOWN]
        final = await eventually(lambda: sup.report(child.id),
                                 lambda r: r.actions[0].state is not A.UNKNOWN,
                                 "the owner to probe the call again")
    assert [a.state for a in final.actions] == [A.NOT_APPLIED]
    assert final.outcome is S.RECONCILED
    assert held.probes == 2
    assert held.applied == {}


async def test_a_child_cut_while_it_adopts_its_own_fence_ends_with_an_error_not_cancelled(
        journal_url: str, keys: tether.KeyRing, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process terminates a child (the journal fences it) before its owner hears of
    it; the child's next call is refused, and the child adopts the intent itself. If the
    owner's watch loop adopts the same intent meanwhile, its drain cuts the child while the
    child stands in that handler. The caller of ``result()`` must get the task's failure (a
    TetherError), never a bare ``asyncio.CancelledError`` (seen in chaos: the orchestrator
    crashed on it after a pause)."""
    from tether._runtime.adoption import Adoption

    gate = asyncio.Event()
    paid: list[str] = []

    @tether.tool(effect=tether.Effect.EXTERNAL, name="pay")
    async def pay(order_id: str, *, idempotency_key: str) -> str:
        paid.append(idempotency_key)
        return "ok"

    async def agent(ctx: tether.Context) -> str:
        await gate.wait()
        return str(await ctx.call(pay, order_id="L-1"))

    latest = Adoption.latest

    async def adopted_by_both(self: Adoption, rt: Any) -> None:
        # The watch loop adopts the same intent while the child looks it up: its drain cuts.
        waiting = asyncio.ensure_future(latest(self, rt))
        await asyncio.sleep(0)
        rt.cut()
        await waiting

    monkeypatch.setattr(Adoption, "latest", adopted_by_both)
    # The owner polls for others' intents once an hour: it learns of the terminate only
    # through its child.
    async with tether.Supervisor(journal_url, keys=keys, tools=[pay], control_poll=3600.0) \
            as owner, tether.Supervisor(journal_url, keys=keys, tools=[pay]) as other:
        child = await owner.delegate(agent, tools=[pay])
        stopping = asyncio.ensure_future(other.handle_for(child.id).terminate("from elsewhere"))
        await eventually(lambda: owner.journal.get(child.id), lambda row: row.fenced,
                         "the journal to fence the child")
        gate.set()
        with pytest.raises(tether.TetherError):
            await within(child.result(), 10.0, "the child's result")
        stopping.cancel()
        with contextlib.suppress(BaseException):
            await stopping
    assert paid == []
