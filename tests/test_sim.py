"""``tether sim``: the deterministic simulator of the protocol core.

A clean bounded run, replay determinism, and mutation tests: a deliberately broken core
decision must be caught, in the violation class it breaks. The simulator drives the real
core functions through their modules, so swapping one with monkeypatch reaches every caller.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._core import outcome, redispatch
from tether._core.model import ActionState, DelegationState, ProbeOutcome
from tether._sim import world
from tether._sim.journal import FIXES
from tether._sim.trial import run_sim, run_trial
from tether.testing import VirtualClock

ALL_FIXES = frozenset(FIXES)
runner = CliRunner()


def classes(result: dict[str, object]) -> dict[str, int]:
    counts = result["counts"]
    assert isinstance(counts, dict)
    return {k: v for k, v in counts.items() if v}


# -- clean runs and determinism ----------------------------------------------------------

def test_bounded_run_finds_no_violation() -> None:
    """With the fixes of the defects it found applied to its model (see FIXES), thousands of
    trials with every fault find nothing."""
    result = run_sim(3000, 20261, fixes=ALL_FIXES)  # its speed is bench/run.py's to judge
    assert result["violations"] == [], result["violations"][:5]
    assert result["trials"] == 3000
    faults = result["faults"]
    assert isinstance(faults, dict) and set(faults) >= set(world.FAULTS)
    totals = result["totals"]
    assert isinstance(totals, dict)
    # The faults really happened: restarts, lost commits read back, applied payments.
    assert totals["restarts"] > 100 and totals["read_backs"] > 100 and totals["applied"] > 3000


def test_the_faithful_model_is_clean_away_from_the_defects_it_found() -> None:
    """Without cut streams, crashes and pauses (which the three defects need), the model as
    the runtime is today finds nothing either."""
    quiet = tuple(f for f in world.FAULTS if f not in ("stream_cut", "crash", "pause"))
    result = run_sim(1500, 77, quiet)
    assert result["violations"] == [], result["violations"][:5]


def test_replay_is_step_for_step() -> None:
    for seed in (7, 168, 34270):
        first = run_trial(seed, trace=True)
        again = run_trial(seed, trace=True)
        assert first.trace is not None and len(first.trace) > 50
        assert first.trace == again.trace
        assert [v.to_json() for v in first.violations] == [v.to_json() for v in again.violations]
    # Tracing draws nothing from the seed: an untraced run takes the same steps.
    assert run_trial(168).steps == run_trial(168, trace=True).steps


def test_a_trials_active_faults_replay_from_its_own_list() -> None:
    for seed in (11, 12, 13):
        chosen = world.active_faults(seed, world.FAULTS)
        if chosen:
            assert world.active_faults(seed, chosen) == chosen
            assert run_trial(seed, chosen, trace=True).trace == \
                run_trial(seed, world.FAULTS, trace=True).trace


# -- what the simulator found in the journal and runtime rules it models -----------------

@pytest.mark.parametrize(("seed", "fix", "found"), [
    (168, "attempt_fence", {"ghost"}),  # a cut child re-dispatched after its parent's terminate
    (41197, "queued_fenced", {"stuck"}),  # recalled in the queue, its issuer crashed
    (114217, "probe_time", {"dishonest", "lost"}),  # probe asked before the deadline
])
def test_defects_found_replay_and_their_fixes_remove_them(seed: int, fix: str,
                                                           found: set[str]) -> None:
    others = ALL_FIXES - {fix}
    broken = {v.kind for v in run_trial(seed, fixes=others).violations}
    assert broken >= found, broken
    assert run_trial(seed, fixes=ALL_FIXES).violations == []


def test_the_faithful_model_finds_the_redispatch_ghost_often() -> None:
    result = run_sim(300, 5, ("stream_cut", "race"), fixes=ALL_FIXES - {"attempt_fence"})
    assert classes(result).get("ghost", 0) > 0


# -- mutation tests: a broken core decision is caught ------------------------------------

def broken_run(monkeypatch: pytest.MonkeyPatch, module: object, name: str, fn: object,
               faults: Sequence[str], trials: int = 400, seed: int = 99) -> dict[str, int]:
    monkeypatch.setattr(module, name, fn)
    return classes(run_sim(trials, seed, tuple(faults), fixes=ALL_FIXES))


def test_probe_not_applied_taken_as_final_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = outcome.judge_probe

    def final(answer: ProbeOutcome, *, voided: bool, deadline_at: float,
              now: float, tolerance: float) -> ActionState:
        if answer is ProbeOutcome.NOT_APPLIED:
            return ActionState.NOT_APPLIED  # ignores the dispatch deadline
        return original(answer, voided=voided, deadline_at=deadline_at, now=now,
                        tolerance=tolerance)

    found = broken_run(monkeypatch, outcome, "judge_probe", final,
                       ("late_apply", "reply_lost", "race"))
    assert found.get("dishonest", 0) > 0 and found.get("duplicate", 0) > 0, found


def test_judging_deadlines_without_the_clock_tolerance_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Deadlines are written on the executor's clock and judged on the prober's, each within
    CLOCK_BOUND of the true time: judged without the tolerance, a probe's "not yet" on a clock
    running ahead is taken as final while the request can still land."""
    original = outcome.may_still_apply

    def exact(*, deadline_at: float, now: float, tolerance: float) -> bool:
        return original(deadline_at=deadline_at, now=now, tolerance=0.0)

    found = broken_run(monkeypatch, outcome, "may_still_apply", exact,
                       ("clock", "late_apply"), trials=3000)
    assert found.get("dishonest", 0) + found.get("duplicate", 0) > 0, found


