"""One encoding for every value tether stores: a value round-trips exactly or is refused when
it is handed over, with the same rules in this process and through a worker."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tether
from tether._core import values
from tether.protocol import CutReason, Partial

BIG = 2**60 + 1  # above 2**53: a float cannot hold it, RFC 8785 refuses it


def same(a: Any, b: Any) -> bool:
    """Equal with exact types (1, 1.0 and True are not the same value); a tuple given is a
    list read back."""
    if isinstance(a, tuple):
        a = list(a)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and a == b
    return bool(a == b)


class Opaque:
    pass


scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**200,
                                                                   max_value=2**200)
           | st.floats() | st.text() | st.binary(max_size=4) | st.just(Opaque())
           | st.sampled_from([2**53 + 1, -2**63, 10**300, "\ud800", float("nan")])
           # around the stored limit (built lazily: Python will not print such integers)
           | st.sampled_from([12_999, 13_000, 20_000]).map(lambda bits: -(2**bits)))
anything = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=5), inner, max_size=4)
                   | st.dictionaries(st.integers(), inner, min_size=1, max_size=2)
                   | st.frozensets(st.integers(), max_size=2)),
    max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(anything)
def test_a_value_round_trips_or_is_refused_up_front(value: Any) -> None:
    try:
        text = values.dumps(value)
    except tether.errors.UserError:
        return
    assert same(value, values.loads(text))
    text.encode("utf-8")  # storable as it is in SQLite and PostgreSQL text columns


@pytest.mark.parametrize(("value", "why"), [
    ({1: "a"}, "key 1"), ({"a": {1, 2}}, "frozenset|set"), (b"x", "bytes"),
    (float("inf"), "infinity"), ("\udc80", "surrogate"), (2**20000, "bits"),
], ids=["int-key", "set", "bytes", "inf", "surrogate", "huge-int"])
def test_what_is_refused_is_named(value: Any, why: str) -> None:
    with pytest.raises(tether.errors.UserError, match=why):
        values.dumps(value)


def test_a_value_that_contains_itself_is_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(tether.errors.UserError, match="itself"):
        values.dumps(loop)


async def echo(ctx: tether.Context, n: int, *, tag: dict[str, Any]) -> dict[str, Any]:
    return {"n": n, "doubled": n * 2, "tag": tag}


async def test_big_integers_round_trip_through_a_local_delegation(journal_url: str) -> None:
    @tether.tool
    async def transfer(cents: int, *, idempotency_key: str) -> int:
        return cents + 1

    async def agent(ctx: tether.Context, n: int) -> list[int]:
        return [n, await ctx.call(transfer, cents=n)]

    async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral()) as sup:
        handle = await sup.delegate(agent, BIG, tools=[transfer])
        assert await handle.result() == [BIG, BIG + 1]
        row = await sup.journal.get(handle.id)
        assert row.args == {"args": [BIG], "kwargs": {}} and row.result == [BIG, BIG + 1]
        (action,) = (await handle.report()).actions
        assert action.args == {"cents": BIG} and action.result == BIG + 1


async def test_a_queued_task_gives_the_same_result_as_a_local_one(journal_url: str) -> None:
    agent = tether.Agent("echo", echo, ())
    keys = tether.KeyRing.ephemeral()  # the worker trusts the key the journal is rooted in
    async with tether.Supervisor(journal_url, keys=keys) as sup:
        local = await (await sup.delegate(agent, BIG, tag={"k": [1.5, None]})).result()
        queued = await sup.delegate(agent, BIG, tag={"k": [1.5, None]}, remote=True)
        async with tether.Worker(journal_url, [agent], poll=0.01, keys=keys) as worker:
            running = asyncio.ensure_future(worker.run())
            remote = await queued.result()
            worker.stop()
            await running
    assert local == remote == {"n": BIG, "doubled": 2 * BIG, "tag": {"k": [1.5, None]}}


async def test_a_result_that_cannot_be_stored_fails_the_task_everywhere(
        journal_url: str) -> None:
    """Never SUCCEEDED with a placeholder: the child fails, here and through a worker."""

    async def body(ctx: tether.Context) -> Any:
        return {"when": {1, 2}}

    agent = tether.Agent("odd", body, ())
    keys = tether.KeyRing.ephemeral()  # the worker trusts the key the journal is rooted in
    async with tether.Supervisor(journal_url, keys=keys) as sup:
        local = await sup.delegate(agent)
        with pytest.raises(tether.DelegationError, match="cannot be stored"):
            await local.result()
        queued = await sup.delegate(agent, remote=True)
        async with tether.Worker(journal_url, [agent], poll=0.01, keys=keys) as worker:
            running = asyncio.ensure_future(worker.run())
            with pytest.raises(tether.DelegationError, match="cannot be stored"):
                await queued.result()
            worker.stop()
            await running
        for handle in (local, queued):
            row = await sup.journal.get(handle.id)
            assert row.state is tether.DelegationState.FAILED and row.result is None


async def test_arguments_are_refused_before_anything_is_journaled(journal_url: str) -> None:
    agent = tether.Agent("echo", echo, ())
    async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral()) as sup:
        for bad in ({1: "a"}, {"x": float("nan")}, {"b": b"raw"}):
            for remote in (False, True):
                with pytest.raises(tether.errors.UserError, match="cannot be serialized"):
                    await sup.delegate(agent, 1, tag=bad, remote=remote)
        assert await sup.journal.delegations() == []


async def test_tool_arguments_follow_the_same_rules(journal_url: str) -> None:
    """``{1: "a"}`` would be stored as ``{"1": "a"}``: refused before the intent, not changed."""
    calls: list[Any] = []

    @tether.tool
    async def send(body: Any, *, idempotency_key: str) -> None:
        calls.append(body)

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(send, body={1: "a"})

    async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral()) as sup:
        handle = await sup.delegate(agent, tools=[send])
        with pytest.raises(tether.DelegationError) as info:
            await handle.result()
        assert isinstance(info.value.__cause__, tether.errors.UserError)
        assert "cannot be serialized" in str(info.value.__cause__)
        assert (await handle.report()).actions == () and calls == []


async def test_a_probe_answer_that_cannot_be_stored_is_still_recorded(
        journal_url: str) -> None:
    """The probe's verdict stands; its unstorable evidence and result are kept as text, and
    the reconciliation is not lost to a journal write that fails."""
    applied: list[str] = []

    async def lookup(order: str, *, idempotency_key: str) -> tether.ProbeResult:
        return tether.ProbeResult(tether.ProbeOutcome.COMPLETED,
                                  {"seen": {"at", "provider"}}, result=Opaque())

    @tether.tool(probe=lookup)
    async def charge(order: str, *, idempotency_key: str) -> str:
        applied.append(order)
        raise ConnectionResetError("reply lost")  # applied, but we cannot tell: IN_DOUBT

    async def agent(ctx: tether.Context) -> None:
        await ctx.call(charge, order="P-1")

    async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral()) as sup:
        handle = await sup.delegate(agent, tools=[charge])
        with pytest.raises(tether.DelegationError):
            await handle.result()
        report = await handle.report()
    (action,) = report.actions
    assert applied == ["P-1"] and action.state is tether.ActionState.COMPLETED
    assert action.evidence is not None and "cannot be stored" in action.evidence["reason"]
    assert report.outcome is tether.DelegationState.RECONCILED


async def _through_the_journal(url: str, value: Any) -> None:
    async def keep(ctx: tether.Context, v: Any) -> Any:
        return v

    async with tether.Supervisor(url, keys=tether.KeyRing.ephemeral()) as sup:
        try:
            handle = await sup.delegate(keep, value, tools=[])
        except tether.errors.UserError:
            with pytest.raises(tether.errors.UserError):
                values.dumps(value)
            return
        await handle.result()
        row = await sup.journal.get(handle.id)
    assert same([value], row.args["args"]) and same(value, row.result)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(anything)
def test_what_the_journal_gives_back_is_what_was_delegated(journal_url: str,
                                                           value: Any) -> None:
    """The same property through a real journal on each backend: arguments and result."""
    asyncio.run(_through_the_journal(journal_url, value))


async def test_a_salvaged_partial_that_cannot_be_stored_fails_the_task(
        journal_url: str) -> None:
    async def cut(ctx: tether.Context) -> None:
        raise tether.StreamCut(CutReason.STREAM_INCOMPLETE,
                               Partial(text="half", tool_results=({"ids": {1, 2}},)))

    async with tether.Supervisor(journal_url, keys=tether.KeyRing.ephemeral()) as sup:
        handle = await sup.delegate(cut, tools=[])
        with pytest.raises(tether.DelegationError, match="cannot be stored"):
            await asyncio.wait_for(handle.result(), 30)
        row = await sup.journal.get(handle.id)
        assert row.state is tether.DelegationState.FAILED and row.result is None
