"""Terminate (I3, I8), subtree fencing and nested reports (I10), re-delegation (I4)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
from tether._core import drain
from tether._runtime import draining, issuing
from tether.errors import ControlRefused, InvalidTransition, StaleEpoch, StaleSequence
from tether.protocol import ControlKind
from tether.testing import PaymentService, VirtualClock

from .conftest import Countdown, Shop, around_the_verdict, events_of, settled

A = tether.ActionState
S = tether.DelegationState


async def test_terminate_after_the_provider_applied_but_before_the_reply(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    """The lost-receipt failure: the probe finds the refund and the report says COMPLETED."""
    pay.reply_delay = 100.0
    child = await sup.delegate(shop.refund_agent, "B-1", tools=shop.tools)
    await clock.sleeping(1)
    clock.advance(1.0)
    await pay.applied()
    report = await child.terminate("operator stop")
    (action,) = report.actions
    assert action.state is A.COMPLETED and not action.late
    assert action.evidence is not None and action.evidence["provider_ref"] == action.result
    assert report.outcome is S.RECONCILED and report.verdict == "TERMINATE"
    assert pay.refund_count("B-1") == 1


async def test_terminate_cuts_a_recall_grace_window_short(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    pay.latency = 20.0
    child = await sup.delegate(shop.refund_agent, "B-2", tools=shop.tools)
    await pay.sent()
    recall = asyncio.create_task(child.recall(grace=60.0))
    await clock.sleeping(1, at_least=59.0)  # the grace window is running
    report = await child.terminate("taking too long")
    assert report is await recall
    assert report.verdict == "TERMINATE"
    # Cancelling the call loses its reply, not the request: the provider has not applied it
    # yet, and may still, so the probe's answer is not final.
    (action,) = report.actions
    assert action.state is A.IN_DOUBT and report.outcome is S.TERMINATING
    intents = await sup.journal.controls(child.id)
    assert [c.kind for c in intents] == [ControlKind.RECALL, ControlKind.TERMINATE]
    await clock.sleeping(1, at_least=29.0)  # the owner probes again at the dispatch deadline
    clock.advance(20.0)
    await pay.applied()  # the request lands; nobody is left to hear the reply
    clock.advance(10.0)
    final = await settled(sup, child.id)
    assert final.actions[0].state is A.COMPLETED and final.outcome is S.RECONCILED


@pytest.mark.parametrize("when", ["before-its-verdict", "after-its-verdict"])
async def test_a_terminate_once_a_recalls_drain_chose_its_ending_still_terminates(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock,
        monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """A terminate accepted after a recall's grace window ended (the drain chose to leave the
    call running) but before that drain is over: too late to change how the drain ends, so it
    is answered after it, with its own TERMINATE verdict, never folded into the recall's
    GRACE_EXPIRED (the journal would say the terminate was drained, as a recall)."""
    pay.latency = 100.0
    child = await sup.delegate(shop.refund_agent, "B-9", tools=shop.tools)
    await pay.sent()
    accounts = sup._accounts  # the seam: the drain's ending, where the race opens
    conclude, accept = accounts.conclude, sup.journal.sign_and_accept
    terminating: list[asyncio.Future[tether.Report]] = []
    accepted = asyncio.Event()

    async def accepting(*args: Any, **kw: Any) -> Any:
        out = await accept(*args, **kw)
        accepted.set()
        return out

    async def terminate_now() -> None:
        accepted.clear()
        terminating.append(asyncio.ensure_future(child.terminate("kill it")))
        await accepted.wait()

    monkeypatch.setattr(accounts, "conclude", around_the_verdict(conclude, when, terminate_now))
    monkeypatch.setattr(sup.journal, "sign_and_accept", accepting)
    recall = asyncio.ensure_future(child.recall(grace=1.0))
    await clock.sleeping(2, at_least=0.9)  # the call (100 s to go) and the grace window
    clock.advance(1.0)
    recalled = await asyncio.wait_for(recall, 10.0)
    assert recalled.verdict == "GRACE_EXPIRED"
    report = await asyncio.wait_for(terminating[0], 10.0)
    assert report.verdict == "TERMINATE", f"{report.verdict}: {report.reason}"
    assert report.outcome is S.TERMINATING  # the cut call may still land: probed later
    said = [e.detail.get("verdict") for e in await sup.journal.events([child.id])
            if e.kind == "verdict"]
    assert said == ["GRACE_EXPIRED", "TERMINATE"]


async def test_a_terminate_met_again_during_its_drain_is_answered_once(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner may meet the same terminate again while draining it: PostgreSQL lists the
    newest intent of each delegation under recall at every poll, and a child that hits the
    fence adopts it too. Each meeting waits for the one answer; none settles it again."""
    pay.latency = 100.0
    child = await sup.delegate(shop.refund_agent, "B-10", tools=shop.tools)
    await pay.sent()
    rt = sup.runtime(child.id)
    assert rt is not None
    conclude = sup._accounts.conclude
    again: list[asyncio.Future[tether.Report]] = []

    async def met_again(root_id: str, fallback: tether.DelegationState, **kw: Any) -> Any:
        if not again:  # the drain has chosen its ending: the terminate met twice more
            again.extend(asyncio.ensure_future(draining.cut_in(sup, rt, 1)) for _ in range(2))
        return await conclude(root_id, fallback, **kw)

    monkeypatch.setattr(sup._accounts, "conclude", met_again)
    report = await asyncio.wait_for(child.terminate("kill it"), 10.0)
    assert [await asyncio.wait_for(a, 10.0) for a in again] == [report, report]
    await sup.journal.flush()
    said = [e.detail for e in await sup.journal.events([child.id]) if e.kind == "verdict"]
    assert [(v["verdict"], v.get("seq")) for v in said] == [("TERMINATE", 1)], said