def test_a_gate_that_ignores_the_fence_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = outcome.judge_gate

    def open_gate(*, fenced: bool, epoch: int, task_epoch: int, caller_epoch: int,
                  lease_until: float | None, now: float) -> outcome.Gate:
        return original(fenced=False, epoch=epoch, task_epoch=task_epoch,
                        caller_epoch=caller_epoch, lease_until=lease_until, now=now)

    # The owner hears of an intent late (lost notifications, a pause): only the fence stops it.
    found = broken_run(monkeypatch, outcome, "judge_gate", open_gate,
                       ("race", "notify_lost", "pause"))
    assert found.get("ghost", 0) > 0, found


def test_keys_freed_while_in_doubt_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = outcome.decide_key
    live = (ActionState.PENDING, ActionState.IN_DOUBT, ActionState.UNKNOWN)

    def free(tool: str, args_hash: str, prior: Sequence[outcome.PriorCall],
             now: float, tolerance: float) -> outcome.KeyDecision:
        return original(tool, args_hash, [p for p in prior if p.state not in live], now,
                        tolerance)

    found = broken_run(monkeypatch, outcome, "decide_key", free,
                       ("late_apply", "reply_lost", "race"))
    assert found.get("duplicate", 0) > 0, found


def test_settling_with_calls_in_flight_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = outcome.settle

    def eager(state: DelegationState, actions: Iterable[outcome.ActionFacts],
              fallback: DelegationState, *, children_settled: bool = True) -> DelegationState:
        done = [a for a in actions if a.state not in outcome.UNSETTLED]
        return original(state, done, fallback)  # as if nothing could still apply

    found = broken_run(monkeypatch, outcome, "settle", eager,
                       ("late_apply", "reply_lost", "race"))
    assert found.get("dishonest", 0) > 0, found


def test_completed_keys_not_replayed_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = outcome.decide_key

    def forgetful(tool: str, args_hash: str, prior: Sequence[outcome.PriorCall],
                  now: float, tolerance: float) -> outcome.KeyDecision:
        return original(tool, args_hash,
                        [p for p in prior if p.state is not ActionState.COMPLETED], now,
                        tolerance)

    found = broken_run(monkeypatch, outcome, "decide_key", forgetful, ("race",))
    assert found.get("duplicate", 0) > 0, found


def test_presuming_every_owner_alive_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def immortal(owner: outcome.OwnerFacts | None, *, now: float, server_now: float | None,
                 heartbeat_lease: float) -> bool:
        return owner is not None

    found = broken_run(monkeypatch, outcome, "owner_alive", immortal, ("crash",), trials=150)
    assert found.get("stuck", 0) > 0, found


def test_ignoring_a_cancel_before_redispatch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(at_start: int, now: int, code: redispatch.Code) -> None:
        return None

    found = broken_run(monkeypatch, redispatch, "cancelled", never,
                       ("stream_cut", "race"), trials=600)
    assert found.get("ghost", 0) > 0, found


def test_a_provider_that_applies_past_the_deadline_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    found = broken_run(monkeypatch, world.Provider, "overdue", True, ("late_apply",))
    assert found.get("dishonest", 0) > 0, found


# -- the command line --------------------------------------------------------------------

