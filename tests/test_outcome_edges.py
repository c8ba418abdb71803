"""Edges of the outcome model: a terminate racing or following a recall, a parent settled
before its child, reconciliation from another supervisor, waits on a key bound to an earlier
call, receipts after probes, rows with odd deadlines, and racing CLI recalls; recovery and the
settling of a subtree on facts another process changed meanwhile, a probe that failed or timed
out asked again at the call's deadline, two processes reaching one key at once, a late
rejection from the executor, and a child cut while it adopts its own fence.

Most in-process scenarios run on a virtual clock that moves only when the test advances it (no
autojump while the scenario is choreographed; leaving the supervisor turns it on, so that
closing never hangs). The tests that drive the journal directly hand it a clock that stands
still, and the child cut while it adopts its fence runs on the system clock. Waits on other
tasks are bounded in real time and poll a condition, never sleep in the hope of an
interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

import psycopg
import pytest
from psycopg import sql

import tether
from tests.test_chain import before_the_chain
from tether._core.model import ControlKind
from tether._journal import ops
from tether._journal.rows import NewDelegation
from tether._runtime.control import ControlRequest, send_control
from tether.errors import JournalCorrupt, KeyInUse, StaleSequence
from tether.protocol import ControlIntent
from tether.testing import VirtualClock

from .conftest import PG_URL, around_the_verdict, until
from .honest_agents import Provider
from .journal_helpers import FixedClock, pay_action, root_delegation

A = tether.ActionState
S = tether.DelegationState
T = TypeVar("T")
# The supervisors' clock tolerance: a call's dispatch deadline is judged passed this long after
# it (another host's clock wrote it). Small, so that the scenarios' timings stay short.
TOLERANCE = 0.25


# -- helpers --------------------------------------------------------------------------------------

@pytest.fixture
def vclock() -> VirtualClock:
    """A virtual clock with no autojump: time moves only when the test advances it."""
    return VirtualClock()


@contextlib.asynccontextmanager
async def supervising(url: str, clock: VirtualClock, keys: tether.KeyRing | None,
                      tools: Sequence[tether.Tool], *, recover: bool = True,
                      jump_on_close: bool = True) -> AsyncIterator[tether.Supervisor]:
    """A supervisor on ``clock``. Leaving it turns autojump on (closing waits a bounded while,
    on its clock, for calls still running), unless the test needs time to stand still."""
    async with tether.Supervisor(url, clock=clock, keys=keys, tools=tools, recover=recover,
                                 policy=tether.Policy(clock_tolerance=TOLERANCE)) as sup:
        try:
            yield sup
        finally:
            if jump_on_close:
                clock.autojump(0.01)


async def within(aw: Awaitable[T], seconds: float, what: str) -> T:
    """``aw`` within ``seconds`` of real time, or the test fails saying what it waited for."""
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {seconds:g} s of real time") from None


async def eventually(read: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str,
                     seconds: float = 5.0) -> T:
    """Poll ``read`` (real time) until ``ok`` holds of its value."""
    deadline = time.monotonic() + seconds
    while True:
        value = await read()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:g}s waiting for {what}; "
                                 f"last seen: {value!r}")
        await asyncio.sleep(0.01)


async def run_clock(clock: VirtualClock, until: asyncio.Future[Any], *, step: float,
                    limit: float) -> None:
    """Move the clock on by ``step`` at a time, letting the loop run between steps, until
    ``until`` is done or the clock reaches ``limit``. (A timer is registered when its task
    first runs, after its delay was computed: small steps keep its lateness below one.)"""
    deadline = time.monotonic() + 5.0
    while not until.done() and clock.now() + step <= limit + 1e-9:
        clock.advance(step)
        await asyncio.wait([until], timeout=0.005)
        assert time.monotonic() < deadline, "the clock could not be moved on in time"
    if not until.done():
        await asyncio.wait([until], timeout=0.5)  # the last step's work, if any, lands


class Held:
    """A payment provider whose reply waits until the test releases it. A call cancelled by
    its caller is recorded and never applied; a released one is applied, then answered. The
    probe asks the ledger; ``voids``: its "not applied" also voids the key at the provider
    (final before the deadline). ``probe=False``: the tool has no probe (UNKNOWN)."""

    def __init__(self, *, dispatch_deadline: float = 30.0, voids: bool = False,
                 probe: bool = True) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.sent: list[str] = []
        self.cancelled: list[str] = []
        self.applied: dict[str, str] = {}
        self.voids = voids
        self.tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay",
                                probe=self.lookup if probe else None,
                                dispatch_deadline=dispatch_deadline)(self.pay)

    async def pay(self, order_id: str, *, idempotency_key: str) -> str:
        self.sent.append(idempotency_key)
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(idempotency_key)
            raise
        ref = f"ref-{order_id}-{len(self.sent)}"
        self.applied[idempotency_key] = ref
        return ref

    async def lookup(self, order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        if idempotency_key in self.applied:
            return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"found": True},
                                      result=self.applied[idempotency_key])
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"found": False},
                                  voided=self.voids)


def payer(tool: tether.Tool, order_id: str = "L-1", key: str | None = None,
          **more: Any) -> Callable[[tether.Context], Awaitable[Any]]:
    async def agent(ctx: tether.Context) -> Any:
        return await ctx.call(tool, order_id=order_id, idempotency_key=key, **more)

    return agent


async def recall_mid_call(handle: tether.Handle, clock: VirtualClock, sleepers: int,
                          grace: float = 0.3) -> tether.Report:
    """Recall ``handle`` and let its grace window end with its call still running: the window
    and ``sleepers - 1`` other timers are parked on the clock, then the window's time passes."""
    recall = asyncio.ensure_future(handle.recall(grace=grace, reason="too slow"))
    await within(clock.sleeping(sleepers), 5.0, "the grace window to start")
    clock.advance(grace)
    return await within(recall, 5.0, "the recall to end after its grace window")


