"""Shared fixtures. Every test runs on a virtual clock unless it needs another process."""

from __future__ import annotations

import asyncio
import functools
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import psycopg
import pytest
from psycopg import sql

import tether
from tether.testing import PaymentService, VirtualClock

# Property tests judge what is computed, not how fast: Hypothesis's 200 ms deadline per
# example failed them on a loaded machine (timing goals belong in bench/).
hypothesis.settings.register_profile("tether", deadline=None)
hypothesis.settings.load_profile("tether")

# The Temporal dev server's fixture (``temporal_address``), for the tests that use it.
pytest_plugins = ["tests.temporal_helpers"]


@pytest.fixture
def clock() -> VirtualClock:
    """Time moves when a test advances it; once every task waits (nothing left to choreograph:
    a supervisor closing, say) it jumps to the next deadline, as Trio's autojump does, instead
    of hanging."""
    clock = VirtualClock()
    clock.autojump()
    return clock


PG_URL = os.environ.get("TETHER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@functools.cache
def pg_unavailable() -> str | None:
    try:
        psycopg.connect(PG_URL, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {PG_URL} is not reachable ({str(exc).strip()[:120]})"
    return None


@pytest.fixture(params=["sqlite", "postgresql"])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Every journal test runs on both backends; each PostgreSQL test gets its own schema,
    dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'journal.db'}"
        return
    yield from pg_schema(tmp_path)


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    """A journal URL on PostgreSQL alone, in a schema of its own."""
    yield from pg_schema(tmp_path)


def need_pg() -> None:
    """Fail, never skip, without a server: scripts/test starts one, and a run that skips a
    third of the suite would look as green as one that ran it."""
    reason = pg_unavailable()
    if reason is not None:
        pytest.fail(f"{reason}: scripts/test starts a server (or set TETHER_TEST_PG)")


def pg_schema(tmp_path: Path) -> Iterator[str]:
    need_pg()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    yield f"{PG_URL}?schema={schema}&keys={tmp_path / 'keys'}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """For the tests that open the SQLite file itself."""
    return f"sqlite:///{tmp_path / 'journal.db'}"


@pytest.fixture
def keys() -> tether.KeyRing:
    return tether.KeyRing.ephemeral()


class Shop:
    """Tools over a simulated payment provider, as a user would write them."""

    def __init__(self, pay: PaymentService) -> None:
        self.pay = pay
        self.gate: asyncio.Event | None = None  # when set, get_order waits on it

        @tether.tool(effect=tether.Effect.READ_ONLY)
        async def get_order(order_id: str) -> dict[str, Any]:
            if self.gate is not None:
                await self.gate.wait()
            return {"order_id": order_id, "total": 1250}

        @tether.tool(effect=tether.Effect.EXTERNAL, probe=pay.lookup, compensate=pay.reverse)
        async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
            return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

        self.get_order = get_order
        self.refund = refund

    @property
    def tools(self) -> list[tether.Tool]:
        return [self.get_order, self.refund]

    async def refund_agent(self, ctx: tether.Context, order_id: str) -> str:
        order = await ctx.call(self.get_order, order_id=order_id)
        ref: str = await ctx.call(self.refund, order_id=order_id, cents=order["total"])
        return ref


@pytest.fixture
def pay(clock: VirtualClock) -> PaymentService:
    return PaymentService(clock, latency=1.0)


@pytest.fixture
def shop(pay: PaymentService) -> Shop:
    return Shop(pay)


@pytest.fixture
async def sup(journal_url: str, clock: VirtualClock, keys: tether.KeyRing,
              shop: Shop) -> AsyncIterator[tether.Supervisor]:
    async with tether.Supervisor(journal_url, clock=clock, keys=keys,
                                 tools=shop.tools) as supervisor:
        yield supervisor
        clock.autojump()  # closing waits a bounded while for calls still running


async def until(check: Callable[[], bool], what: str, within: float = 60.0) -> None:
    """Poll a condition until it holds; a failure naming ``what`` after ``within`` seconds
    (a test that has not seen it by then hangs)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


# A supervisor that judges the dispatch deadlines its own process wrote, on its own clock:
# the clock tolerance (5 s by default, for clocks of other hosts) only delays the re-probe.
ONE_CLOCK = tether.Policy(clock_tolerance=0.25)


async def settled(sup: tether.Supervisor, delegation_id: str,
                  within: float = 60.0) -> tether.Report:
    """The report once the delegation is settled: its owner probes calls left in doubt again
    at their dispatch deadlines, in the background. Real time: for tests on the system clock
    (on a virtual clock, advance it past the deadline first)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        report = await sup.report(delegation_id)
        if report.outcome.terminal or loop.time() > deadline:
            return report
        await sup.wake(0.02)


def around_the_verdict(conclude: Callable[..., Awaitable[Any]], when: str,
                       act: Callable[[], Awaitable[None]]) -> Callable[..., Awaitable[Any]]:
    """A drain's ending (``Accounting.conclude``) with ``act`` done once: before the drain's
    verdict is written (``when == "before-its-verdict"``), or after it, while the drain has
    not ended yet."""
    done: list[bool] = []

    async def racing(root_id: str, fallback: tether.DelegationState, **kw: Any) -> Any:
        if not done and when == "before-its-verdict":
            done.append(True)
            await act()
        report = await conclude(root_id, fallback, **kw)
        if not done:
            done.append(True)
            await act()
        return report

    return racing


def events_of(sup: tether.Supervisor) -> Callable[[str, str], asyncio.Event]:
    """``waiter(event, delegation_id)``: an asyncio.Event set when the supervisor emits it."""
    seen: dict[tuple[str, str], asyncio.Event] = {}

    def listener(event: str, delegation_id: str) -> None:
        seen.setdefault((event, delegation_id), asyncio.Event()).set()

    sup.listen(listener)

    def waiter(event: str, delegation_id: str) -> asyncio.Event:
        return seen.setdefault((event, delegation_id), asyncio.Event())

    return waiter


class Countdown:
    """An event that fires after ``n`` ticks: 'all n tools have started'."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.event = asyncio.Event()

    def tick(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()

    async def wait(self) -> None:
        await self.event.wait()


@pytest.fixture
def bank_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test MCP bank's ledger, and the named pipes that steer its ``hold-*`` payments."""
    from tests import remote_agents

    gates = tmp_path / "gates"
    remote_agents.make_gates(gates, "started", "release", "cancelled")
    monkeypatch.setenv("TETHER_TEST_LEDGER", str(tmp_path / "bank.db"))
    monkeypatch.setenv("TETHER_TEST_GATES", str(gates))
    return tmp_path / "bank.db"


@pytest.fixture(scope="module")
def private_pg() -> Iterator[Any]:
    """A PostgreSQL server of the module's own (initdb in a temporary directory, its own port)
    for the tests that restart it, pause it or end its backends: never the shared one."""
    from tether._chaos.pgserver import PrivateServer

    with PrivateServer() as server:
        yield server


@pytest.fixture
def private_url(private_pg: Any, tmp_path: Path) -> Iterator[str]:
    """A journal URL on the private server, in a schema of its own; the server is running
    (resumed if a test paused it) when the test ends."""
    yield f"{private_pg.url}?schema=t_{uuid.uuid4().hex[:16]}&keys={tmp_path / 'keys'}"
    private_pg.resume()