def test_cli_json_has_the_chaos_shape() -> None:
    result = runner.invoke(app, ["sim", "--trials", "60", "--seed", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("trials", "seed", "replay", "backend", "faults", "outcomes", "violations",
                "counts", "inject", "trials_detail", "records"):
        assert key in data
    assert data["trials"] == 60 and data["violations"] == []
    assert set(data["counts"]) >= {"lost", "duplicate", "ghost", "unreconciled", "dishonest",
                                   "stuck"}
    assert data["trials_per_minute"] > 0


def test_cli_replay_prints_one_line_per_step_and_fails_like_the_run() -> None:
    without = ["--without", "attempt_fence,probe_time"]
    result = runner.invoke(app, ["sim", "--replay", "168", *without])
    assert result.exit_code == 1
    again = runner.invoke(app, ["sim", "--replay", "168", *without])
    steps = [ln for ln in result.stdout.splitlines() if ln.endswith(" step")]
    assert len(steps) > 50
    assert steps == [ln for ln in again.stdout.splitlines() if ln.endswith(" step")]
    assert "ghost" in result.stdout and "tether sim --replay 168" in result.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--trials", "0"], "--trials must be a positive integer"),
    (["--trials", "-3"], "--trials must be a positive integer"),
    (["--trials", "many"], "--trials must be an integer"),
    (["--seed", "x1"], "--seed must be an integer"),
    (["--faults", "meteor"], "unknown fault kind(s) meteor"),
    (["--faults", "crash,meteor"], "unknown fault kind(s) meteor"),
    (["--faults", ","], "unknown fault kind(s)"),
    (["--replay", "soon"], "--replay must be an integer"),
    (["--without", "everything"], "unknown rule(s) everything"),
])
def test_cli_bad_input_is_one_line(args: list[str], says: str) -> None:
    result = runner.invoke(app, ["sim", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], lines


# -- the same defects in the real runtime (fixed now; these failed before) ----------------

async def test_runtime_redispatches_no_child_after_its_parent_was_terminated(
        tmp_path: Path) -> None:
    """attempt_fence: a cut child waiting out its settle delay under a parent that is then
    terminated never forks its next attempt."""
    applied: list[str] = []
    clock = VirtualClock()

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def pay(n: int, *, idempotency_key: str) -> str:
        applied.append(idempotency_key)
        return "ok"

    @tether.agent(tools=[pay])
    async def child(ctx: tether.Context) -> None:
        if ctx.attempt == 1:  # cut before any tool ran: re-dispatched after the delay
            raise tether.StreamCut(tether.protocol.CutReason.STREAM_INCOMPLETE)
        await ctx.call(pay, n=1)

    @tether.agent(tools=[child])
    async def parent(ctx: tether.Context) -> None:
        await (await ctx.delegate(child)).result()

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", clock=clock,
                                 redispatch=tether.RedispatchPolicy(settle_delay=0.3)) as sup:
        handle = await sup.delegate(parent)
        await clock.sleeping(1, at_least=0.29)  # the child was cut and waits out its delay
        await handle.terminate("stop everything")
        clock.autojump(0.01)  # let the delay and everything after it run out
        rows = [d for d in await sup.journal.delegations() if d.parent_id == handle.id]
        for _ in range(500):
            events = await sup.journal.events([r.id for r in rows])
            if any(e.kind == "redispatch_decision" and e.detail.get("check") != "attempt_ended"
                   for e in events) or len(rows) > 1:
                break
            await sup.wake(0.01)
            rows = [d for d in await sup.journal.delegations() if d.parent_id == handle.id]
    assert applied == [], "a payment landed after terminate() returned"
    assert [r.attempt for r in rows] == [1], "a second attempt was forked under the fence"


async def test_runtime_judges_a_probe_at_the_time_it_was_sent(tmp_path: Path) -> None:
    """probe_time: a probe that looked before the deadline and answered after it says nothing
    of a request that landed in between: the action stays in doubt, never NOT_APPLIED."""
    ledger: dict[str, float] = {}
    clock = VirtualClock()

    async def send(n: int, *, idempotency_key: str) -> str:
        async def land() -> None:  # the request waits in the network, lands at 0.3 s
            await clock.sleep(0.3)
            ledger[idempotency_key] = 1.0
        background.append(asyncio.get_running_loop().create_task(land()))
        await clock.sleep(10)  # no reply in time
        return "ok"

    async def probe(n: int, *, idempotency_key: str) -> tether.ProbeResult:
        found = idempotency_key in ledger  # the provider looks before the request lands...
        await clock.sleep(0.5)  # ...and its answer comes back after the deadline (0.4 s)
        return tether.ProbeResult(tether.ProbeOutcome.COMPLETED if found
                                  else tether.ProbeOutcome.NOT_APPLIED)

    background: list[asyncio.Task[None]] = []
    pay = tether.Tool("pay", tether.Effect.EXTERNAL, send, probe, dispatch_deadline=0.4)

    @tether.agent(tools=[pay])
    async def payer(ctx: tether.Context) -> None:
        await ctx.call(pay, n=1)

    async with tether.Supervisor(f"sqlite:///{tmp_path / 'j.db'}", tools=[pay], clock=clock,
                                 policy=tether.Policy(probe_timeout=2.0)) as sup:
        handle = await sup.delegate(payer)
        await clock.sleeping(2)  # the call waits for its reply, its request for the network
        clock.autojump(0.01)
        report = await handle.terminate("stop")
        await asyncio.gather(*background)
    assert ledger, "the provider applied the payment"
    assert report.all_actions()[0].state is not ActionState.NOT_APPLIED, \
        "the report says NOT_APPLIED for a payment the provider applied"