class HeldAccept:
    """The first control intent to reach the journal's accept waits there until a second one
    arrives; the second goes on once the first is accepted. So the second caller did whatever
    it does before accepting (read a sequence, say) while the first was being accepted."""

    def __init__(self) -> None:
        self.arrivals = 0
        self.first_arrived = asyncio.Event()
        self.second_arrived = asyncio.Event()
        self.first_done = asyncio.Event()

    def patch(self, monkeypatch: pytest.MonkeyPatch,
              target: tether.Journal | type[tether.Journal]) -> None:
        """On one journal (``target`` an instance) or every journal (the class)."""
        original: Callable[..., Awaitable[Any]] = target.sign_and_accept

        async def held(*args: Any, **kwargs: Any) -> Any:
            # Bound to one journal, or called on the class with the journal first: either way
            # the arguments pass through as they came.
            call = original
            self.arrivals += 1
            if self.arrivals == 1:
                self.first_arrived.set()
                await self.second_arrived.wait()
                try:
                    return await call(*args, **kwargs)
                finally:
                    self.first_done.set()
            self.second_arrived.set()
            await self.first_done.wait()
            return await call(*args, **kwargs)

        monkeypatch.setattr(target, "sign_and_accept", held)


def spy_waits(monkeypatch: pytest.MonkeyPatch, sup: tether.Supervisor) -> asyncio.Event:
    """Set when a child of ``sup`` waits on an earlier call of the same key (Begin.WAIT)."""
    waiting = asyncio.Event()
    original = sup.await_call

    async def await_call(action_id: str, key: str) -> None:
        waiting.set()
        await original(action_id, key)

    monkeypatch.setattr(sup, "await_call", await_call)
    return waiting


async def reaches_key(result: asyncio.Future[Any], waiting: asyncio.Event) -> None:
    """Until the re-delegated child either waits on the earlier call or has ended."""
    waited = asyncio.ensure_future(waiting.wait())
    try:
        await within(asyncio.wait([result, waited], return_when=asyncio.FIRST_COMPLETED), 5.0,
                     "the re-delegated child to reach the key")
    finally:
        waited.cancel()


async def verdicts(journal: tether.Journal, ids: Iterable[str]) -> list[str]:
    return [str(e.detail.get("verdict")) for e in await journal.events(list(ids))
            if e.kind == "verdict"]


