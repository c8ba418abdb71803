"""`tether recall` and `tether terminate` of every live delegation a selection names
(`--agent`, `--state`, `--since`) from another process: one signed intent each, accepted at
once; a delegation under another one selected is stopped with it; the owners drain them all
within their grace; and bad selections are one `error:` line that signs nothing."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

import tether
from tests.cli_helpers import tether_here
from tests.conftest import events_of
from tests.test_cli import child_needs_a_person, tether_cli
from tether.testing import PaymentService


async def test_a_recall_of_every_live_delegation_of_an_agent(journal_url: str) -> None:
    """Three live `payer` delegations, one with a `payer` child, each with a refund in flight;
    an `other` one; a `payer` one that ended. `tether recall --agent payer` signs three
    intents (the child is stopped with its parent), each in-flight refund finishes, every
    next call is refused, and the `other` delegation runs on."""
    pay = PaymentService(latency=0.0)
    stopped: list[BaseException] = []
    async with tether.Supervisor(journal_url) as sup:
        waiter = events_of(sup)
        release = asyncio.Event()
        started = asyncio.Semaphore(0)

        @tether.tool(probe=pay.lookup)
        async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
            started.release()
            await release.wait()
            return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

        async def pays(ctx: tether.Context, order: str) -> None:
            await ctx.call(refund, order_id=order, cents=1)
            try:
                await ctx.call(refund, order_id=order, cents=2)
            except BaseException as exc:
                stopped.append(exc)
                raise

        payer = tether.Agent("payer", pays, (refund,))

        async def delegates(ctx: tether.Context, order: str) -> None:
            await (await ctx.delegate(payer, order)).result()

        boss = tether.Agent("payer", delegates, (refund, payer))
        hold = asyncio.Event()

        async def waits(ctx: tether.Context) -> None:
            await hold.wait()

        async def quick(ctx: tether.Context) -> None:
            return None

        done = await sup.delegate(tether.Agent("payer", quick))
        await done.result()
        orders = [f"M-{uuid.uuid4().hex[:6]}" for _ in range(3)]
        a1 = await sup.delegate(payer, orders[0], tools=[refund])
        a2 = await sup.delegate(payer, orders[1], tools=[refund])
        a3 = await sup.delegate(boss, orders[2], tools=[refund, payer])
        other = await sup.delegate(tether.Agent("other", waits))
        for _ in orders:
            await started.acquire()  # every refund in flight
        child = next(r.id for r in await sup.journal.delegations()
                     if r.parent_id == a3.id)

        async def release_when_drained() -> None:
            for handle in (a1, a2, a3):
                await waiter("drain", handle.id).wait()
            release.set()

        releasing = asyncio.ensure_future(release_when_drained())
        code, out, err = await tether_cli("recall", "--agent", "payer", "--grace", "30",
                                          "--reason", "bad prompt", "--journal", journal_url,
                                          "--json")
        await releasing
        assert code == 0, (out, err)
        data = json.loads(out)
        assert data["kind"] == "RECALL"
        answers = {a["delegation"]: a for a in data["answers"]}
        assert set(answers) == {a1.id, a2.id, a3.id}, answers
        assert data["covered"] == {child: a3.id}
        for answer in answers.values():
            assert answer["accepted"] and answer["seq"] == 1, answer
            assert answer["report"]["outcome"] == "RECALLED", answer["report"]
        assert [a["state"] for a in answers[a1.id]["report"]["actions"]] == ["COMPLETED"]
        (kid,) = answers[a3.id]["report"]["children"]
        assert kid["delegation"] == child and kid["outcome"] == "RECALLED"
        assert all(pay.refund_count(o) == 1 for o in orders)
        assert len(stopped) == 3 and all(isinstance(e, tether.Recalled) for e in stopped)
        assert (await sup.journal.get(other.id)).state is tether.DelegationState.RUNNING
        assert await sup.journal.controls(other.id) == []
        hold.set()
        await other.result()


async def test_a_selection_that_matches_nothing_stops_nothing(journal_url: str) -> None:
    async with tether.Supervisor(journal_url) as sup:
        hold = asyncio.Event()

        async def waits(ctx: tether.Context) -> None:
            await hold.wait()

        live = await sup.delegate(tether.Agent("other", waits))
        code, out, err = await tether_here("terminate", "--agent", "nobody", "--journal",
                                           journal_url)
        assert code == 0, err
        assert "no live delegation matches" in out
        code, out, _ = await tether_here("recall", "--agent", "nobody", "--state", "RUNNING",
                                         "--journal", journal_url, "--json")
        assert code == 0 and json.loads(out) == {"kind": "RECALL", "answers": [],
                                                 "covered": {}}
        assert await sup.journal.controls(live.id) == []
        hold.set()
        await live.result()


async def test_a_terminate_of_a_selection_without_waiting(journal_url: str) -> None:
    """--no-wait: every intent accepted (the fences closed) and the command returns; the
    owner drains them on its own."""
    async with tether.Supervisor(journal_url) as sup:
        waiter = events_of(sup)

        async def waits(ctx: tether.Context) -> None:
            await asyncio.Event().wait()

        handles = [await sup.delegate(tether.Agent("idle", waits)) for _ in range(3)]
        code, out, err = await tether_cli("terminate", "--state", "running", "--agent",
                                          "idle", "--no-wait", "--journal", journal_url,
                                          "--json")
        assert code == 0, err
        answers = json.loads(out)["answers"]
        assert sorted(a["delegation"] for a in answers) == sorted(h.id for h in handles)
        assert all(a["accepted"] and "report" not in a for a in answers)
        for handle in handles:
            await waiter("drain", handle.id).wait()
            await handle.wait()
            report = await handle.report()
            assert report.outcome is tether.DelegationState.TERMINATED


@pytest.mark.parametrize(("args", "says"), [
    (["d_x", "--agent", "payer"], "not both"),
    ([], "name a delegation id"),
    (["--state", "COMPLETED"], "not a live state"),
    (["--state", "RUNNING,BOGUS"], "not a live state"),
    (["--state", " ,"], "takes a live state"),
    (["--agent", " "], "empty name"),
    (["--since", "last tuesday"], "--since"),
    (["--agent", "payer", "--temporal", "127.0.0.1:1"], "--temporal"),
    (["--agent", "payer", "--grace", "0"], "grace"),
    (["--agent", "payer", "--by", "\x1b[31m"], "--by"),
], ids=["id-and-selection", "neither", "settled-state", "unknown-state", "empty-state",
        "empty-agent",
        "bad-since", "temporal", "bad-grace", "unreadable-operator"])
async def test_a_bad_selection_is_one_error_line_and_signs_nothing(
        journal_url: str, args: list[str], says: str) -> None:
    async with tether.Supervisor(journal_url) as sup:
        hold = asyncio.Event()

        async def waits(ctx: tether.Context) -> None:
            await hold.wait()

        live = await sup.delegate(tether.Agent("payer", waits))
        for verb in ("recall", "terminate"):
            if verb == "terminate" and "--grace" in args:
                continue
            code, out, err = await tether_here(verb, *args, "--journal", journal_url)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (
                verb, code, out, err)
            assert says in lines[0], lines
        assert await sup.journal.controls(live.id) == []
        assert (await sup.journal.get(live.id)).state is tether.DelegationState.RUNNING
        hold.set()
        await live.result()




async def test_a_selection_with_one_already_being_recalled_stops_the_rest(
        journal_url: str) -> None:
    """One `payer` delegation is in an earlier recall's grace window, its call in flight;
    `tether recall --agent payer` recalls the other and answers for the first (another
    intent stops it: its report is waited for), rather than failing as a whole after it
    signed some intents. Exit 0 once both settled."""
    release = asyncio.Event()
    started = asyncio.Semaphore(0)

    @tether.tool(effect=tether.Effect.EXTERNAL)
    async def slow(*, idempotency_key: str) -> None:
        started.release()
        await release.wait()

    async def pays(ctx: tether.Context) -> None:
        await ctx.call(slow)
        await ctx.call(slow)

    agent = tether.Agent("payer", pays, (slow,))
    async with tether.Supervisor(journal_url) as sup:
        waiter = events_of(sup)
        first = await sup.delegate(agent, tools=[slow])
        second = await sup.delegate(agent, tools=[slow])
        await started.acquire()
        await started.acquire()
        code, _, err = await tether_here("recall", first.id, "--grace", "60", "--no-wait",
                                         "--journal", journal_url)
        assert code == 0, err
        await waiter("drain", first.id).wait()

        async def release_when_drained() -> None:
            await waiter("drain", second.id).wait()
            release.set()

        releasing = asyncio.ensure_future(release_when_drained())
        code, out, err = await tether_cli("recall", "--agent", "payer", "--grace", "30",
                                          "--journal", journal_url, "--json")
        await releasing
        assert code == 0, (out, err)
        answers = {a["delegation"]: a for a in json.loads(out)["answers"]}
        assert answers[second.id]["accepted"], answers
        assert not answers[first.id]["accepted"] and "refused" in answers[first.id]
        assert {a["report"]["outcome"] for a in answers.values()} == {"RECALLED"}
        assert len(await sup.journal.controls(first.id)) == 1  # the earlier one alone


async def test_two_bulk_recalls_racing_each_stop_every_delegation(journal_url: str) -> None:
    """Two `tether recall --agent` at once over the same delegations: every delegation gets
    exactly one intent; the loser of each race is told so per delegation (I4), and neither
    command fails as a whole."""
    async with tether.Supervisor(journal_url) as sup:
        hold = asyncio.Event()

        async def waits(ctx: tether.Context) -> None:
            await hold.wait()

        handles = [await sup.delegate(tether.Agent("race", waits)) for _ in range(120)]
        args = ("recall", "--agent", "race", "--grace", "5", "--no-wait", "--journal",
                journal_url, "--json")
        (code1, out1, err1), (code2, out2, err2) = await asyncio.gather(
            tether_cli(*args), tether_cli(*args))
        assert (code1, code2) == (0, 0), (err1, err2)
        accepted = [a["delegation"] for out in (out1, out2)
                    for a in json.loads(out)["answers"] if a["accepted"]]
        assert sorted(accepted) == sorted(h.id for h in handles)  # each exactly once
        for handle in handles:
            assert len(await sup.journal.controls(handle.id)) == 1


async def test_temporal_address_in_the_environment_does_not_refuse_a_selection(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Operators of Temporal deployments export $TEMPORAL_ADDRESS: a selection still works
    (its runs fenced in the journal); only an explicit --temporal is refused."""
    monkeypatch.setenv("TEMPORAL_ADDRESS", "127.0.0.1:1")
    async with tether.Supervisor(journal_url) as sup:
        waiter = events_of(sup)

        async def waits(ctx: tether.Context) -> None:
            await asyncio.Event().wait()

        live = await sup.delegate(tether.Agent("idle", waits))
        code, out, err = await tether_here("terminate", "--agent", "idle", "--no-wait",
                                           "--journal", journal_url, "--json")
        assert code == 0, err
        assert [a["delegation"] for a in json.loads(out)["answers"]] == [live.id]
        await waiter("drain", live.id).wait()


async def test_a_selection_exits_1_when_one_of_its_delegations_needs_a_person(
        journal_url: str) -> None:
    """`tether terminate --agent root`: the root's child's call was cut and cannot be probed
    (the provider's lookup is down), so it needs a person: exit 1, not 0 for the root's own
    TERMINATED, as for one delegation by id."""
    async with child_needs_a_person(journal_url) as parent:
        code, out, err = await tether_cli("terminate", "--agent", "root", "--journal",
                                          journal_url, "--json")
        (answer,) = json.loads(out)["answers"]
        assert answer["delegation"] == parent.id
        (child,) = answer["report"]["children"]
        assert (answer["report"]["outcome"], child["outcome"]) == ("TERMINATED",
                                                                  "NEEDS_ATTENTION")
        assert code == 1, err
