"""A probe runs as a task of its own (``reconcile.probe_one``): whatever ends the wait for it (an
answer, the timeout, the prober itself cancelled), the probe never runs on unwatched, and an
exception it ends with is looked at, never "Task exception was never retrieved" on the
user's stderr (found by ``tether sim`` on fresh seeds, 2026120541)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any

import tether
from tether._core.report import ActionRecord
from tether._runtime.clock import SystemClock
from tether._runtime.reconcile import probe_one


def _action() -> ActionRecord:
    return ActionRecord("a1", "d1", 0, "pay", tether.Effect.EXTERNAL, {"n": 1}, "t:pay:0",
                        tether.ActionState.IN_DOUBT, None, None, None, False, 0.0, None, None)


async def test_a_cancelled_prober_cancels_its_probe() -> None:
    started, ended = asyncio.Event(), []

    async def probe(n: int, *, idempotency_key: str) -> tether.ProbeResult:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        raise AssertionError("unreachable")

    pay = tether.Tool("pay", tether.Effect.EXTERNAL, probe, probe)
    prober = asyncio.ensure_future(probe_one(_action(), pay, SystemClock(), 60.0))
    await started.wait()
    prober.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await prober
    for _ in range(5):
        await asyncio.sleep(0)
    assert ended == ["cancelled"], "the probe ran on after its prober was cancelled"


async def test_a_probe_that_fails_as_it_is_cut_leaves_nothing_unretrieved() -> None:
    """Timed out and cancelled, the probe's client raises its own error on the way out (a
    connection torn down): nobody awaits it any more, and nothing is logged for it."""
    loop = asyncio.get_running_loop()
    unretrieved: list[Any] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))

    async def probe(n: int, *, idempotency_key: str) -> tether.ProbeResult:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionError("probe failed") from None
        raise AssertionError("unreachable")

    pay = tether.Tool("pay", tether.Effect.EXTERNAL, probe, probe)
    try:
        answer = await probe_one(_action(), pay, SystemClock(), 0.01)
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert answer.outcome is tether.ProbeOutcome.UNKNOWN
    assert "timed out" in answer.evidence["reason"]
    assert unretrieved == []
