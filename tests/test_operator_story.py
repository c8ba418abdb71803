"""The operator's night, end to end: 500 live delegations, one payment in doubt; found with one
command, recalled, resolved with one command, and the audit trail shown."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import tether

ROOT = Path(__file__).resolve().parent.parent


async def tether_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", *args, cwd=ROOT,
        env={**os.environ, "COLUMNS": "100", "TETHER_OPERATOR": "night operator"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_one_payment_in_doubt_among_500(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    quiet, charging = asyncio.Event(), asyncio.Event()

    @tether.tool(dispatch_deadline=10.0)  # the provider has no lookup: no probe
    async def charge(order_id: str, cents: int, *, idempotency_key: str) -> str:
        charging.set()
        await asyncio.Event().wait()  # the provider never answers
        return "never"

    @tether.agent(tools=[charge])
    async def billing(ctx: tether.Context, order_id: str) -> None:
        if order_id == "O-137":
            await ctx.call(charge, order_id=order_id, cents=4200)
        await quiet.wait()

    async with tether.Supervisor(url, tools=[charge]) as sup:
        handles = [await sup.delegate(billing, f"O-{i}") for i in range(500)]
        await charging.wait()
        stuck = handles[137]

        # 1. Which delegation has a payment in flight? One command.
        code, out, _ = await tether_cli("actions", "--in-flight", "--journal", url, "--json")
        assert code == 1  # something is in flight
        (flying,) = json.loads(out)
        assert flying["delegation"] == stuck.id and flying["tool"] == "charge"
        code, out, _ = await tether_cli("ls", "--live", "--limit", "20", "--journal", url)
        assert code == 0 and "next page: --before" in out
        assert handles[-1].id in out  # newest first, ids whole

        # 2. Recall it; the provider cannot say, so the payment ends UNKNOWN.
        code, out, _ = await tether_cli("recall", stuck.id, "--grace", "0.5", "--reason",
                                        "customer called: stop billing", "--journal", url,
                                        "--json")
        assert code == 1, out  # not settled: a person must decide
        report = json.loads(out)["report"]
        assert report["outcome"] == "NEEDS_ATTENTION"
        assert [a["state"] for a in report["actions"]] == ["UNKNOWN"]

        # 3. The queue: exactly that payment.
        code, out, _ = await tether_cli("actions", "--state", "UNKNOWN", "--journal", url,
                                        "--json")
        (unknown,) = json.loads(out)
        assert code == 1 and unknown["id"] == flying["id"]

        # 4. The operator checked the provider's dashboard: it went through. One command.
        code, out, err = await tether_cli("resolve", unknown["id"], "--as", "COMPLETED",
                                          "--note", "dashboard: charge ch_9 captured 03:12",
                                          "--journal", url)
        assert code == 0, err
        assert "RECONCILED" in out

        # 5. The audit trail: who decided what, why and when, beside the signed recall.
        code, out, _ = await tether_cli("show", stuck.id, "--journal", url, "--json")
        trail = json.loads(out)
        (decision,) = trail["decisions"]
        assert decision["operator"] == "night operator"
        assert decision["note"] == "dashboard: charge ch_9 captured 03:12"
        assert decision["outcome"] == "COMPLETED" and decision["old"] == "UNKNOWN"
        assert [i["kind"] for i in trail["intents"]] == ["RECALL", "ACK", "RESOLUTION"]
        assert all(i["verified"] == "ok" for i in trail["intents"])
        kinds = [e["kind"] for e in trail["events"]]
        assert kinds.index("control") < kinds.index("verdict") < kinds.index("resolved")
        code, text, _ = await tether_cli("show", stuck.id, "--journal", url)
        assert code == 0 and "night operator" in text and "customer called" in text

        # Nobody else was touched, and nothing is left for a person.
        code, out, _ = await tether_cli("ls", "--live", "--limit", "0", "--journal", url,
                                        "--json")
        assert len(json.loads(out)) == 499
        code, out, _ = await tether_cli("actions", "--state", "UNKNOWN", "--journal", url)
        assert code == 0
        quiet.set()
