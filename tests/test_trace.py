"""``tether trace show`` and ``tether trace analyze`` on journals made by the test."""

from __future__ import annotations

import json

import pytest

import tether
from tether.testing import VirtualClock

from .test_cli import tether_cli


async def test_trace_analyze_reports_counts_and_enrichment(journal_url: str,
                                                           clock: VirtualClock) -> None:
    no_retry = tether.RedispatchPolicy(budget=0)
    plan = [("A", 400.0, True, "sonnet"), ("B", 1000.0, True, "sonnet"),
            ("C", 30.0, False, "haiku"), ("D", 100.0, False, "sonnet")]
    async with tether.Supervisor(journal_url, clock=clock, keys=tether.KeyRing.ephemeral(),
                                 redispatch=no_retry) as sup:
        handles = {}
        for name, life, cut, model in plan:
            async def child(ctx: tether.Context, life: float = life, cut: bool = cut) -> str:
                await clock.sleep(life)
                if cut:
                    raise tether.StreamCut(tether.protocol.CutReason.STREAM_INCOMPLETE)
                return "ok"

            handles[name] = await sup.delegate(child, model=model)
        await clock.sleeping(4)
        for name, life, _, _ in sorted(plan, key=lambda p: p[1]):
            clock.advance(life - clock.now())
            await handles[name].wait()
    code, out, err = await tether_cli("trace", "analyze", "--journal", journal_url, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["children"], data["failures"], data["failure_rate"]) == (4, 2, 0.5)
    assert data["median_lifetime"] == {"failed": 700.0, "all": 250.0}
    lifetime = {r["value"]: r for r in data["dimensions"]["lifetime"]}
    assert (lifetime["6-15m"]["failed"], lifetime["6-15m"]["all"]) == (1, 1)
    assert lifetime["6-15m"]["enrichment"] == 2.0
    assert lifetime["15-30m"]["enrichment"] == 2.0
    assert lifetime["<1m"]["enrichment"] == 0.0
    by_model = {r["value"]: r for r in data["dimensions"]["model"]}
    assert (by_model["sonnet"]["failed"], by_model["sonnet"]["all"]) == (2, 3)
    assert by_model["sonnet"]["enrichment"] == pytest.approx(1.333, abs=1e-3)
    assert by_model["haiku"]["enrichment"] == 0.0
    assert data["dimensions"]["depth"] == [{
        "value": "0", "failed": 2, "all": 4, "failed_share": 1.0, "base_share": 1.0,
        "enrichment": 1.0, "failure_rate": 0.5}]


async def test_trace_show_renders_a_task_across_attempts(journal_url: str,
                                                         clock: VirtualClock) -> None:
    async def flaky(ctx: tether.Context) -> str:
        if ctx.attempt == 1:
            raise tether.StreamCut(tether.protocol.CutReason.CONNECT_ERROR)
        return "second time lucky"

    async with tether.Supervisor(journal_url, clock=clock,
                                 keys=tether.KeyRing.ephemeral()) as sup:
        handle = await sup.delegate(flaky, task_id="research-42")
        await clock.sleeping(1)
        clock.advance(sup.redispatch.settle_delay)
        assert await handle.result() == "second time lucky"
    code, out, err = await tether_cli("trace", "show", handle.attempts[0], "--journal",
                                      journal_url, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["task"] == "research-42"
    assert [(a["attempt"], a["state"], a["failure"]) for a in data["attempts"]] == [
        (1, "FAILED", "stream_cut:connect_error"), (2, "SUCCEEDED", None)]
    kinds = [(e["attempt"], e["kind"]) for e in data["events"]]
    assert (1, "redispatch_decision") in kinds and (2, "redispatch") in kinds
    decision = next(e for e in data["events"] if e["kind"] == "redispatch_decision")
    assert decision["detail"]["code"] == "redispatch_no_tool_ran"
    code, out, _ = await tether_cli("trace", "show", "research-42", "--journal", journal_url)
    assert code == 0 and "redispatch" in out and "attempt 2" in out
    code, _, err = await tether_cli("trace", "show", "nope", "--journal", journal_url)
    assert code == 2 and err.startswith("error:")
