"""An operator at the journal: ``tether verify`` (its subprocess-free entry,
``audit.verify_journal``) under the deployment's key directory, again and again while the
processes run, once they were all killed, and after the final recovery. Nobody tampers in a
trial, so anything it names is a false alarm: the judge's ``tampered``, as is any chain that
does not verify when the trial ends (``chains_named``)."""

from __future__ import annotations

import asyncio
import itertools
import random
import sqlite3
from collections import Counter
from collections.abc import Coroutine
from typing import Any, Protocol

from tether._core.errors import TetherError
from tether._journal import chainops, trustops
from tether._journal.journal import Journal
from tether._runtime import audit
from tether._runtime.keys import KeyRing
from tether._sim.loop import HOST, Host, SimLoop
from tether._sim.plan import keys

OVERDUE = 30.0  # virtual seconds: a run not done by then is left (its process was killed)


class Trial(Protocol):
    """What of a trial (``trial.Trial``) the operator uses."""

    seed: int
    loop: SimLoop
    operators: list[Host]
    verified: list[str]
    errors: list[str]
    reliable: bool
    stats: Counter[str]

    def journal(self, host: Host) -> Journal: ...
    def keyring(self, host: Host) -> KeyRing: ...
    def note(self, text: str) -> None: ...
    def start(self, host: Host, main: Coroutine[Any, Any, None]) -> None: ...


async def _verify(t: Trial) -> None:
    """One ``tether verify`` of the whole journal, by the process running it."""
    host = HOST.get()
    assert host is not None
    ring = t.keyring(host)
    try:
        async with t.journal(host) as j:
            if (await j.registry(ring.trusted)).root is None:
                t.note("tether verify: no process has set the journal up yet")
                return
            found = await audit.verify_journal(j, ring, None)
    except TetherError as exc:  # the journal away (its server crashed, a commit lost)
        if t.reliable:  # after the final recovery nothing is lost any more: a finding
            t.errors.append(f"tether verify failed: {type(exc).__name__}: {exc}")
        t.note(f"tether verify failed: {type(exc).__name__}: {exc}")
        return
    t.stats["verify_runs"] += 1
    t.verified += [f"tether verify at {t.loop.time():.3f}: {p['delegation']}: {p['record']}: "
                   f"{p['problem']}" for p in found["problems"]]


async def _run(t: Trial, host: Host) -> None:
    """``_verify`` as a process of its own, to its end (or its death)."""
    done: asyncio.Future[None] = t.loop.create_future()

    async def main() -> None:
        try:
            await _verify(t)
        finally:
            if not done.done():
                done.set_result(None)

    t.start(host, main())
    await asyncio.wait([done], timeout=OVERDUE)


def start_verifier(t: Trial) -> None:
    """The operator's shell: ``tether verify`` again and again while the processes run, each
    run a process of its own (``verify.N``), a pause between them. The pauses are drawn on a
    stream of their own; the runs' journals draw from the trial's like every process's."""
    rng = random.Random(f"{t.seed}:verify")

    async def shell() -> None:
        for n in itertools.count():
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            host = Host(f"verify.{n}")
            t.operators.append(host)
            await _run(t, host)

    shell_host = Host("operator")
    t.operators.append(shell_host)
    t.start(shell_host, shell())


async def verify_now(t: Trial, name: str) -> None:
    """One run, to its end, by a process outside every group (the trial stops those)."""
    await _run(t, Host(name))


def chains_named(db: sqlite3.Connection) -> list[str]:
    """Each delegation's chain read back at the end as ``tether verify`` reads it, under the
    trial's key: what does not verify (the journal's own check, on the rows every process
    wrote)."""
    _, pins = keys()
    ids = [r[0] for r in db.execute("SELECT id FROM delegations ORDER BY id").fetchall()]
    try:
        verdicts = chainops.verdicts(db, ids, trustops.registry(db, pins), {}, None)
    except TetherError as exc:  # a finding of this trial, as chaos judges it, not a crash
        return [f"the chains could not be read: {exc}"]
    return [f"{v.delegation_id}: {p.record}: {p.problem}" for v in verdicts for p in v.problems]


__all__ = ["chains_named", "start_verifier", "verify_now"]