def run_sql(url: str, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """A hand edit (or read) of the journal's tables, outside tether (``?`` placeholders)."""
    if url.startswith("sqlite"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            rows = db.execute(statement, params).fetchall()
            db.commit()
        return rows
    schema = parse_qs(urlparse(url).query)["schema"][0]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        cur = conn.execute(statement.replace("?", "%s"), params)
        return cur.fetchall() if cur.description else []


# -- d8: a terminate while a recall is being accepted ---------------------------------------------

async def test_a_terminate_while_a_recall_is_accepted_takes_the_next_sequence(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    held = Held()
    async with supervising(journal_url, vclock, keys, [held.tool]) as sup:
        child = await sup.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        race = HeldAccept()
        race.patch(monkeypatch, sup.journal)
        recall = asyncio.ensure_future(child.recall(grace=60.0, reason="plan changed"))
        await within(race.first_arrived.wait(), 5.0, "the recall to reach the journal")
        terminate = asyncio.ensure_future(child.terminate(reason="kill it now"))
        (terminated,) = await within(asyncio.gather(terminate, return_exceptions=True), 10.0,
                                     "the terminate to return (no time passes)")
        if isinstance(terminated, BaseException):
            recall.cancel()
            raise AssertionError(f"the terminate sent while the recall was being accepted was "
                                 f"refused: {terminated!r}") from terminated
        recalled = await within(recall, 5.0, "the recall, its window cut short")
        controls = [(c.seq, c.kind) for c in await sup.journal.controls(child.id)]
        key = f"{child.task_id}:pay:0"
    assert controls == [(1, ControlKind.RECALL), (2, ControlKind.TERMINATE)]
    assert recalled.verdict == "TERMINATE" and terminated.verdict == "TERMINATE", (
        f"the terminate did not cut the grace window short: {recalled.verdict}, "
        f"{terminated.verdict}")
    assert held.cancelled == [key], "the terminate did not cut the call in flight"
    assert vclock.now() == 0.0  # the window was cut short: none of its 60 s passed


async def test_leaving_the_supervisor_while_a_recall_is_accepted_never_raises(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaving ``async with`` terminates the children still running: that terminate races a
    recall being accepted, and must land (cutting the window short), not escape as an error."""
    held = Held()
    sup = tether.Supervisor(journal_url, clock=vclock, keys=keys, tools=[held.tool])
    await sup.__aenter__()
    child = await sup.delegate(payer(held.tool), tools=[held.tool])
    await within(held.entered.wait(), 5.0, "the payment to be sent")
    race = HeldAccept()
    race.patch(monkeypatch, sup.journal)
    recall = asyncio.ensure_future(child.recall(grace=60.0, reason="plan changed"))
    await within(race.first_arrived.wait(), 5.0, "the recall to reach the journal")
    leaving = asyncio.ensure_future(sup.__aexit__(None, None, None))
    (left,) = await within(asyncio.gather(asyncio.shield(leaving), return_exceptions=True),
                           10.0, "leaving the supervisor")
    if isinstance(left, BaseException):
        with contextlib.suppress(Exception):  # close it after all, for the next test
            vclock.autojump(0.01)
            await asyncio.wait_for(sup.__aexit__(None, None, None), 10.0)
        recall.cancel()
        raise AssertionError(f"leaving `async with` raised {left!r}") from left
    report = await within(recall, 5.0, "the recall's report")
    async with tether.Journal(journal_url, create=False) as journal:
        controls = [(c.seq, c.kind) for c in await journal.controls(child.id)]
        said = await verdicts(journal, [child.id])
    assert controls == [(1, ControlKind.RECALL), (2, ControlKind.TERMINATE)]
    assert report.verdict == "TERMINATE" and said == ["TERMINATE"]
    assert held.cancelled == [f"{child.task_id}:pay:0"]


# -- d4: a parent is not settled before its child -------------------------------------------------

async def test_a_recalled_parent_is_not_settled_while_its_childs_call_is_in_doubt(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    provider = Provider(vclock, latency=1.0)
    child_agent = tether.agent(tools=[provider.tool])(payer(provider.tool, cents=100))

    async def parent(ctx: tether.Context) -> Any:
        handle = await ctx.delegate(child_agent)
        return await handle.result()

    async with supervising(journal_url, vclock, keys, [provider.tool]) as sup:
        root = await sup.delegate(parent, tools=[child_agent])
        await within(provider.wait_sent(1), 5.0, "the child's payment to be sent")
        report = await recall_mid_call(root, vclock, sleepers=2)  # latency + grace window
        assert not provider.applied, "the scenario needs the payment still in flight"
        (child,) = report.children
        assert [a.state for a in child.actions] == [A.IN_DOUBT]
        assert not child.outcome.terminal
        assert not report.outcome.terminal, (
            f"the root was reported {report.outcome.value} (settled) while its child's call "
            f"is still in doubt (the child is {child.outcome.value})")
        vclock.advance(0.75)  # the payment lands (t = 1.0); its receipt is late
        await within(provider.settle(), 5.0, "the provider to apply the payment")
        final = await eventually(lambda: sup.report(root.id),
                                 lambda r: r.children[0].outcome.terminal,
                                 "the child to settle on its late receipt")
    (child,) = final.children
    assert [(a.state, a.late) for a in child.actions] == [(A.COMPLETED, True)]
    assert final.outcome.terminal, (
        f"the child settled ({child.outcome.value}) but its parent stayed "
        f"{final.outcome.value}")


# -- d5: a terminate from another process during a recall's grace window --------------------------

@pytest.mark.parametrize("voids", [True, False], ids=["probe-voids", "probe-not-yet"])
async def test_a_terminate_from_another_supervisor_cuts_the_grace_window_short(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing, voids: bool) -> None:
    """``voids``: the owner's probe of the cut call is final at once (the delegation settles),
    or says "not applied yet" (it stays TERMINATING until the call's deadline). Either way the
    other supervisor's terminate returns once the owner has drained it: no 15 s wait, and no
    RECOVERED verdict against a live owner."""
    held = Held(voids=voids)
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as a, \
            supervising(sqlite_url, vclock, keys, [held.tool], recover=False) as b:
        child = await a.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        recall = asyncio.ensure_future(child.recall(grace=60.0, reason="slow"))
        await within(vclock.sleeping(1, at_least=59.0), 5.0, "the grace window to start")
        terminate = asyncio.ensure_future(b.handle_for(child.id).terminate(reason="kill now"))
        recalled = await within(asyncio.shield(recall), 5.0,
                                "the owner to cut its grace window short on the terminate")
        assert recalled.verdict == "TERMINATE", f"{recalled.verdict}: {recalled.reason}"
        assert held.cancelled == [f"{child.task_id}:pay:0"]
        started = time.monotonic()
        try:
            terminated = await within(asyncio.shield(terminate), 5.0,
                                      "the other supervisor's terminate to return")
        finally:
            waited = time.monotonic() - started
            terminate.cancel()
        # Taken here: leaving the supervisors turns autojump on, and a close that waits on
        # its clock for the cut call (probe-not-yet: until its deadline) may move it then.
        returned_at = vclock.now()
        said = await verdicts(a.journal, [child.id])
    assert returned_at == 0.0
    assert terminated.verdict == "TERMINATE", f"{terminated.verdict}: {terminated.reason}"
    assert said == ["TERMINATE"], f"verdicts on record: {said} (after {waited:.1f} s)"


@pytest.mark.parametrize("when", ["before-its-verdict", "after-its-verdict"])
async def test_a_terminate_from_elsewhere_once_a_recalls_drain_chose_its_ending(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Another process's terminate, adopted once the owner's recall drain chose to leave its
    call running (the grace window ended) but before that drain is over: the owner cuts the
    call and answers the terminate after the drain with a TERMINATE verdict of its own. The
    issuer is never handed the recall's GRACE_EXPIRED as the terminate's answer. (The probe
    says "not applied yet": the recall leaves the delegation RECALLING, open to a terminate.)"""
    held = Held()
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as a, \
            supervising(sqlite_url, vclock, keys, [held.tool], recover=False) as b:
        child = await a.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        conclude, accept = a._accounts.conclude, b.journal.sign_and_accept
        adopt = a._adoption.adopt
        terminating: list[asyncio.Future[tether.Report]] = []
        accepted, adopted = asyncio.Event(), asyncio.Event()

        async def accepting(*args: Any, **kw: Any) -> Any:
            out = await accept(*args, **kw)
            accepted.set()
            return out

        def adopting(*args: Any) -> None:
            adopt(*args)
            adopted.set()

        async def terminate_now() -> None:
            terminating.append(asyncio.ensure_future(
                b.handle_for(child.id).terminate(reason="kill now")))
            await accepted.wait()
            if when == "after-its-verdict":  # the owner learns of it while its drain runs
                await adopted.wait()

        monkeypatch.setattr(a._accounts, "conclude",
                            around_the_verdict(conclude, when, terminate_now))
        monkeypatch.setattr(b.journal, "sign_and_accept", accepting)
        monkeypatch.setattr(a._adoption, "adopt", adopting)
        recalled = await recall_mid_call(a.handle_for(child.id), vclock, 1)
        assert recalled.verdict == "GRACE_EXPIRED", f"{recalled.verdict}: {recalled.reason}"
        terminated = await within(terminating[0], 5.0, "the other process's terminate")
        said = await verdicts(a.journal, [child.id])
    assert terminated.verdict == "TERMINATE", f"{terminated.verdict}: {terminated.reason}"
    assert said == ["GRACE_EXPIRED", "TERMINATE"]
    assert held.cancelled == [f"{child.task_id}:pay:0"] and not held.applied


# -- d3: reconciliation from elsewhere never finishes a live delegation ---------------------------

async def test_reconciling_from_another_supervisor_leaves_a_live_delegation_running(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    ledger: dict[str, str] = {}

    async def pay(order_id: str, *, idempotency_key: str) -> str:
        ledger[idempotency_key] = f"ref-{order_id}"
        if order_id == "o1":
            raise TimeoutError("the reply was lost")  # applied, but the agent cannot tell
        return ledger[idempotency_key]

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        if idempotency_key in ledger:
            return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"found": True},
                                      result=ledger[idempotency_key])
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"found": False})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup)(pay)

    async def agent(ctx: tether.Context) -> Any:
        with contextlib.suppress(TimeoutError):
            await ctx.call(tool, order_id="o1")  # the agent carries on
        await vclock.sleep(10.0)  # model work
        return await ctx.call(tool, order_id="o2")

    async with supervising(journal_url, vclock, keys, [tool]) as a:
        child = await a.delegate(agent, tools=[tool])
        await within(vclock.sleeping(1, at_least=9.0), 5.0, "the child's model work")
        assert [x.state for x in await a.journal.actions([child.id])] == [A.IN_DOUBT]
        async with supervising(journal_url, vclock, keys, [tool], jump_on_close=False) as b:
            await b.recover()  # as on its start: `tether reconcile`
        row = await a.journal.get(child.id)
        assert (row.state, row.fenced) == (S.RUNNING, False), (
            f"reconciling from another supervisor moved a live delegation of a live owner to "
            f"{row.state.value} (fenced={row.fenced})")
        vclock.advance(10.5)  # the model work ends
        result = await within(child.result(), 5.0, "the child's result")
    assert result == "ref-o2"
    assert sorted(ledger) == [f"{child.task_id}:pay:0", f"{child.task_id}:pay:1"]


# -- d6: a terminate after a recall left calls running, in the same process -----------------------

async def test_terminate_after_a_recall_left_calls_running_cuts_them_here(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    held = Held(dispatch_deadline=5.0)
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as sup:
        child = await sup.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        report = await recall_mid_call(child, vclock, sleepers=1)
        assert [a.state for a in report.actions] == [A.IN_DOUBT]
        assert held.cancelled == []  # a recall leaves the call be
        terminated = await within(child.terminate(reason="kill it now"), 3.0,
                                  "the terminate of our own recalled delegation")
        assert held.cancelled == [f"{child.task_id}:pay:0"], "the call left running was not cut"
        assert terminated.verdict == "TERMINATE", f"{terminated.verdict}: {terminated.reason}"
        vclock.advance(5.0)  # t = 5.3, past the deadline + tolerance (5.25): the probe is final
        final = await eventually(lambda: sup.report(child.id), lambda r: r.outcome.terminal,
                                 "the delegation to settle here at the call's deadline")
        said = await verdicts(sup.journal, [child.id])
    assert [a.state for a in final.actions] == [A.NOT_APPLIED]
    assert "RECOVERED" not in said, f"verdicts on record: {said}"


# -- d1: waiting on an earlier call of the key ends at its dispatch deadline ----------------------

async def test_a_redelegated_child_waits_on_an_earlier_call_at_most_until_its_deadline(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    async def pay(order_id: str, *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        if len(calls) == 1:
            # The provider drops this request after its 1 s deadline; the client would only
            # give up after 1000 s.
            await vclock.sleep(1000.0)
            raise RuntimeError("client timeout")
        return "ref-2"

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"provider": "none"})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup,
                       dispatch_deadline=1.0)(pay)
    async with supervising(sqlite_url, vclock, keys, [tool]) as sup:
        waiting = spy_waits(monkeypatch, sup)
        child = await sup.delegate(payer(tool), tools=[tool])
        await within(vclock.sleeping(1, at_least=999.0), 5.0, "the first call to be sent")
        report = await recall_mid_call(child, vclock, sleepers=2)
        assert [a.state for a in report.actions] == [A.IN_DOUBT]
        again = await child.redelegate()
        result = asyncio.ensure_future(again.result())
        await within(waiting.wait(), 5.0, "the re-delegated child to wait on the first call")
        await run_clock(vclock, result, step=0.05, limit=2.0)  # final at t = 1.0 + TOLERANCE
        assert result.done(), (
            f"at t = {vclock.now():g}, well past the first call's deadline (t = 1), the "
            f"re-delegated child still waits on that call (its client gives up at t = 1000)")
        value = result.result()
        first = (await sup.report(child.id)).actions[0]
    assert value == "ref-2"
    assert first.state is A.NOT_APPLIED


# -- d12: the executor's result after a probe found the call applied ------------------------------

async def test_a_completed_receipt_after_a_completed_probe_fills_in_the_result(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    ledger: dict[str, bool] = {}

    async def pay(order_id: str, *, idempotency_key: str) -> str:
        await vclock.sleep(0.5)
        ledger[idempotency_key] = True  # applied at t = 0.5
        await vclock.sleep(5.0)  # the reply comes at t = 5.5, past the 2 s deadline
        return "ch_123"

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        # Like most probes, it can tell that the call applied, not what it returned.
        if idempotency_key in ledger:
            return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"found": True})
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"found": False})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup,
                       dispatch_deadline=2.0)(pay)
    async with supervising(journal_url, vclock, keys, [tool]) as sup:
        child = await sup.delegate(payer(tool), tools=[tool])
        report = await recall_mid_call(child, vclock, sleepers=2)
        assert [a.state for a in report.actions] == [A.IN_DOUBT]
        vclock.advance(0.2)  # t = 0.5: applied; the reply is on its way
        await within(vclock.sleeping(1, at_least=4.9), 5.0, "the provider to apply the payment")
        # t = 2.3: the owner probes again at the deadline plus the tolerance (t = 2.25)
        vclock.advance(1.8)
        probed = await eventually(lambda: sup.report(child.id),
                                  lambda r: r.actions[0].state is A.COMPLETED,
                                  "the re-probe at the deadline")
        assert probed.actions[0].result is None
        vclock.advance(3.3)  # t = 5.6: the executor's receipt (t = 5.5), with the result
        final = await eventually(lambda: sup.report(child.id),
                                 lambda r: r.actions[0].result is not None,
                                 "the executor's receipt to fill in the result", seconds=3.0)
    (action,) = final.actions
    assert (action.state, action.result, action.late) == (A.COMPLETED, "ch_123", True)


