"""Recall through the supervisor, on a virtual clock (I1, I2, I3, I8, I9)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
from tether.errors import ControlRefused
from tether.protocol import ControlIntent, ControlKind, Signed
from tether.testing import PaymentService, VirtualClock

from .conftest import Countdown, Shop, events_of

A = tether.ActionState


async def test_in_flight_payment_finishes_within_grace_and_is_reported(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    child = await sup.delegate(shop.refund_agent, "A-1", tools=shop.tools)
    await pay.sent()  # the refund is on its way
    recall = asyncio.create_task(child.recall(grace=5.0, reason="customer withdrew"))
    await clock.sleeping(2)  # the provider and the grace window both wait on the clock
    clock.advance(1.0)  # the provider answers within grace
    report = await recall
    assert report.outcome is tether.DelegationState.RECALLED
    assert report.verdict == "RECALLED_CLEAN"
    assert [a.tool for a in report.completed] == ["refund"]
    assert report.unknown == () and report.late == ()
    assert pay.refund_count("A-1") == 1


async def test_next_call_after_recall_raises_a_signal_except_exception_cannot_swallow(
        sup: tether.Supervisor, shop: Shop, clock: VirtualClock) -> None:
    shop.gate = asyncio.Event()
    swallowed: list[BaseException] = []

    async def stubborn(ctx: tether.Context) -> str:
        await ctx.call(shop.get_order, order_id="A-2")
        try:
            await ctx.call(shop.refund, order_id="A-2", cents=1)
        except Exception as exc:  # what careless agent code does
            swallowed.append(exc)
        return "went on"

    child = await sup.delegate(stubborn, tools=shop.tools)
    recall = asyncio.create_task(child.recall(grace=5.0))
    wait = events_of(sup)
    await wait("drain", child.id).wait()
    shop.gate.set()  # the read finishes; the next call meets the recall
    report = await recall
    assert swallowed == []
    assert report.actions == ()  # the refund never reached the journal, nor the provider
    with pytest.raises(tether.DelegationError) as info:
        await child.result()
    assert isinstance(info.value.__cause__, tether.Recalled)
    assert issubclass(tether.Recalled, BaseException)
    assert not issubclass(tether.Recalled, Exception)


async def test_grace_expired_terminates_then_probe_settles_each_action(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    pay.latency = 30.0  # slower than the grace window
    child = await sup.delegate(shop.refund_agent, "A-3", tools=shop.tools)
    await pay.sent()
    recall = asyncio.create_task(child.recall(grace=2.0))
    await clock.sleeping(2)
    clock.advance(2.0)  # the window ends with the refund still in flight
    report = await recall
    assert report.verdict == "GRACE_EXPIRED"
    (action,) = report.actions
    # The provider has not applied it yet, and the probe says so, with evidence; but the call
    # may still apply, so the answer is not final: in doubt, still in flight.
    assert action.state is A.IN_DOUBT
    assert action.evidence is not None and action.evidence["probe"] == "NOT_APPLIED"
    assert "not applied yet" in action.evidence["not_final"]
    assert report.outcome is tether.DelegationState.RECALLING
    clock.advance(28.0)  # the provider applies it; the call's receipt settles the accounting
    await pay.applied()
    await sup.journal.flush()
    later = await child.report()
    assert later.actions[0].state is A.COMPLETED and later.actions[0].late
    assert later.outcome is tether.DelegationState.RECONCILED


async def test_not_applied_is_final_once_the_dispatch_deadline_passed(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    """The outcome model: past the tool's dispatch deadline nothing can apply, so the next
    probe's "not applied" is final, and the owner makes that probe by itself."""
    pay.latency = 3600.0  # the provider never gets to it within the deadline
    child = await sup.delegate(shop.refund_agent, "A-3b", tools=shop.tools)
    await pay.sent()
    recall = asyncio.create_task(child.recall(grace=2.0))
    await clock.sleeping(2)
    clock.advance(2.0)
    assert (await recall).actions[0].state is A.IN_DOUBT
    # The re-probe waits for the deadline plus the clock tolerance (another host's clock may
    # have written it).
    tolerance = sup.policy.clock_tolerance
    await clock.sleeping(1, at_least=27.0 + tolerance)
    clock.autojump(None)  # the provider's reply stays an hour away while the owner re-probes
    clock.advance(28.0 + tolerance)
    for _ in range(50):
        later = await child.report()
        if later.outcome.terminal:
            break
        await asyncio.sleep(0.01)
    clock.autojump()
    (action,) = later.actions
    assert action.state is A.NOT_APPLIED and "not_final" not in (action.evidence or {})
    assert later.outcome is tether.DelegationState.RECONCILED


