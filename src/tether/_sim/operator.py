"""An operator at the journal: ``tether verify`` (its subprocess-free entry,
``verify_journal``) under the deployment's key directory, now and then while the processes
run, in the quiet once they stopped (before the journal's server may crash, losing what had
not reached its disk), and after the final recovery. Nobody tampers in a trial, so anything
it names is a false alarm: the judge's ``tampered``, as is any chain that does not verify
when the trial ends (``chains_named``)."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from collections.abc import Coroutine
from typing import Any, Protocol

from tether._cli.verify import verify_journal
from tether._core.errors import TetherError
from tether._journal import chainops, trustops
from tether._journal.journal import Journal
from tether._runtime.keys import KeyRing
from tether._sim.loop import HOST, Host, SimLoop
from tether._sim.plan import keys


class Trial(Protocol):
    """What of a trial (``trial.Trial``) the operator uses."""

    seed: int
    loop: SimLoop
    others: list[Host]
    verified: list[str]

    def journal(self, host: Host) -> Journal: ...
    def keyring(self) -> KeyRing: ...
    def note(self, text: str) -> None: ...
    def new_host(self, base: str, group: list[Host]) -> Host: ...
    def start(self, host: Host, main: Coroutine[Any, Any, None]) -> None: ...


async def _verify(t: Trial, at: float = 0.0) -> None:
    await asyncio.sleep(at)
    host = HOST.get()
    assert host is not None
    try:
        async with t.journal(host) as j:
            found = await verify_journal(j, t.keyring(), None)
    except TetherError as exc:  # the journal away (its server crashed): the operator retries
        t.note(f"tether verify failed: {type(exc).__name__}: {exc}")
        return
    t.verified += [f"tether verify at {t.loop.time():.3f}: {p['delegation']}: {p['record']}: "
                   f"{p['problem']}" for p in found["problems"]]


def start_verifier(t: Trial) -> None:
    """A few runs while the processes run, each a process of its own (as from a shell),
    drawn on a stream of their own so that the trial's other draws stay as they were."""
    rng = random.Random(f"{t.seed}:verify")
    for at in sorted(rng.uniform(0.1, 6.0) for _ in range(rng.randint(2, 5))):
        t.start(t.new_host("verify", t.others), _verify(t, at))


async def verify_now(t: Trial, name: str) -> None:
    """One run, to its end, by a process outside every group (the trial stops those)."""
    await t.loop.start(Host(name), _verify(t))


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
