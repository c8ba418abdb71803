"""The outside world for tests/test_honest_outcomes.py: payment providers that keep their own
ledger and never deduplicate, so that a key paid twice shows up twice.

``Provider`` lives in the test's process and runs on its virtual clock. The worker side (the
``payer`` agent, run by ``tether worker --agents tests.honest_agents:AGENTS``) talks to a
provider the test plays through files in ``TETHER_HONEST_DIR``: a call announces its request
in ``requests/<key>`` and waits for ``replies/<key>``; the test applies the payment in the
ledger (``ledger.db``, read by the probe) and writes the reply when it decides. So the test
chooses when a payment lands, and waits for events, never by sleeping. Like any provider of a
tool, it applies a request only before the call's dispatch deadline (``land`` refuses one past
it): a test slowed past it would otherwise break the contract that "not applied" relies on.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections import defaultdict
from pathlib import Path

import tether
from tether.testing import VirtualClock


class Provider:
    """A payment provider with latency on a virtual clock. Once a request reaches it, it is
    applied whatever the caller does (cancelling the caller only loses the reply), and every
    request is applied: nothing is deduplicated by key."""

    def __init__(self, clock: VirtualClock, latency: float) -> None:
        self.clock = clock
        self.latency = latency
        self.sent: list[str] = []  # keys, one per request that reached the provider
        self.applied: dict[str, list[str]] = defaultdict(list)  # key -> refs, one per payment
        self._work: set[asyncio.Future[str]] = set()
        self._changed = asyncio.Event()
        self.tool = tether.tool(effect=tether.Effect.EXTERNAL, name="pay",
                                probe=self.lookup)(self.pay)

    async def pay(self, order_id: str, cents: int, *, idempotency_key: str) -> str:
        self.sent.append(idempotency_key)
        self._changed.set()
        work = asyncio.ensure_future(self._process(idempotency_key))
        self._work.add(work)
        work.add_done_callback(self._work.discard)
        return await asyncio.shield(work)

    async def _process(self, key: str) -> str:
        await self.clock.sleep(self.latency)
        ref = f"ref-{key}-{len(self.applied[key]) + 1}"
        self.applied[key].append(ref)
        return ref

    async def lookup(self, order_id: str, cents: int, *,
                     idempotency_key: str) -> tether.ProbeResult:
        refs = self.applied.get(idempotency_key)
        if not refs:
            return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED,
                                      {"provider": "no entry for key"})
        return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"provider_ref": refs[0]},
                                  result=refs[0])

    async def wait_sent(self, n: int) -> None:
        while len(self.sent) < n:
            self._changed.clear()
            await self._changed.wait()

    async def settle(self) -> None:
        """Wait until every request that reached the provider has been applied."""
        while self._work:
            await asyncio.gather(*self._work, return_exceptions=True)


# -- the worker side ----------------------------------------------------------------------------

def world() -> Path:
    return Path(os.environ["TETHER_HONEST_DIR"])


class Ledger:
    """The file provider's own record: one row per application, never deduplicated."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS applied (n INTEGER PRIMARY KEY, "
                         "key TEXT NOT NULL, order_id TEXT NOT NULL, cents INTEGER NOT NULL)")

    def apply(self, key: str, order_id: str, cents: int) -> str:
        cur = self._db.execute("INSERT INTO applied (key, order_id, cents) VALUES (?, ?, ?)",
                               (key, order_id, cents))
        return f"ref-{cur.lastrowid}"

    def refs(self, key: str) -> list[str]:
        return [f"ref-{n}" for (n,) in self._db.execute(
            "SELECT n FROM applied WHERE key = ? ORDER BY n", (key,))]

    def keys(self) -> dict[str, int]:
        return {k: int(n) for k, n in self._db.execute(
            "SELECT key, COUNT(*) FROM applied GROUP BY key")}

    def close(self) -> None:
        self._db.close()


def make_world(directory: Path) -> None:
    for sub in ("requests", "replies"):
        (directory / sub).mkdir(parents=True, exist_ok=True)


def requests(directory: Path) -> dict[str, dict[str, object]]:
    """The requests that reached the provider so far, by idempotency key."""
    found: dict[str, dict[str, object]] = {}
    for path in sorted((directory / "requests").iterdir()):
        if path.suffix != ".tmp":
            found[path.name] = json.loads(path.read_text())
    return found


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def land(directory: Path, key: str, order_id: str, cents: int) -> str:
    """The provider applies one payment and sends its reply: before the call's dispatch
    deadline, as the tool declares (counted here from the request's arrival, a little after the
    intent the deadline runs from, so with a margin)."""
    sent_at = float(str(requests(directory)[key]["sent_at"]))
    late = time.time() - sent_at
    if late >= PAY_DEADLINE - DEADLINE_MARGIN:
        raise AssertionError(
            f"the test landed payment {key} {late:.1f} s after its request, past the "
            f"{PAY_DEADLINE:g} s dispatch deadline that its tool declares: no provider may "
            "apply it then, and nothing here could be judged")
    ledger = Ledger(directory / "ledger.db")
    try:
        ref = ledger.apply(key, order_id, cents)
    finally:
        ledger.close()
    write_atomically(directory / "replies" / key, ref)
    return ref


async def _probe(order_id: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
    ledger = Ledger(world() / "ledger.db")
    try:
        refs = ledger.refs(idempotency_key)
    finally:
        ledger.close()
    if not refs:
        return tether.ProbeResult(tether.ProbeOutcome.NOT_APPLIED,
                                  {"provider": "no entry for key"})
    return tether.ProbeResult(tether.ProbeOutcome.COMPLETED, {"provider_ref": refs[0]},
                              result=refs[0])


# The test lands each payment after a worker's pause and the orchestrator's probes, which a
# loaded machine stretches: the deadline is far enough that no such run reaches it.
PAY_DEADLINE = 600.0
DEADLINE_MARGIN = 5.0


@tether.tool(effect=tether.Effect.EXTERNAL, probe=_probe, dispatch_deadline=PAY_DEADLINE)
async def pay(order_id: str, cents: int, *, idempotency_key: str) -> str:
    """Send the payment to the provider, then wait for its reply (the provider applies it
    when the test says so, whatever this process does meanwhile)."""
    here = world()
    write_atomically(here / "requests" / idempotency_key,
                     json.dumps({"order_id": order_id, "cents": cents,
                                 "sent_at": time.time()}))
    reply = here / "replies" / idempotency_key
    while True:
        if reply.exists():
            return reply.read_text()
        await asyncio.sleep(0.02)


@tether.agent(tools=[pay])
async def payer(ctx: tether.Context, orders: list[str]) -> list[str]:
    """Several payments at once."""
    refs = await asyncio.gather(*(ctx.call(pay, order_id=o, cents=100) for o in orders))
    return list(refs)


AGENTS = [payer]
TOOLS = [pay]