async def test_a_late_terminate_is_answered_though_its_caller_stops_waiting(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminate accepted once a recall's drain chose its ending, whose caller gives up
    (a timeout around ``terminate``): the accepted intent is answered all the same."""
    pay.latency = 100.0
    child = await sup.delegate(shop.refund_agent, "B-11", tools=shop.tools)
    await pay.sent()
    conclude, accept = sup._accounts.conclude, sup.journal.sign_and_accept
    accepted = asyncio.Event()
    terminating: list[asyncio.Future[tether.Report]] = []

    async def accepting(*args: Any, **kw: Any) -> Any:
        out = await accept(*args, **kw)
        accepted.set()
        return out

    async def racing(root_id: str, fallback: tether.DelegationState, **kw: Any) -> Any:
        if not terminating:
            accepted.clear()
            terminating.append(asyncio.ensure_future(child.terminate("kill it")))
            await accepted.wait()
            rt = sup.runtime(child.id)
            assert rt is not None
            for _ in range(1000):  # steps of the loop, until the terminate waits for the drain
                if rt.answering.later is not None:
                    break
                await asyncio.sleep(0)
            assert rt.answering.later is not None, "the terminate never reached the drain"
            terminating[0].cancel()  # its caller stops waiting, past its accept
        return await conclude(root_id, fallback, **kw)

    monkeypatch.setattr(sup._accounts, "conclude", racing)
    monkeypatch.setattr(sup.journal, "sign_and_accept", accepting)
    recall = asyncio.ensure_future(child.recall(grace=1.0))
    await clock.sleeping(2, at_least=0.9)  # the call (100 s to go) and the grace window
    clock.advance(1.0)
    assert (await asyncio.wait_for(recall, 10.0)).verdict == "GRACE_EXPIRED"
    with pytest.raises(asyncio.CancelledError):
        await terminating[0]
    deadline = asyncio.get_running_loop().time() + 10.0
    while not await sup.journal.drained(child.id):  # answered in the supervisor's own task
        assert asyncio.get_running_loop().time() < deadline, "the terminate was never answered"
        await asyncio.sleep(0.01)
    said = [e.detail for e in await sup.journal.events([child.id]) if e.kind == "verdict"]
    assert [(v["verdict"], v.get("seq")) for v in said] == [("GRACE_EXPIRED", 1),
                                                            ("TERMINATE", 2)], said


@pytest.mark.parametrize("kind", ["recall", "terminate"])
async def test_an_intent_whose_caller_stops_waiting_at_its_accept_is_still_drained(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock,
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The caller of ``recall`` or ``terminate`` stops waiting (a timeout around it) while the
    journal accepts the intent: the accept commits all the same, so the delegation is fenced
    and moved, and its drain must still run and answer it, or it stays stopping for good."""
    pay.latency = 100.0
    child = await sup.delegate(shop.refund_agent, f"B-12-{kind}", tools=shop.tools)
    await pay.sent()
    accept = sup.journal.sign_and_accept
    callers: list[asyncio.Future[tether.Report]] = []

    async def accepting(*args: Any, **kw: Any) -> Any:
        pending = asyncio.ensure_future(accept(*args, **kw))
        callers[0].cancel()  # its caller stops waiting while the journal accepts it
        return await pending

    monkeypatch.setattr(sup.journal, "sign_and_accept", accepting)
    callers.append(asyncio.ensure_future(
        child.recall(grace=1.0) if kind == "recall" else child.terminate("kill it")))
    with pytest.raises(asyncio.CancelledError):
        await callers[0]
    if kind == "recall":  # its grace window runs, then ends with the call left running
        # The call (100 s to go) and the grace window, if a drain runs at all.
        await asyncio.wait_for(clock.sleeping(2, at_least=0.9), 10.0)
        clock.advance(1.0)
    deadline = asyncio.get_running_loop().time() + 10.0
    while not await sup.journal.drained(child.id):
        assert asyncio.get_running_loop().time() < deadline, "the intent was never drained"
        await asyncio.sleep(0.01)
    said = [e.detail for e in await sup.journal.events([child.id]) if e.kind == "verdict"]
    assert [v.get("seq") for v in said] == [1], said


async def test_a_recall_answered_late_joins_the_drain_a_terminate_started_meanwhile(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recall whose caller stopped waiting at its accept is answered once the accept
    returns; by then a terminate accepted after it may have started the delegation's drain.
    That drain answers both: one drain, one verdict (the terminate's, which names the later
    sequence), never a second drain over the first."""
    pay.latency = 100.0
    child = await sup.delegate(shop.refund_agent, "B-13", tools=shop.tools)
    await pay.sent()
    accept, start_drain = sup.journal.sign_and_accept, sup.start_drain
    drains: list[asyncio.Future[tether.Report]] = []
    drained = asyncio.Event()
    callers: list[asyncio.Future[tether.Report]] = []

    async def accepting(*args: Any, **kw: Any) -> Any:
        out = await accept(*args, **kw)
        if len(callers) == 1:  # the recall: accepted, its answer held back
            callers[0].cancel()  # its caller stops waiting
            callers.append(asyncio.ensure_future(child.terminate("kill it")))
            await drained.wait()  # until the terminate's drain has started
        return out

    def starting(*args: Any) -> asyncio.Future[tether.Report]:
        drains.append(start_drain(*args))
        drained.set()
        return drains[-1]

    answer, answered = issuing.answer, asyncio.Event()

    async def answering(*args: Any) -> tether.Report:
        try:
            return await answer(*args)
        finally:
            if args[2] is ControlKind.RECALL:
                answered.set()

    monkeypatch.setattr(sup.journal, "sign_and_accept", accepting)
    monkeypatch.setattr(sup, "start_drain", starting)
    monkeypatch.setattr(issuing, "answer", answering)
    callers.append(asyncio.ensure_future(child.recall(grace=60.0)))
    with pytest.raises(asyncio.CancelledError):
        await callers[0]
    report = await asyncio.wait_for(callers[1], 10.0)
    assert report.verdict == "TERMINATE"
    await asyncio.wait_for(answered.wait(), 10.0)  # the recall's late answer, given
    await sup.journal.flush()
    said = [e.detail for e in await sup.journal.events([child.id]) if e.kind == "verdict"]
    assert len(drains) == 1 and [(v["verdict"], v.get("seq")) for v in said] == [
        ("TERMINATE", 2)], (len(drains), said)
    assert await sup.journal.drained(child.id)


def nested(shop: Shop) -> tuple[tether.Agent, tether.Agent]:
    @tether.agent(tools=[shop.get_order, shop.refund])
    async def worker(ctx: tether.Context, order_id: str) -> str:
        order = await ctx.call(shop.get_order, order_id=order_id)
        ref: str = await ctx.call(shop.refund, order_id=order_id, cents=order["total"])
        await ctx.call(shop.get_order, order_id=order_id)
        return ref

    @tether.agent(tools=[worker])
    async def lead(ctx: tether.Context, orders: list[str]) -> list[str]:
        handles = [await ctx.delegate(worker, o) for o in orders]
        return [await h.result() for h in handles]

    return lead, worker


def test_an_issuer_elsewhere_waits_for_a_terminate_after_a_recalls_drain() -> None:
    """A terminate that lands as a recall's drain ends is answered after that drain: the
    owner probes twice (the drain's calls, then the terminate's), so an issuer in another
    process waits for both before it reconciles the delegation against a live owner."""
    policy = tether.Policy(ack_timeout=5.0, probe_timeout=10.0)
    assert drain.report_budget(ControlKind.RECALL, 3.0, policy) == 3.0 + 5.0 + 10.0
    assert drain.report_budget(ControlKind.TERMINATE, None, policy) == 5.0 + 2 * 10.0
    # A verdict that trails its settle is waited for one acknowledgement timeout.
    assert not drain.verdict_overdue(100.0, 104.9, policy)
    assert drain.verdict_overdue(100.0, 105.0, policy)


async def test_recall_fences_the_whole_subtree_and_reports_nest(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    lead, _ = nested(shop)
    shop.gate = asyncio.Event()
    started = Countdown(3)
    sup.listen(lambda event, _: started.tick() if event == "started" else None)
    root = await sup.delegate(lead, ["N-1", "N-2"])
    await started.wait()  # the lead and both workers run
    waiter = events_of(sup)
    recall = asyncio.create_task(root.recall(grace=5.0, reason="plan changed"))
    await waiter("drain", root.id).wait()
    # Every descendant was fenced in the same transaction as the root's intent.
    rows = await sup.journal.subtree(root.id)
    assert len(rows) == 3 and all(r.fenced for r in rows)
    shop.gate.set()  # grandchildren's reads finish; their refunds are refused by the fence
    report = await recall
    assert report.outcome is S.RECALLED
    assert [c.agent for c in report.children] == ["worker", "worker"]
    assert all(c.outcome is S.RECALLED for c in report.children)
    assert report.all_actions() == ()
    assert pay.entries() == []


async def test_in_flight_grandchild_action_finishes_within_the_root_grace(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    lead, _ = nested(shop)
    root = await sup.delegate(lead, ["N-3"])
    await pay.sent()  # the grandchild's refund is on its way
    recall = asyncio.create_task(root.recall(grace=5.0))
    await clock.sleeping(1, at_least=4.0)
    clock.advance(1.0)
    report = await recall
    (child,) = report.children
    assert [a.state for a in child.actions] == [A.COMPLETED]
    assert report.outcome is S.RECALLED and child.outcome is S.RECALLED
    assert report.verdict == "RECALLED_CLEAN"


async def test_a_fenced_child_cannot_start_a_grandchild(
        sup: tether.Supervisor, shop: Shop, clock: VirtualClock) -> None:
    _, worker = nested(shop)
    release = asyncio.Event()
    outcome: list[BaseException] = []

    @tether.agent(tools=[worker])
    async def slow_lead(ctx: tether.Context) -> None:
        await release.wait()
        try:
            await ctx.delegate(worker, "N-4")
        except BaseException as exc:
            outcome.append(exc)
            raise

    root = await sup.delegate(slow_lead)
    waiter = events_of(sup)
    recall = asyncio.create_task(root.recall(grace=5.0))
    await waiter("drain", root.id).wait()
    release.set()
    report = await recall
    assert report.children == () and len(await sup.journal.subtree(root.id)) == 1
    assert outcome == [] or isinstance(outcome[0], tether.Recalled | asyncio.CancelledError)


async def test_delegating_to_an_agent_not_granted_is_refused(
        sup: tether.Supervisor, shop: Shop, clock: VirtualClock) -> None:
    _, worker = nested(shop)

    async def rogue(ctx: tether.Context) -> None:
        await ctx.delegate(worker, "N-5")

    child = await sup.delegate(rogue, tools=[shop.get_order])
    with pytest.raises(tether.DelegationError, match="not in the surface"):
        await child.result()
    assert len(await sup.journal.subtree(child.id)) == 1


async def test_redelegation_replays_completed_actions_instead_of_repeating_them(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    child = await sup.delegate(shop.refund_agent, "R-1", tools=shop.tools)
    await pay.sent()
    recall = asyncio.create_task(child.recall(grace=5.0))
    await clock.sleeping(2)
    clock.advance(1.0)
    await recall
    again = await child.redelegate()
    assert (again.task_id, again.epoch) == (child.task_id, 1) and again.id != child.id
    ref = await again.result()
    assert pay.refund_count("R-1") == 1 and pay.requests == 1
    assert ref == (await child.report()).completed[0].result
    events = [e.kind for e in await sup.journal.events([again.id])]
    assert "replay" in events


async def test_racing_recall_and_redelegate_exactly_one_wins(
        sup: tether.Supervisor, shop: Shop, pay: PaymentService, clock: VirtualClock) -> None:
    shop.gate = asyncio.Event()
    child = await sup.delegate(shop.refund_agent, "R-2", tools=shop.tools)
    won: list[tether.Handle] = []
    lost: list[ControlRefused] = []

    async def worker() -> None:
        try:
            await child.recall(grace=5.0)
            won.append(await child.redelegate())
        except ControlRefused as exc:
            lost.append(exc)

    await asyncio.gather(worker(), worker())
    assert len(won) == 1 and len(lost) == 1
    assert isinstance(lost[0], StaleSequence | InvalidTransition)
    assert "current sequence is 1" in str(lost[0]) or "RECALLING" in str(lost[0])
    shop.gate.set()
    await clock.sleeping(1)
    clock.advance(1.0)
    await won[0].result()
    assert pay.refund_count("R-2") == 1


async def test_redelegate_needs_a_recall_first_and_a_stale_epoch_loses(
        sup: tether.Supervisor, shop: Shop, clock: VirtualClock) -> None:
    shop.gate = asyncio.Event()
    child = await sup.delegate(shop.refund_agent, "R-3", tools=shop.tools)
    with pytest.raises(InvalidTransition):
        await child.redelegate()
    await child.terminate()
    await child.redelegate()
    with pytest.raises(StaleEpoch) as info:
        await child.redelegate()  # this handle still holds epoch 0
    assert info.value.current == 1