# -- d7: a child that ended on its own with a call not applied yet --------------------------------

async def test_a_call_left_not_applied_yet_by_a_failed_child_is_reprobed_at_its_deadline(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    async def pay(order_id: str, *, idempotency_key: str) -> str:
        raise ConnectionResetError("connection reset after send")

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"provider": "none"})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup,
                       dispatch_deadline=5.0)(pay)
    async with supervising(sqlite_url, vclock, keys, [tool]) as sup:
        child = await sup.delegate(payer(tool), tools=[tool])
        with pytest.raises(tether.DelegationError):
            await within(child.result(), 5.0, "the child to fail")
        first = await eventually(lambda: sup.report(child.id),
                                 lambda r: bool(r.actions and r.actions[0].evidence),
                                 "the owner's probe of the call")
        assert first.actions[0].state is A.IN_DOUBT  # not applied *yet*
        vclock.advance(5.5)  # past the call's dispatch deadline + tolerance (t = 5.25)
        final = await eventually(lambda: sup.report(child.id),
                                 lambda r: r.actions[0].state is not A.IN_DOUBT,
                                 "the live supervisor to probe again at the deadline")
    assert final.actions[0].state is A.NOT_APPLIED
    assert final.outcome.terminal


# -- d2: a receipt contradicting a final NOT_APPLIED whose key was used again ---------------------