async def test_completion_after_the_window_is_a_late_receipt(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    """I3: the provider answers after the window closed; the journal keeps that receipt and
    it overrides the probe's earlier NOT_APPLIED."""
    pay.latency = 10.0
    child = await sup.delegate(shop.refund_agent, "A-4", tools=shop.tools)
    await pay.sent()
    recall = asyncio.create_task(child.recall(grace=2.0))
    await clock.sleeping(2)
    clock.advance(2.0)
    report = await recall
    assert report.actions[0].state is A.IN_DOUBT  # "not applied yet" when it was probed
    running = list(sup._accounts._calls.values())  # the refund, still out past the window
    assert len(running) == 1
    clock.advance(8.0)  # the provider applies and answers
    await pay.applied()
    # The call posts its receipt before its task ends: the report is read after that (the
    # provider's answer and the report racing made this test fail now and then under load).
    await asyncio.gather(*running, return_exceptions=True)
    later = await child.report()
    (action,) = later.actions
    assert action.state is A.COMPLETED and action.late and action.result
    assert later.late == (action,)
    events = [e.kind for e in await sup.journal.events([child.id])]
    assert "late_receipt" in events


async def test_read_only_child_is_recalled_with_no_side_effects(
        sup: tether.Supervisor, shop: Shop, clock: VirtualClock) -> None:
    """I9: skipping reconciliation needs the journal's count AND the verified receipt."""
    shop.gate = asyncio.Event()

    async def reader(ctx: tether.Context) -> None:
        await ctx.call(shop.get_order, order_id="A-5")

    child = await sup.delegate(reader, tools=[shop.get_order])
    report = await child.recall(grace=3.0)
    assert report.verdict == "NO_SIDE_EFFECTS"
    assert report.outcome is tether.DelegationState.RECALLED
    docs = await sup.journal.documents(child.id)
    assert {d.type for d in docs} == {"ack", "no_effects"}


async def test_recall_of_a_finished_child_returns_its_report(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    child = await sup.delegate(shop.refund_agent, "A-6", tools=shop.tools)
    await clock.sleeping(1)
    clock.advance(1.0)
    ref = await child.result()
    report = await child.recall(grace=1.0)
    assert report.outcome is tether.DelegationState.SUCCEEDED
    assert report.completed[0].result == ref
    assert (await sup.journal.get(child.id)).control_seq == 0  # nothing was written


async def test_undeclared_probe_failures_are_unknown_never_guessed(
        sup: tether.Supervisor, clock: VirtualClock) -> None:
    """I3/I8: no probe, a raising probe and a hanging probe all end UNKNOWN with a reason."""
    hang = asyncio.Event()
    entered = Countdown(4)

    async def bad_probe(**_: object) -> tether.ProbeResult:
        raise RuntimeError("provider down")

    async def slow_probe(**_: object) -> tether.ProbeResult:
        await hang.wait()
        raise AssertionError("unreachable")

    async def forever(**_: object) -> str:
        entered.tick()
        await asyncio.Event().wait()
        return ""

    t1 = tether.tool(effect=tether.Effect.EXTERNAL, name="no_probe")(forever)
    t2 = tether.tool(effect=tether.Effect.EXTERNAL, name="raising", probe=bad_probe)(forever)
    t3 = tether.tool(effect=tether.Effect.EXTERNAL, name="hanging", probe=slow_probe)(forever)

    async def narrow_probe(*, idempotency_key: str) -> tether.ProbeResult:
        raise AssertionError("unreachable: the tool's arguments do not fit")

    t4 = tether.tool(effect=tether.Effect.EXTERNAL, name="misfit", probe=narrow_probe)(forever)

    async def agent(ctx: tether.Context) -> None:
        await asyncio.gather(ctx.call(t1), ctx.call(t2), ctx.call(t3), ctx.call(t4, order=1))

    child = await sup.delegate(agent, tools=[t1, t2, t3, t4])
    await entered.wait()
    done = asyncio.create_task(child.terminate())
    await clock.sleeping(1, at_least=sup.policy.probe_timeout)  # the hanging probe's timer
    clock.advance(sup.policy.probe_timeout)
    report = await done
    reasons = {a.tool: (a.state, (a.evidence or {}).get("reason", "")) for a in report.actions}
    assert reasons["no_probe"][0] is A.UNKNOWN and "has no probe" in reasons["no_probe"][1]
    assert reasons["raising"][0] is A.UNKNOWN and "provider down" in reasons["raising"][1]
    assert reasons["hanging"][0] is A.UNKNOWN and "timed out" in reasons["hanging"][1]
    assert reasons["misfit"][0] is A.UNKNOWN and "could not be called" in reasons["misfit"][1]
    assert report.outcome is tether.DelegationState.NEEDS_ATTENTION
    assert report.needs_attention and len(report.unknown) == 4


async def test_compensation_runs_for_completed_only_and_only_once(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    child = await sup.delegate(shop.refund_agent, "A-7", tools=shop.tools)
    await clock.sleeping(1)
    clock.advance(1.0)
    await child.result()
    report = await child.report()
    comp = asyncio.create_task(sup.compensate(report))
    await clock.sleeping(1)
    clock.advance(1.0)
    done = await comp
    assert done is not None and done.outcome is tether.DelegationState.SUCCEEDED
    assert pay.refunded("A-7") == 0  # refund and its reversal
    with pytest.raises(tether.errors.UserError):  # the same report cannot be compensated twice
        await sup.compensate(report)


async def test_compensation_never_touches_unknown_outcomes(
        sup: tether.Supervisor, clock: VirtualClock, pay: PaymentService) -> None:
    reversed_: list[str] = []
    entered = Countdown(1)

    async def reverse(**kw: object) -> str:
        reversed_.append(str(kw))
        return "x"

    async def forever(**_: object) -> str:
        entered.tick()
        await asyncio.Event().wait()
        return ""

    pay_tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", compensate=reverse)(forever)

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(pay_tool, amount=5)

    child = await sup.delegate(agent, tools=[pay_tool])
    await entered.wait()
    report = await child.terminate()
    assert report.unknown and await sup.compensate(report) is None and reversed_ == []


async def foreign_recall(journal_url: str, keys: tether.KeyRing, delegation_id: str,
                         grace: float, now: float) -> None:
    """What `tether recall` does from another process: its own journal connection."""

    def make(row: Any) -> Signed:
        return keys.signer.sign(ControlIntent(
            ControlKind.RECALL, row.id, row.epoch, row.control_seq + 1, grace, "cli", now))

    async with tether.Journal(journal_url, create=False) as other:
        await other.sign_and_accept(delegation_id, make, keys.trusted, "cli:other", now)


async def test_a_recall_from_another_process_ends_its_grace_window(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing, pay: PaymentService) -> None:
    """The intent's acceptance time is wall-clock; the window runs on the supervisor's clock.
    Taken as is, the elapsed time read zero and a hanging action held the recall forever."""
    entered = Countdown(1)

    # Past its 4 s dispatch deadline (plus the policy's 0.5 s clock tolerance, inside the 5 s
    # grace) the hanging call can no longer apply.
    @tether.tool(probe=pay.lookup, dispatch_deadline=4.0)
    async def hang(order_id: str, cents: int, *, idempotency_key: str) -> None:
        entered.tick()
        await asyncio.Event().wait()

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(hang, order_id="F-1", cents=1)

    policy = tether.Policy(probe_timeout=1.0, ack_timeout=1.0,  # only the grace is 5 s
                           clock_tolerance=0.5)
    async with tether.Supervisor(journal_url, clock=clock, keys=keys, policy=policy) as sup:
        waiter = events_of(sup)
        child = await sup.delegate(agent, tools=[hang])
        await entered.wait()
        await foreign_recall(journal_url, keys, child.id, 5.0, clock.wall())
        await waiter("drain", child.id).wait()
        await clock.sleeping(1, at_least=4.9)  # the grace window
        clock.advance(5.0)
        rt = sup.runtime(child.id)
        assert rt is not None and rt.draining is not None
        again = asyncio.ensure_future(clock.sleeping(1, at_least=4.9))
        await asyncio.wait([rt.draining, again], return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
        assert rt.draining.done(), "the grace window started again instead of ending"
        report = rt.draining.result()
        clock.autojump(0.01)  # the hanging call holds the exit for its bounded while
    assert report.verdict == "GRACE_EXPIRED"
    assert [a.state for a in report.actions] == [A.NOT_APPLIED]


async def test_a_child_ending_after_a_foreign_intent_is_still_drained(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing) -> None:
    """Another process's recall commits, then the child ends before the poll sees the intent:
    the journal says RECALLING, so this supervisor must settle it, not leave it there."""
    release = asyncio.Event()

    async def agent(ctx: tether.Context) -> str:
        await release.wait()
        return "done"

    async with tether.Supervisor(journal_url, clock=clock, keys=keys,
                                 control_poll=3600.0) as sup:  # the poll never runs here
        child = await sup.delegate(agent)
        await foreign_recall(journal_url, keys, child.id, 5.0, clock.wall())
        release.set()
        await child.wait()
        row = await sup.journal.get(child.id)
    assert row.state is tether.DelegationState.RECALLED


async def test_the_loser_of_two_racing_recalls_is_told_the_current_sequence(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    """I4, when tether picks the sequence: the loser either offered the sequence the winner
    took, or read the winner's and found the delegation already recalling; either way its
    error names the current sequence (README: "Races have one winner")."""
    waiter = events_of(sup)
    child = await sup.delegate(shop.refund_agent, "R-1", tools=shop.tools)
    await pay.sent()
    racing = [asyncio.create_task(child.recall(grace=5.0, reason=f"orchestrator {n}"))
              for n in (1, 2)]
    await waiter("drain", child.id).wait()  # the winner's intent is accepted
    late = asyncio.create_task(child.recall(grace=5.0, reason="read the winner's sequence"))
    await clock.sleeping(2)
    clock.advance(1.0)
    outcomes = await asyncio.gather(*racing, late, return_exceptions=True)
    reports = [o for o in outcomes if isinstance(o, tether.Report)]
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(reports) == 1 and len(errors) == 2, outcomes
    for error in errors:
        assert isinstance(error, ControlRefused), error
        assert "current sequence is 1" in str(error) or \
            "current control sequence 1" in str(error), error
    assert reports[0].outcome is tether.DelegationState.RECALLED
