"""Honest outcomes: a report never calls "not applied" what the provider applied, a receipt is
never lost with its task, a recall always ends somewhere, and a cancel or a lost race says so.

Each test judges by the provider's own ledger (``tests.honest_agents``), which never
deduplicates: a key paid twice shows up twice. In-process tests run on a virtual clock; the
tests with other processes (``tether worker``, the CLI) synchronise on files and journal state,
polling a condition with a deadline, never sleeping in the hope of an interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

import tether
from tether.testing import PaymentService, VirtualClock

from . import honest_agents
from .conftest import PG_URL, Countdown
from .honest_agents import Provider

A = tether.ActionState
S = tether.DelegationState
T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


# -- helpers --------------------------------------------------------------------------------------

def assert_honest(actions: Iterable[tether.ActionRecord], applied: Mapping[str, int],
                  context: str = "") -> None:
    """The provider's ledger is the truth: no key applied twice, and every key it applied has
    a COMPLETED record, never NOT_APPLIED or FAILED."""
    acts = list(actions)
    twice = {k: n for k, n in applied.items() if n > 1}
    assert not twice, f"keys applied more than once at the provider: {twice}{context}"
    dishonest = [(a.idempotency_key, a.state.value) for a in acts
                 if a.state in (A.NOT_APPLIED, A.FAILED) and applied.get(a.idempotency_key)]
    assert not dishonest, f"the journal says not applied for payments the provider applied: " \
                          f"{dishonest}{context}"
    for key, n in applied.items():
        states = [a.state.value for a in acts if a.idempotency_key == key]
        assert n == 0 or "COMPLETED" in states, f"the provider applied {key!r}, but the " \
            f"journal has no COMPLETED record: {states}{context}"


def counts(provider: Provider) -> dict[str, int]:
    return {k: len(v) for k, v in provider.applied.items()}


async def eventually(read: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str,
                     within: float = 20.0) -> T:
    """Poll a condition (real time, for other processes' progress) until it holds."""
    deadline = time.monotonic() + within
    while True:
        value = await read()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}; "
                                 f"last seen: {value!r}")
        await asyncio.sleep(0.02)


async def run_clock(clock: VirtualClock, until: asyncio.Future[Any], *, step: float,
                    limit: float) -> None:
    """Advance the virtual clock by ``step`` whenever something waits on it, until ``until``
    is done; at most ``limit`` seconds of virtual time."""
    spent = 0.0
    while not until.done():
        parked = asyncio.ensure_future(clock.sleeping(1))
        await asyncio.wait([until, parked], return_when=asyncio.FIRST_COMPLETED)
        parked.cancel()
        if until.done():
            return
        if spent >= limit:
            await asyncio.wait([until], timeout=5.0)
            assert until.done(), f"still not done after {limit:g}s of virtual time"
            return
        clock.advance(step)
        spent += step
        await asyncio.sleep(0.005)  # let the journal's thread commit what this released