async def test_a_late_receipt_contradicting_a_final_not_applied_is_kept_and_flagged(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    first_reply = asyncio.Event()
    entered = asyncio.Event()
    sent: list[str] = []
    ledger: dict[str, str] = {}

    async def pay(order_id: str, *, idempotency_key: str) -> str:
        sent.append(idempotency_key)
        ref = f"ref-{len(sent)}"
        entered.set()
        if ref == "ref-1":
            await first_reply.wait()  # the provider breaks its deadline and applies it late
        ledger.setdefault(idempotency_key, ref)
        return ref

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        if idempotency_key in ledger:
            return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {},
                                      result=ledger[idempotency_key])
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"provider": "none"})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup,
                       dispatch_deadline=1.0)(pay)
    agent = payer(tool, "o1", key="refund-o1")
    async with supervising(journal_url, vclock, keys, [tool]) as a, \
            supervising(journal_url, vclock, keys, [tool], recover=False) as b:
        first = await a.delegate(agent, tools=[tool])
        await within(entered.wait(), 5.0, "the first payment to be sent")
        report = await recall_mid_call(first, vclock, sleepers=1)
        assert [x.state for x in report.actions] == [A.IN_DOUBT]
        vclock.advance(1.0)  # past the deadline + tolerance: the owner's re-probe is final
        await eventually(lambda: a.report(first.id),
                         lambda r: r.actions[0].state is A.NOT_APPLIED,
                         "the final NOT_APPLIED at the deadline")
        second = await b.delegate(agent, tools=[tool])  # another process, the same key
        assert await within(second.result(), 5.0, "the second payment") == "ref-2"
        first_reply.set()  # the first request's reply arrives: it was applied after all
        events = await eventually(lambda: a.journal.events([first.id]),
                                  lambda es: any(e.kind == "contradicting_receipt"
                                                 for e in es),
                                  "the contradicting receipt to be recorded")
        final = await eventually(lambda: a.report(first.id),
                                 lambda r: r.outcome is S.NEEDS_ATTENTION,
                                 "the delegation to be flagged for a person", seconds=2.0)
    (kept,) = [e for e in events if e.kind == "contradicting_receipt"]
    assert (kept.detail["old"], kept.detail["new"]) == ("NOT_APPLIED", "COMPLETED")
    assert kept.detail["result"] == "ref-1"
    assert final.actions[0].state is A.NOT_APPLIED  # the record stands; the fact is kept beside


# -- d10: rows migrated with no deadline use their tool's own ------------------------------------

async def test_a_row_without_a_deadline_uses_its_tools_dispatch_deadline(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    async def pay(order_id: str, *, idempotency_key: str) -> str:
        raise ConnectionResetError("reset after send")

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {"provider": "not yet"})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup,
                       dispatch_deadline=3600.0)(pay)
    async with supervising(journal_url, vclock, keys, [tool], jump_on_close=False) as sup:
        child = await sup.delegate(payer(tool), tools=[tool])
        with pytest.raises(tether.DelegationError):
            await within(child.result(), 5.0, "the child to fail")
        await sup.journal.flush()
    async with tether.Journal(journal_url) as j:  # a journal from before the chain,
        await before_the_chain(j, keys)  # whose rows are not chained,
    run_sql(journal_url, "UPDATE actions SET deadline_at = NULL")  # as schema v2 left it
    assert run_sql(journal_url, "SELECT deadline_at FROM actions") == [(None,)]
    vclock.advance(60.0)  # twice the default deadline, a minute into the tool's hour
    async with supervising(journal_url, vclock, keys, [tool]) as sup:  # probes on start
        early = await sup.report(child.id)
        assert [a.state for a in early.actions] == [A.IN_DOUBT], (
            f"a minute into the tool's 3600 s deadline, the call is "
            f"{early.actions[0].state.value} ({early.actions[0].evidence})")
        vclock.advance(3600.0)  # past started_at + the tool's deadline
        late = await eventually(lambda: sup.report(child.id),
                                lambda r: r.actions[0].state is not A.IN_DOUBT,
                                "the re-probe at the tool's deadline")
    assert [a.state for a in late.actions] == [A.NOT_APPLIED]


# -- d11: a corrupt deadline is a corrupt journal -------------------------------------------------

async def test_a_corrupt_deadline_is_journal_corrupt_naming_the_row(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    async def pay(order_id: str, *, idempotency_key: str) -> str:
        raise ConnectionResetError("reset")

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {})

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup)(pay)
    async with supervising(journal_url, vclock, keys, [tool], jump_on_close=False) as sup:
        child = await sup.delegate(payer(tool), tools=[tool])
        with pytest.raises(tether.DelegationError):
            await within(child.result(), 5.0, "the child to fail")
        await sup.journal.flush()
        (action,) = await sup.journal.actions([child.id])
    assert action.state is A.IN_DOUBT
    # A hand edit: text in SQLite's REAL column; PostgreSQL's takes no text, but NaN.
    bad = "soon" if journal_url.startswith("sqlite") else float("nan")
    run_sql(journal_url, "UPDATE actions SET deadline_at = ?", (bad,))
    with pytest.raises(JournalCorrupt) as caught:
        async with supervising(journal_url, vclock, keys, [tool], jump_on_close=False):
            pass  # reconciles on start: the in-doubt action is read
    assert action.id in str(caught.value) and "deadline_at" in str(caught.value)


