"""``tether chaos``: run trials, reconcile after each, and judge by the ledger.

Violation classes, each checked against the outside world's own record:
lost (applied, yet no COMPLETED journal record), duplicate (a key applied more than once),
ghost (an intent accepted after its delegation's fence closed, or an effect with no intent),
unreconciled (an action left PENDING or IN_DOUBT), dishonest (NOT_APPLIED or FAILED for an
effect that was applied) and stuck (a delegation that never reached a terminal state).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tether
from tether._chaos.ledger import Ledger
from tether._chaos.plan import FAULTS, Plan, make_plan, plans

CLASSES = ("lost", "duplicate", "ghost", "unreconciled", "dishonest", "stuck")


@dataclass(frozen=True)
class Violation:
    trial_seed: int
    fault: str
    kind: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"trial_seed": self.trial_seed, "fault": self.fault, "class": self.kind,
                "detail": self.detail}


def trial_url(directory: Path, base: str | None, plan: Plan) -> str:
    """The trial's own journal: a SQLite file in its folder, or a fresh PostgreSQL schema."""
    if base is None:
        return f"sqlite:///{directory / 'journal.db'}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}schema=chaos_{plan.seed}_{os.getpid()}&keys={directory / 'keys'}"


def drop(url: str) -> None:
    if url.startswith("postgresql"):
        import psycopg
        from psycopg import sql

        from tether._journal.postgres import split_url

        conninfo, schema, _ = split_url(url)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))


def run_orchestrator(directory: Path, plan: Plan, url: str, timeout: float) -> str:
    """'exited', 'killed' or 'hung' (then killed by us)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tether._chaos.orchestrator", str(directory), plan.to_json(),
             url],
            capture_output=True, text=True, timeout=timeout, env={**os.environ})
    except subprocess.TimeoutExpired:
        return "hung"
    if proc.returncode == -9:
        return "killed"
    if proc.returncode != 0:
        raise RuntimeError(f"orchestrator failed (seed {plan.seed}): {proc.stderr[-800:]}")
    return "exited"


async def recover(directory: Path, url: str) -> None:
    """A fresh supervisor on the journal, with probes that work, reconciles whatever the
    orchestrator left (its process is gone: the owner is dead)."""
    ledger = Ledger(directory / "ledger.db")

    async def probe(order_id: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
        n = ledger.count(idempotency_key)
        outcome = tether.ProbeOutcome.COMPLETED if n else tether.ProbeOutcome.NOT_APPLIED
        return tether.ProbeResult(outcome, {"applications": n})

    @tether.tool(effect=tether.Effect.EXTERNAL, probe=probe)
    async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
        raise AssertionError("recovery never runs a tool")

    keys = tether.KeyRing.load(directory / "keys")
    async with tether.Supervisor(url, keys=keys, tools=[refund]) as sup:
        await sup.recover()
    ledger.close()


async def judge(directory: Path, url: str, plan: Plan, outcome: str) -> list[Violation]:
    ledger = Ledger(directory / "ledger.db")
    applied = ledger.keys()
    ledger.close()
    found: list[Violation] = []

    def flag(kind: str, detail: str) -> None:
        found.append(Violation(plan.seed, plan.fault, kind, detail))

    if outcome == "hung":
        flag("stuck", "the orchestrator did not finish")
    async with tether.Journal(url, create=False) as j:
        rows = await j.delegations()
        actions = await j.actions([r.id for r in rows])
        fences: dict[str, float] = {}
        for r in rows:
            controls = await j.controls(r.id)
            if controls:
                fences[r.id] = min(c.accepted_at for c in controls)
    by_id = {r.id: r for r in rows}

    def fence_of(delegation_id: str) -> float | None:
        times = []
        node = by_id.get(delegation_id)
        while node is not None:
            if node.id in fences:
                times.append(fences[node.id])
            node = by_id.get(node.parent_id or "")
        return min(times) if times else None

    for r in rows:
        if not r.state.terminal:
            flag("stuck", f"{r.id} is {r.state.value}")
    completed_keys = {a.idempotency_key for a in actions
                      if a.state is tether.ActionState.COMPLETED}
    journaled_keys = {a.idempotency_key for a in actions}
    for key, n in applied.items():
        if n > 1:
            flag("duplicate", f"key {key} applied {n} times")
        if key not in journaled_keys:
            flag("ghost", f"key {key} applied with no intent in the journal")
        if key not in completed_keys:
            flag("lost", f"key {key} applied, no COMPLETED record")
    for a in actions:
        if a.state in (tether.ActionState.PENDING, tether.ActionState.IN_DOUBT):
            flag("unreconciled", f"{a.id} ({a.idempotency_key}) left {a.state.value}")
        if a.state in (tether.ActionState.NOT_APPLIED, tether.ActionState.FAILED) \
                and a.idempotency_key in applied:
            flag("dishonest", f"{a.id} says {a.state.value}, the ledger says applied")
        fence = fence_of(a.delegation_id)
        if fence is not None and a.started_at > fence:
            flag("ghost", f"{a.id} intent at {a.started_at} after the fence at {fence}")
    return found


def one_trial(plan: Plan, base: str | None = None,
              timeout: float = 30.0) -> tuple[str, list[Violation]]:
    with tempfile.TemporaryDirectory(prefix="tether-chaos-") as tmp:
        directory = Path(tmp)
        url = trial_url(directory, base, plan)
        try:
            outcome = run_orchestrator(directory, plan, url, timeout)
            if not (directory / "keys" / "signing.json").exists():
                return outcome, []  # killed before it opened the journal: nothing happened
            try:
                asyncio.run(recover(directory, url))
            except tether.TetherError as exc:  # a recovery that fails is a finding
                found = asyncio.run(judge(directory, url, plan, outcome))
                return outcome, [*found, Violation(plan.seed, plan.fault, "stuck",
                                                   f"recovery failed: {exc}")]
            return outcome, asyncio.run(judge(directory, url, plan, outcome))
        finally:
            drop(url)


def run_chaos(trials: int, seed: int, faults: tuple[str, ...] = FAULTS,
              replay: int | None = None, journal: str | None = None,
              progress: Callable[[int, Plan, str], None] | None = None) -> dict[str, Any]:
    chosen = [make_plan(replay)] if replay is not None else plans(seed, trials, faults)
    per_fault: dict[str, Counter[str]] = {f: Counter() for f in FAULTS}
    violations: list[Violation] = []
    outcomes: Counter[str] = Counter()
    for i, plan in enumerate(chosen):
        outcome, found = one_trial(plan, journal)
        outcomes[outcome] += 1
        per_fault[plan.fault]["trials"] += 1
        per_fault[plan.fault]["violations"] += len(found)
        violations += found
        if progress is not None:
            progress(i, plan, outcome)
    counts = Counter(v.kind for v in violations)
    return {
        "trials": len(chosen), "seed": seed, "replay": replay,
        "backend": "sqlite" if journal is None else "postgresql",
        "faults": {f: {"trials": c["trials"], "violations": c["violations"]}
                   for f, c in per_fault.items() if c["trials"]},
        "outcomes": dict(outcomes),
        "violations": [v.to_json() for v in violations],
        "counts": {k: counts.get(k, 0) for k in CLASSES},
    }