def pythonpath() -> str:
    """The repository for `tests.*`, plus whatever this run imports tether from."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


async def recalled_with_a_live_call(sup: tether.Supervisor, provider: Provider,
                                    clock: VirtualClock) -> tuple[tether.Handle, tether.Report]:
    """A recall whose grace (0.3 s) ends while the payment is on its way: the provider applies
    it 0.7 s after the window closed (the issue's reproduction, on a virtual clock)."""

    async def agent(ctx: tether.Context) -> str:
        ref: str = await ctx.call(provider.tool, order_id="L-1", cents=100)
        return ref

    child = await sup.delegate(agent, tools=[provider.tool])
    await provider.wait_sent(1)
    recall = asyncio.create_task(child.recall(grace=0.3, reason="too slow"))
    await clock.sleeping(2)  # the provider's latency and the grace window
    clock.advance(0.3)  # the window ends; the payment is still in flight
    report = await recall
    assert not provider.applied, "the scenario needs the payment still unapplied here"
    return child, report


# -- 1: a probe's NOT_APPLIED while the call is still live ----------------------------------------

async def test_a_probe_not_applied_while_the_call_is_live_keeps_it_in_doubt(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing) -> None:
    provider = Provider(clock, latency=1.0)
    async with tether.Supervisor(journal_url, clock=clock, keys=keys,
                                 tools=[provider.tool]) as sup:
        child, report = await recalled_with_a_live_call(sup, provider, clock)
        (action,) = report.actions
        assert action.state is A.IN_DOUBT, (
            f"the call is still running (its provider applies it 0.7 s later), yet the probe's "
            f"'not applied' was taken as final: the action is {action.state.value}")
        assert action.evidence is not None and action.evidence.get("probe") == "NOT_APPLIED"
        assert report.unknown == (action,) and report.not_applied == ()
        clock.advance(0.7)  # the provider applies it; the tool's receipt follows
        await provider.settle()
        later = await eventually(child.report, lambda r: r.actions[0].state is A.COMPLETED,
                                 "the late receipt")
        (done,) = later.actions
        assert done.late and done.result == provider.applied[action.idempotency_key][0]
        assert_honest(later.all_actions(), counts(provider))


async def test_leaving_the_supervisor_with_a_call_in_flight_never_leaves_not_applied(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing) -> None:
    """The orchestrator leaves ``async with`` right after the recall, before the payment lands.
    The supervisor waits for the call (bounded) or leaves it in doubt; either way the journal
    never says NOT_APPLIED, and a fresh supervisor ends up with COMPLETED."""
    provider = Provider(clock, latency=1.0)
    sup = tether.Supervisor(journal_url, clock=clock, keys=keys, tools=[provider.tool])
    await sup.__aenter__()
    try:
        child, _ = await recalled_with_a_live_call(sup, provider, clock)
    finally:
        exiting = asyncio.ensure_future(sup.__aexit__(None, None, None))
        # A supervisor waiting on its clock for the call: let the provider apply meanwhile.
        on_clock = asyncio.ensure_future(clock.sleeping(2))
        await asyncio.wait([exiting, on_clock], return_when=asyncio.FIRST_COMPLETED)
        on_clock.cancel()
        if not exiting.done():
            clock.advance(0.7)
        await asyncio.wait_for(exiting, 60.0)  # leaving is bounded
    if not provider.applied:
        clock.advance(0.7)  # the payment lands after the orchestrator left
    await provider.settle()
    key = f"{child.task_id}:pay:0"
    async with tether.Journal(journal_url, create=False) as journal:
        (left,) = await journal.actions([child.id])
    assert left.state in (A.COMPLETED, A.IN_DOUBT), (
        f"the supervisor left with the call still running and the journal says "
        f"{left.state.value}; the provider then applied it ({provider.applied[key]})")
    clock.advance(60.0)  # later: the old supervisor's heartbeat is long stale
    async with tether.Supervisor(journal_url, clock=clock, keys=keys,
                                 tools=[provider.tool]) as fresh:  # reconciles on start
        final = await fresh.report(child.id)
    assert [a.state for a in final.actions] == [A.COMPLETED]
    assert_honest(final.all_actions(), counts(provider))


async def test_redelegating_while_the_first_call_is_live_never_pays_twice(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing) -> None:
    """The re-delegated child reaches the same key while the first call may still apply: it
    waits for that outcome and replays it, instead of paying again."""
    provider = Provider(clock, latency=1.0)
    async with tether.Supervisor(journal_url, clock=clock, keys=keys,
                                 tools=[provider.tool]) as sup:
        child, report = await recalled_with_a_live_call(sup, provider, clock)
        key = report.actions[0].idempotency_key
        again = await child.redelegate()
        result = asyncio.ensure_future(again.result())
        await run_clock(clock, result, step=0.35, limit=5.0)
        await provider.settle()
        assert provider.sent.count(key) == 1, (
            f"key {key!r} reached the provider {provider.sent.count(key)} times; applied as "
            f"{provider.applied[key]}")
        assert await result == provider.applied[key][0]  # the first payment, replayed
        final = await sup.report(child.id)
    assert_honest(final.all_actions(), counts(provider))


# -- 2: a paused worker's payments ----------------------------------------------------------------

async def start_worker(url: str, env: dict[str, str], lease: float) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "worker", "--journal", url,
        "--agents", "tests.honest_agents:AGENTS", "--lease", str(lease), "--concurrency", "1",
        env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    if not line.startswith("worker "):
        assert proc.stderr is not None
        raise AssertionError(line + (await proc.stderr.read()).decode())
    return proc


def stopped(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state in ("T", "t")


async def pause_outside_transactions(proc: asyncio.subprocess.Process, url: str,
                                     app: str) -> None:
    """SIGSTOP the worker at a moment it holds no journal transaction (a worker paused inside
    one is another test's subject: test_workers.py)."""

    async def stop() -> None:
        os.kill(proc.pid, signal.SIGSTOP)
        while True:
            if stopped(proc.pid):
                return
            await asyncio.sleep(0.005)

    if url.startswith("sqlite"):
        path = url.removeprefix("sqlite:///")

        def hold_and_stop() -> None:
            holder = sqlite3.connect(path, timeout=30.0, isolation_level=None)
            try:
                holder.execute("BEGIN IMMEDIATE")  # the worker cannot be inside a write now
                os.kill(proc.pid, signal.SIGSTOP)
                while not stopped(proc.pid):
                    time.sleep(0.005)
                holder.execute("ROLLBACK")
            finally:
                holder.close()

        await asyncio.to_thread(hold_and_stop)
        return

    def busy() -> int:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            row = conn.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE "
                               "application_name = %s AND state <> 'idle'", (app,)).fetchone()
        assert row is not None
        return int(row[0])

    for _ in range(100):
        await stop()
        if await asyncio.to_thread(busy) == 0:
            await asyncio.sleep(0.05)  # a statement still on the wire would show up by now
            if await asyncio.to_thread(busy) == 0:
                return
        os.kill(proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.02)
    raise AssertionError("the worker never paused outside a transaction")


async def test_a_paused_workers_payments_are_never_reported_not_applied(
        journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker is paused (SIGSTOP) longer than its lease with two payments in flight. The
    orchestrator presumes it dead and probes them: not applied (yet). The worker wakes, finds
    its lease gone, and the payments land. The final journal must say COMPLETED for both, from
    the worker's own receipts (flagged late), and no key may be paid twice."""
    here = tmp_path / "world"
    honest_agents.make_world(here)
    monkeypatch.setenv("TETHER_HONEST_DIR", str(here))
    app = f"honest-worker-{os.getpid()}-{tmp_path.name}"[:60]
    env = {**os.environ, "PYTHONPATH": pythonpath(), "PGAPPNAME": app}
    ledger = honest_agents.Ledger(here / "ledger.db")
    procs: list[asyncio.subprocess.Process] = []
    try:
        async with tether.Supervisor(journal_url, tools=honest_agents.TOOLS,
                                     recover=False) as sup:
            # A lease a loaded machine does not lose on its own: this test is about a pause.
            # Losing it earlier starts the worker's bounded wait for its calls early, and a
            # long pause could then use that wait up (honest, but another scenario).
            proc = await start_worker(journal_url, env, lease=3.0)
            procs.append(proc)
            handle = await sup.delegate(honest_agents.payer, ["P-1", "P-2"], remote=True)

            async def sent() -> dict[str, dict[str, object]]:
                return honest_agents.requests(here)

            async def lease_lost() -> int:
                return int(await sup.journal.peek(
                    lambda db: db.execute("SELECT COUNT(*) FROM events WHERE kind = ?",
                                          ("lease_lost",)).fetchone()[0]))

            await eventually(sent, lambda r: len(r) == 2, "both payments to be sent")
            await pause_outside_transactions(proc, journal_url, app)
            assert await lease_lost() == 0, "the worker lost its lease before it was paused"
            # Waiting on the task, the orchestrator presumes the worker dead once its lease ran
            # out, and probes both payments: the provider has no entry for either key yet.
            waiter = asyncio.ensure_future(handle.wait())
            try:
                async def probed() -> list[tether.ActionRecord]:
                    return await sup.journal.actions([handle.id])

                await eventually(probed, lambda acts: len(acts) == 2 and all(
                    (a.evidence or {}).get("probe") == "NOT_APPLIED" for a in acts),
                    "the orchestrator to probe the paused worker's payments")
                assert ledger.keys() == {}
            finally:
                # From here on only the worker reports on its calls: this orchestrator stops
                # waiting (and probing), so that a receipt never races a probe.
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
                os.kill(proc.pid, signal.SIGCONT)

            # The worker wakes and learns that its lease is gone (or has already stopped).
            await eventually(lambda: _either(lease_lost(), proc),
                             lambda seen: seen, "the worker to find its lease gone")
            for key, request in honest_agents.requests(here).items():  # the payments land
                honest_agents.land(here, key, str(request["order_id"]), int(str(
                    request["cents"])))
            code = await asyncio.wait_for(proc.wait(), 30.0)
            assert proc.stderr is not None
            stderr = (await proc.stderr.read()).decode()
        applied = ledger.keys()
        assert len(applied) == 2
        async with tether.Supervisor(journal_url, tools=honest_agents.TOOLS) as fresh:
            final = await fresh.report(handle.id)  # recovered on start: probes what is in doubt
            history = [(e.kind, e.detail.get("new", e.detail.get("verdict", "")))
                       for e in await fresh.journal.events([handle.id])]
        actions = final.all_actions()
        assert_honest(actions, applied, f" (the worker exited {code}: {stderr.strip()[-300:]})")
        receipts = {a.idempotency_key: (a.state.value, a.late, a.evidence) for a in actions}
        assert len(actions) == 2 and all(a.late for a in actions), (
            f"the worker's receipts were not recorded (exit {code}: {stderr.strip()[-300:]}); "
            f"the journal has {receipts}; its history: {history}")
        assert final.outcome.terminal, f"the delegation never settled: {final.outcome.value}"
    finally:
        ledger.close()
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                await p.wait()


async def _either(lease_lost: Awaitable[int], proc: asyncio.subprocess.Process) -> bool:
    return await lease_lost > 0 or proc.returncode is not None


# -- 4: a CLI recall that meets a busy child ------------------------------------------------------

async def test_a_cli_recall_that_meets_the_fence_first_is_drained_and_reported(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tether recall` lands while the child is busy (no gateway call), and the child's next
    call meets the journal's fence before this supervisor has heard of the intent (here it
    never polls, and the journal does not push). The owner must still drain the delegation to
    a terminal state, and the CLI print the report."""
    pay = PaymentService(latency=0.0)
    busy = asyncio.Event()
    first_done = asyncio.Event()

    @tether.tool(probe=pay.lookup)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(refund, order_id="C-1", cents=5)
        first_done.set()
        await busy.wait()  # a long model call: nothing passes the gateway meanwhile
        await ctx.call(refund, order_id="C-2", cents=6)

    journal = tether.Journal(journal_url)
    monkeypatch.setattr(journal, "on_notify", lambda callback: False)  # polling only
    async with tether.Supervisor(journal, control_poll=3600.0) as sup:
        child = await sup.delegate(agent, tools=[refund])
        await first_done.wait()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", "recall", child.id, "--grace", "5", "--reason",
            "from the shell", "--journal", journal_url, "--json", cwd=ROOT,
            env={**os.environ, "PYTHONPATH": pythonpath()},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            async def row() -> tether.DelegationState:
                return (await sup.journal.get(child.id)).state

            await eventually(row, lambda s: s is not S.RUNNING, "the CLI's intent")
            busy.set()  # the child's next call meets the journal's fence
            try:
                out, err = await asyncio.wait_for(cli.communicate(), 10.0)
            except TimeoutError:
                state = await row()
                raise AssertionError(
                    f"the CLI never got its report: the delegation is still {state.value}, "
                    f"and this supervisor runs it: {sup.runtime(child.id)}") from None
        finally:
            if cli.returncode is None:
                cli.kill()
                await cli.wait()
        await asyncio.wait_for(child.wait(), 10.0)
        final = await sup.journal.get(child.id)
    assert cli.returncode == 0, err.decode()
    answer = json.loads(out)
    assert "report" in answer, f"the CLI printed no report: {answer}"
    assert answer["report"]["outcome"] == "RECALLED"
    assert [a["state"] for a in answer["report"]["actions"]] == ["COMPLETED"]
    assert final.state is S.RECALLED
    assert pay.refund_count("C-1") == 1 and pay.refund_count("C-2") == 0


# -- 5: a cancel from elsewhere during a re-dispatch's settle delay -------------------------------

@tether.tool(effect=tether.Effect.READ_ONLY)
async def read_file(path: str) -> str:
    return f"contents of {path}"


async def cut_then_succeed(ctx: tether.Context) -> str:
    if ctx.attempt == 1:
        await ctx.call(read_file, path="README")
        raise tether.StreamCut(tether.protocol.CutReason.STREAM_INCOMPLETE)
    return "the second attempt ran"


REDISPATCH = tether.RedispatchPolicy(retry_safe=frozenset({"read_file"}), settle_delay=1.0)


async def attempts_of(sup: tether.Supervisor, handle: tether.Handle) -> list[tuple[int, str]]:
    return [(d.attempt, d.state.value) for d in await sup.journal.delegations()
            if d.task_id == handle.task_id and d.parent_id is None]


@pytest.mark.parametrize("how", ["cancel", "terminate", "recall"])
async def test_a_cancel_from_another_supervisors_handle_in_the_settle_delay_stops_it(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing, how: str) -> None:
    async with tether.Supervisor(journal_url, clock=clock, keys=keys,
                                 redispatch=REDISPATCH) as sup, \
            tether.Supervisor(journal_url, clock=clock, keys=keys, recover=False) as sup2:
        handle = await sup.delegate(cut_then_succeed, tools=[read_file])
        first = handle.id
        await clock.sleeping(1, at_least=REDISPATCH.settle_delay)  # the settle delay
        other = sup2.handle_for(first)
        if how == "cancel":
            await other.cancel("from another orchestrator")
        elif how == "terminate":
            await other.terminate("from another orchestrator")
        else:
            await other.recall(grace=5.0, reason="from another orchestrator")
        clock.advance(REDISPATCH.settle_delay)
        outcome: Any = (await asyncio.gather(handle.result(), return_exceptions=True))[0]
        rows = await attempts_of(sup, handle)
    assert rows == [(1, "FAILED")], f"a second attempt was forked after the {how}: {rows}, " \
                                    f"result {outcome!r}"
    assert handle.attempts == [first]
    assert isinstance(outcome, tether.DelegationError)


@pytest.mark.parametrize("command", [["terminate"], ["recall", "--grace", "5"]])
async def test_a_cli_cancel_in_the_settle_delay_stops_the_redispatch(
        journal_url: str, clock: VirtualClock, command: list[str]) -> None:
    async with tether.Supervisor(journal_url, clock=clock, redispatch=REDISPATCH) as sup:
        handle = await sup.delegate(cut_then_succeed, tools=[read_file])
        first = handle.id
        await clock.sleeping(1, at_least=REDISPATCH.settle_delay)
        # The delay is the test's to end: while the CLI process starts (seconds, on a loaded
        # machine) the loop idles, and autojump would end the delay before the cancel lands.
        clock.autojump(None)
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether", *command, first, "--reason", "from the shell",
            "--journal", journal_url, "--json", cwd=ROOT,
            env={**os.environ, "PYTHONPATH": pythonpath()},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(cli.communicate(), 30.0)
        clock.advance(REDISPATCH.settle_delay)
        clock.autojump(1.0)
        outcome: Any = (await asyncio.gather(handle.result(), return_exceptions=True))[0]
        rows = await attempts_of(sup, handle)
    assert rows == [(1, "FAILED")], (
        f"a second attempt was forked after `tether {command[0]}` (exit {cli.returncode}: "
        f"{(out + err).decode().strip()[:300]}): {rows}, result {outcome!r}")
    assert isinstance(outcome, tether.DelegationError)


# -- 6: every in-flight call finishing inside grace is a clean recall -----------------------------

async def test_calls_finishing_while_the_grace_window_reads_the_journal_recall_clean(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three payments in flight, all finishing well inside grace. The first ends and wakes the
    grace window; the other two end while its read of the journal is under way, so the read
    predates their receipts (posted, not awaited) and their tasks are gone when it returns.
    That is not a call without a task: the verdict must be RECALLED_CLEAN."""
    orders = ["G-1", "G-2", "G-3"]
    release = {o: asyncio.Event() for o in orders}
    applied: dict[str, list[str]] = {}
    entered = Countdown(len(orders))

    async def lookup(order_id: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
        if idempotency_key in applied:
            return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {}, applied[
                idempotency_key][0])
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED, {})

    @tether.tool(effect=tether.Effect.EXTERNAL, probe=lookup)
    async def pay(order_id: str, cents: int, *, idempotency_key: str) -> str:
        entered.tick()
        await release[order_id].wait()
        applied.setdefault(idempotency_key, []).append(f"ref-{order_id}")
        return f"ref-{order_id}"

    async def agent(ctx: tether.Context) -> list[str]:
        return list(await asyncio.gather(*(ctx.call(pay, order_id=o, cents=1) for o in orders)))

    async with tether.Supervisor(journal_url, clock=clock, keys=keys, tools=[pay]) as sup:
        child = await sup.delegate(agent, tools=[pay])
        await entered.wait()
        recall = asyncio.create_task(child.recall(grace=5.0, reason="plan changed"))
        await clock.sleeping(1, at_least=4.9)  # the grace window waits for the calls
        rt = sup.runtime(child.id)
        assert rt is not None
        rest = rt.inflight_tasks()
        original = sup.journal.facts
        interposed: list[bool] = []

        async def facts(root_id: str) -> tether.protocol.JournalFacts:
            if interposed:
                return await original(root_id)
            interposed.append(True)
            read = asyncio.ensure_future(original(root_id))
            await asyncio.sleep(0)  # the read is queued...
            for o in orders[1:]:
                release[o].set()  # ...then the other two calls end, receipts posted after it
            await asyncio.wait(rest)
            return await read

        monkeypatch.setattr(sup.journal, "facts", facts)
        release[orders[0]].set()  # the first call ends and wakes the grace window
        report = await recall
    assert interposed, "the grace window never read the journal after the first call ended"
    assert [a.state for a in report.actions] == [A.COMPLETED] * 3
    assert report.verdict == "RECALLED_CLEAN", f"{report.verdict}: {report.reason}"
    assert report.outcome is S.RECALLED


# -- 7: the loser of a recall race gets StaleSequence ---------------------------------------------

class Race:
    """Two control requests race: each reads whatever it reads first; the first to reach the
    journal's accept waits there until the second arrives too, is accepted, and only then does
    the second go on. Both started from the same sequence: the second loses."""

    def __init__(self) -> None:
        self.arrived = 0
        self.both = asyncio.Event()
        self.first_done = asyncio.Event()

    def patch(self, monkeypatch: pytest.MonkeyPatch, journal: tether.Journal) -> None:
        original = journal.sign_and_accept

        async def racing(*args: Any, **kwargs: Any) -> Any:
            self.arrived += 1
            if self.arrived == 1:
                await self.both.wait()
                try:
                    return await original(*args, **kwargs)
                finally:
                    self.first_done.set()
            self.both.set()
            await self.first_done.wait()
            return await original(*args, **kwargs)

        monkeypatch.setattr(journal, "sign_and_accept", racing)


@pytest.mark.parametrize("other", ["handle", "supervisor"])
async def test_the_loser_of_two_concurrent_recalls_gets_stale_sequence(
        journal_url: str, clock: VirtualClock, keys: tether.KeyRing,
        monkeypatch: pytest.MonkeyPatch, other: str) -> None:
    release = asyncio.Event()
    entered = Countdown(1)
    pay = PaymentService(latency=0.0)

    @tether.tool(probe=pay.lookup)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        entered.tick()
        await release.wait()
        return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(refund, order_id="R-1", cents=1)

    race = Race()
    async with tether.Supervisor(journal_url, clock=clock, keys=keys, tools=[refund]) as sup, \
            tether.Supervisor(journal_url, clock=clock, keys=keys, recover=False) as sup2:
        child = await sup.delegate(agent, tools=[refund])
        await entered.wait()
        race.patch(monkeypatch, sup.journal)
        if other == "supervisor":
            race.patch(monkeypatch, sup2.journal)
            second = sup2.handle_for(child.id)
        else:
            second = sup.handle_for(child.id)
        calls = [asyncio.ensure_future(child.recall(grace=5.0, reason="one")),
                 asyncio.ensure_future(second.recall(grace=5.0, reason="two"))]
        await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
        release.set()  # the winner's in-flight payment finishes inside grace
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        row = await sup.journal.get(child.id)
    won = [o for o in outcomes if isinstance(o, tether.Report)]
    lost = [o for o in outcomes if not isinstance(o, tether.Report)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert isinstance(lost[0], tether.errors.StaleSequence), \
        f"the loser got {type(lost[0]).__name__}: {lost[0]}"
    assert lost[0].current == 1 and "current sequence is 1" in str(lost[0])
    assert won[0].outcome is S.RECALLED and row.control_seq == 1