# -- d13: a key whose earlier call's probe said UNKNOWN ------------------------------------------

async def test_a_key_whose_earlier_call_is_unknown_but_live_waits_and_replays(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    provider = Provider(vclock, latency=1.0)
    noprobe = tether.tool(effect=tether.Effect.EXTERNAL, name="np")(provider.pay)

    async def agent(ctx: tether.Context) -> Any:
        return await ctx.call(noprobe, order_id="L-1", cents=1)

    async with supervising(sqlite_url, vclock, keys, [noprobe]) as sup:
        waiting = spy_waits(monkeypatch, sup)
        child = await sup.delegate(agent, tools=[noprobe])
        await within(provider.wait_sent(1), 5.0, "the payment to be sent")
        report = await recall_mid_call(child, vclock, sleepers=2)
        assert [a.state for a in report.actions] == [A.UNKNOWN]
        again = await child.redelegate()
        result = asyncio.ensure_future(again.result())
        await reaches_key(result, waiting)
        if result.done():
            failure = result.exception()
            raise AssertionError(
                f"the earlier call is UNKNOWN but still before its deadline (and running "
                f"here), yet the re-delegated child ended at once: {failure!r} "
                f"(cause {failure.__cause__ if failure else None!r})")
        vclock.advance(0.75)  # the first payment lands (t = 1.0); its late receipt settles it
        value = await within(result, 5.0, "the re-delegated child's replay")
        key = report.actions[0].idempotency_key
    assert value == provider.applied[key][0]
    assert provider.sent.count(key) == 1


async def test_a_key_whose_earlier_call_is_unknown_fails_past_its_deadline(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    held = Held(dispatch_deadline=1.0, probe=False)  # never answers, no probe
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as sup:
        waiting = spy_waits(monkeypatch, sup)
        child = await sup.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        report = await recall_mid_call(child, vclock, sleepers=1)
        (earlier,) = report.actions
        assert earlier.state is A.UNKNOWN
        again = await child.redelegate()
        result = asyncio.ensure_future(again.result())
        await reaches_key(result, waiting)
        assert not result.done(), (
            f"before the earlier call's deadline the child must wait, not end: "
            f"{result.exception()!r}")
        await run_clock(vclock, result, step=0.05, limit=2.0)  # final at t = 1.0 + TOLERANCE
        assert result.done(), f"at t = {vclock.now():g} the re-delegated child still waits"
        failure = result.exception()
    assert isinstance(failure, tether.DelegationError), failure
    cause = failure.__cause__
    assert isinstance(cause, KeyInUse), f"{failure!r} caused by {cause!r}"
    assert cause.action_id == earlier.id and earlier.id in str(cause)
    assert held.sent == [earlier.idempotency_key]  # never sent again


# -- d14: two racing `tether recall` commands ----------------------------------------------------

async def test_the_loser_of_two_racing_cli_recalls_gets_stale_sequence(
        journal_url: str, vclock: VirtualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    async def agent(ctx: tether.Context) -> None:
        await vclock.sleep(1000.0)

    async with supervising(journal_url, vclock, None, []) as sup:
        child = await sup.delegate(agent)
        race = HeldAccept()  # both commands read the sequence before either is accepted
        race.patch(monkeypatch, tether.Journal)
        sends = [send_control(ControlRequest(journal_url, None, child.id, ControlKind.RECALL,
                                             5.0, f"shell {n}", f"operator {n}"))
                 for n in (1, 2)]
        outcomes = await within(asyncio.gather(*sends, return_exceptions=True), 10.0,
                                "both recall commands")
        monkeypatch.undo()
        row = await sup.journal.get(child.id)
    won = [o for o in outcomes if isinstance(o, dict)]
    lost = [o for o in outcomes if not isinstance(o, dict)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert won[0]["seq"] == 1 and row.control_seq == 1
    assert isinstance(lost[0], StaleSequence), \
        f"the loser got {type(lost[0]).__name__}: {lost[0]}"
    assert lost[0].current == 1 and "current sequence is 1" in str(lost[0])


# -- recovery and settling on facts another process changed meanwhile -----------------------------

async def test_recovery_on_a_row_read_before_anothers_intent_still_settles(
        sup: tether.Supervisor) -> None:
    """An orchestrator finds a delegation whose owner is gone (a poll of the queue, or
    ``recover``), and before its recovery's terminate is offered, another process's recall is
    accepted (``tether recall``, or a second orchestrator recovering the same delegation).
    Recovery offered sequence 1 on the row it had read and got ``StaleSequence``: the
    orchestrator waiting on the task was handed an internal race as its error, and nothing
    of its recovery (in doubt, probes, settle) ran. The delegation is fenced either way:
    recovery must carry on and settle it."""
    clock = sup.clock
    await sup.journal.create_delegation(NewDelegation(
        id="d1", task_id="t1", parent_id=None, attempt=1, agent="agent", surface=("pay",),
        args={}, owner_id="gone", now=clock.wall()))
    row = await sup.journal.get("d1")  # the recovering process's read
    recall = ControlIntent(ControlKind.RECALL, "d1", 0, 1, 5.0, "r", clock.wall())
    await sup.journal.accept_control(sup.keys.signer.sign(recall), sup.keys.trusted, "cli",
                                     clock.wall())
    report = await sup.recover_delegation(row, "owner is gone")
    assert report.outcome.terminal, report


async def test_settling_a_subtree_never_lands_a_judgement_on_stale_facts(
        journal_url: str) -> None:
    """A child ended with a call UNKNOWN (a probe could not tell). Its owner's accounting
    settles the subtree: it reads the facts (UNKNOWN: NEEDS_ATTENTION), and before it writes,
    another process's later probe finds the call COMPLETED and re-settles the delegation
    RECONCILED. The accounting's NEEDS_ATTENTION, judged on the facts it had read, then
    overwrote RECONCILED (a move the model allows for a contradicting receipt): the
    delegation asked a person to look at a call whose outcome is known, and no later fact
    would ever move it back. Whatever the order, it must end RECONCILED."""
    from tether._runtime.reconcile import settle_subtree

    j, other = tether.Journal(journal_url), tether.Journal(journal_url)  # two processes
    await j.open()
    await other.open()
    try:
        await j.create_delegation(root_delegation("d1", "t1"))
        await j.begin_action(pay_action("a1", "d1", 2.0))
        await j.mark_in_doubt("d1", 2.5)
        await j.settle_action("a1", tether.ActionState.UNKNOWN, 3.0,
                              evidence={"probe": "UNKNOWN", "reason": "timed out"})
        await j.end_delegation("d1", tether.DelegationState.SUCCEEDED, 4.0, result=1)
        assert (await j.get("d1")).state is tether.DelegationState.SUCCEEDED

        applied = False

        async def later_probe() -> None:
            nonlocal applied
            if not applied:
                applied = True
                await other.settle_action("a1", tether.ActionState.COMPLETED, 5.0,
                                          evidence={"probe": "COMPLETED"})

        # The other process's probe commits right after this one's accounting read the facts.
        read = j.actions

        async def actions_then_probe(ids: list[str]) -> Any:
            found = await read(ids)
            await later_probe()
            return found

        j.actions = actions_then_probe  # type: ignore[method-assign,assignment]
        await settle_subtree(j, "d1", FixedClock(4.5), tether.DelegationState.TERMINATED)
        await later_probe()  # where the accounting read nothing in between: after it
        row = await j.get("d1")
        [a1] = await j.actions(["d1"])
        assert a1.state is tether.ActionState.COMPLETED
        assert row.state is tether.DelegationState.RECONCILED, row.state
    finally:
        await other.close()
        await j.close()


# -- a key whose earlier call's probe failed once -------------------------------------------------

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


async def test_a_probe_that_keeps_failing_past_the_deadline_is_asked_once_more_not_forever(
        journal_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """The provider's lookup stays down. The probe after a terminate fails while the call may
    still apply, so the owner asks again at the deadline; that one fails too, and then an
    answer is final anyway: UNKNOWN stays for a person. The second failure is recorded (when
    it was asked), so the owner stops asking. It asked again at once, forever, before: some
    600 probes a second of real time while virtual time stood still."""
    held = Flaky(failures=10**9, dispatch_deadline=1.0)
    async with supervising(journal_url, vclock, keys, [held.tool]) as sup:
        child = await sup.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        report = await within(child.terminate(reason="kill it"), 5.0, "the terminate")
        assert [a.state for a in report.actions] == [A.UNKNOWN] and held.probes == 1
        vclock.autojump(0.01)
        await within(vclock.sleep(30.0), 10.0, "30 virtual seconds past the deadline")
        final = await sup.report(child.id)
    assert [a.state for a in final.actions] == [A.UNKNOWN]
    assert final.outcome is S.NEEDS_ATTENTION
    assert held.probes == 2, held.probes  # once when terminated, once at the deadline


async def test_a_settled_delegation_whose_verdict_never_comes_is_never_recovered_from_elsewhere(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """The owner's probe settles the delegation, and its drain never records a verdict (here
    it hangs; a terminate accepted once a drain had ended gets none either). The other
    supervisor's terminate returns the settled report once the verdict is overdue, and never
    recovers the delegation of an owner that is alive (it waited out its budget and wrote
    RECOVERED)."""
    held = Held(voids=True)
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as a, \
            supervising(sqlite_url, vclock, keys, [held.tool], recover=False) as b:
        entered = asyncio.Event()

        async def never(root_id: str, now: float,
                        verdict: Mapping[str, str | int] | None = None) -> None:
            entered.set()
            await asyncio.Event().wait()

        a.journal.settle_tree = never  # type: ignore[method-assign]
        child = await a.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        recall = asyncio.ensure_future(child.recall(grace=60.0, reason="slow"))
        await within(vclock.sleeping(1, at_least=59.0), 5.0, "the grace window to start")
        terminate = asyncio.ensure_future(b.handle_for(child.id).terminate(reason="kill now"))
        await within(entered.wait(), 10.0, "the owner's probe to settle the delegation")
        terminated = await within(asyncio.shield(terminate), 30.0, "the terminate")
        said = await verdicts(b.journal, [child.id])
        recall.cancel()
    assert terminated.outcome is S.RECONCILED, terminated.outcome
    assert "RECOVERED" not in said, f"verdicts on record: {said}"


# -- two processes reaching one key at once (PostgreSQL) ------------------------------------------

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


# -- a late "it did not apply" from the executor --------------------------------------------------

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


# -- a probe sent before the deadline that times out after it -------------------------------------

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


# -- a child cut while it adopts its own fence ----------------------------------------------------

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



def look_after_each_settle(owner: tether.Supervisor, other: tether.Supervisor,
                           seen: list[tuple[S, str | None]]) -> None:
    """Each time ``owner`` settles a subtree, ``other`` reads its root's state and verdict."""
    settle_tree = owner.journal.settle_tree

    async def settle_then_look(root_id: str, now: float,
                               verdict: Mapping[str, str | int] | None = None) -> None:
        await settle_tree(root_id, now, verdict)
        row = await other.journal.get(root_id)
        last = await other.journal.last_verdict(root_id)
        seen.append((row.state, None if last is None else last.get("verdict")))

    owner.journal.settle_tree = settle_then_look  # type: ignore[method-assign]


@pytest.mark.parametrize("where", ["drained", "never-claimed"])
async def test_whoever_sees_a_delegation_settled_also_sees_its_verdict(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing, where: str) -> None:
    """The settle and the verdict commit together: another supervisor that finds the
    delegation settled (and builds its report from the journal, as a terminate from another
    process does) never reads a report without the verdict. Observed from the other
    supervisor the moment the owner's settle returns: after a drain, and for a queued task
    no worker had claimed."""
    held = Held(voids=True)
    seen: list[tuple[S, str | None]] = []
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as a, \
            supervising(sqlite_url, vclock, keys, [held.tool], recover=False) as b:
        look_after_each_settle(a, b, seen)
        if where == "drained":
            child = await a.delegate(payer(held.tool), tools=[held.tool])
            await within(held.entered.wait(), 5.0, "the payment to be sent")
        else:
            child = await a.delegate(payer(held.tool), tools=[held.tool], remote=True)
        report = await within(child.terminate(reason="kill now"), 5.0, "the terminate")
    expected = "TERMINATE" if where == "drained" else "NEVER_STARTED"
    assert report.verdict == expected
    settled = [verdict for state, verdict in seen if state.terminal]
    assert settled, f"the owner's settles, as seen from elsewhere: {seen}"
    assert settled == [expected] * len(settled), seen


async def test_a_verdict_never_commits_without_its_settle(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's settle fails (its operation alone): its verdict is not on record either, so
    another process never reads the delegation as drained while it is not settled (it would
    return a report that is not final, and never recover it while the owner lives)."""
    held = Held(voids=True)

    def refused(db: Any, root_id: str, now: float,
                verdict: Mapping[str, str | int] | None = None) -> None:
        raise RuntimeError("the settle failed")  # this operation only: the batch goes on

    async with supervising(sqlite_url, vclock, keys, [held.tool]) as a, \
            supervising(sqlite_url, vclock, keys, [held.tool], recover=False) as b:
        child = await a.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        monkeypatch.setattr(ops, "settle_tree", refused)
        settle_tree = a.journal.settle_tree

        async def after_a_flush(*args: Any) -> None:
            await a.journal.flush()  # whatever was queued before the settle commits first
            await settle_tree(*args)

        a.journal.settle_tree = after_a_flush  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError, match="the settle failed"):
            await within(child.terminate(reason="kill now"), 5.0, "the terminate")
        monkeypatch.undo()
        assert not await b.journal.drained(child.id)
        assert await b.journal.last_verdict(child.id) is None


async def test_a_terminate_from_elsewhere_waits_for_the_owners_verdict(
        sqlite_url: str, vclock: VirtualClock, keys: tether.KeyRing) -> None:
    """The owner's probe of the cut call voids it, which settles the delegation (RECONCILED)
    before the owner's drain records its verdict with its own settle. The other supervisor's
    terminate, polling in between, waits for the verdict: it returned a report with none."""
    held = Held(voids=True)
    async with supervising(sqlite_url, vclock, keys, [held.tool]) as a, \
            supervising(sqlite_url, vclock, keys, [held.tool], recover=False) as b:
        release = asyncio.Event()
        settle_tree = a.journal.settle_tree

        entered = asyncio.Event()

        async def held_settle(root_id: str, now: float,
                              verdict: Mapping[str, str | int] | None = None) -> None:
            entered.set()  # its probes answered and were recorded
            await release.wait()
            await settle_tree(root_id, now, verdict)

        a.journal.settle_tree = held_settle  # type: ignore[method-assign]
        looks = 0
        peek = b.journal.peek

        async def counted(*args: Any) -> Any:
            nonlocal looks
            looks += 1
            return await peek(*args)

        b.journal.peek = counted  # type: ignore[method-assign,assignment]
        child = await a.delegate(payer(held.tool), tools=[held.tool])
        await within(held.entered.wait(), 5.0, "the payment to be sent")
        recall = asyncio.ensure_future(child.recall(grace=60.0, reason="slow"))
        await within(vclock.sleeping(1, at_least=59.0), 5.0, "the grace window to start")
        terminate = asyncio.ensure_future(b.handle_for(child.id).terminate(reason="kill now"))
        await until(lambda: looks > 0, "the other supervisor to look")
        await within(entered.wait(), 10.0, "the owner to settle its drain")
        # The owner's probe voided the call, which settled the delegation already.
        assert (await b.journal.get(child.id)).state is S.RECONCILED
        seen = looks
        await until(lambda: looks > seen + 1 or terminate.done(),
                    "the other supervisor to look at the settled delegation")
        early = terminate.done()
        release.set()
        terminated = await within(asyncio.shield(terminate), 5.0, "the terminate")
        await within(asyncio.shield(recall), 5.0, "the recall")
    assert not early, f"returned before the owner's verdict: {terminated.verdict}"
    assert terminated.verdict == "TERMINATE", terminated


async def test_a_final_probe_for_a_waiting_call_is_recorded_when_its_caller_gives_up(
        journal_url: str, keys: tether.KeyRing) -> None:
    """A call reaches a key whose earlier call is in doubt past its deadline, and probes it (a
    final answer). Its caller stops waiting meanwhile (an ``asyncio.timeout`` around the
    call): the probe's answer is a fact all the same, recorded, never lost with the waiter
    (the earlier call would stay in doubt with nobody left to ask again)."""
    policy = tether.Policy(clock_tolerance=TOLERANCE)
    first = Held(dispatch_deadline=0.2)
    async with tether.Supervisor(journal_url, keys=keys, tools=[first.tool], recover=False,
                                 policy=policy) as owner:
        earlier = await owner.delegate(payer(first.tool, key="K-1"), tools=[first.tool])
        await within(first.entered.wait(), 5.0, "the first payment to be sent")
        report = await within(earlier.terminate(reason="cut"), 5.0, "the terminate")
        (action,) = report.actions
        assert action.state is A.IN_DOUBT  # "not applied yet": it may still land
    probing, answer = asyncio.Event(), asyncio.Event()

    async def lookup(order_id: str, *, idempotency_key: str) -> tether.ProbeResult:
        probing.set()
        await answer.wait()
        return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"found": True}, result="r")

    tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay", probe=lookup,
                       dispatch_deadline=0.2)(first.pay)
    await asyncio.sleep(0.2 + TOLERANCE + 0.05)  # past its deadline: a probe's answer is final

    async def impatient(ctx: tether.Context) -> str:
        call = asyncio.ensure_future(ctx.call(tool, order_id="L-1", idempotency_key="K-1"))
        await within(probing.wait(), 5.0, "the waiting call to probe the earlier one")
        call.cancel()  # the caller gives up while the probe is out
        with contextlib.suppress(asyncio.CancelledError):
            await call
        return "gave up"

    async with tether.Supervisor(journal_url, keys=keys, tools=[tool], recover=False,
                                 policy=policy) as sup:
        assert await (await sup.delegate(impatient, tools=[tool])).result() == "gave up"
        answer.set()
        found = await eventually(lambda: sup.journal.action(action.id),
                                 lambda a: a.state is not A.IN_DOUBT, "the probe's answer")
    assert found.state is A.COMPLETED and found.evidence is not None
    assert found.evidence["probe"] == "COMPLETED"
