"""The CLI: control from another process, listings, and one-line errors for user mistakes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlparse

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether.testing import PaymentService

from .conftest import ONE_CLOCK, events_of, settled, until

ROOT = Path(__file__).resolve().parent.parent


async def tether_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", *args, cwd=ROOT, env={**os.environ},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_recall_from_another_process(journal_url: str) -> None:
    """The running supervisor learns of the CLI's signed intent from the journal, lets the
    in-flight action finish, and the CLI prints the report; the next call is refused."""
    pay = PaymentService(latency=0.0)
    outcome: list[BaseException] = []

    async with tether.Supervisor(journal_url) as sup:
        waiter = events_of(sup)

        @tether.tool(probe=pay.lookup)
        async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
            await waiter("drain", child_id[0]).wait()  # finishes only once the recall is seen
            return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(refund, order_id="X-1", cents=5)
            try:
                await ctx.call(refund, order_id="X-1", cents=6)
            except BaseException as exc:
                outcome.append(exc)
                raise

        child_id: list[str] = []
        child = await sup.delegate(agent, tools=[refund])
        child_id.append(child.id)
        code, out, err = await tether_cli("recall", child.id, "--grace", "30", "--reason",
                                          "from the shell", "--journal", journal_url, "--json")
        assert code == 0, err
        answer = json.loads(out)
        assert answer["seq"] == 1
        report = answer["report"]
        assert report["outcome"] == "RECALLED"
        assert [a["state"] for a in report["actions"]] == ["COMPLETED"]
        assert isinstance(outcome[0], tether.Recalled)
        assert pay.refund_count("X-1") == 1


async def test_terminate_from_another_process(journal_url: str) -> None:
    pay = PaymentService(latency=0.0)
    async with tether.Supervisor(journal_url, tools=[], policy=ONE_CLOCK) as sup:
        entered = asyncio.Event()

        # Its provider can no longer apply a call 2 s after its intent.
        @tether.tool(probe=pay.lookup, dispatch_deadline=2.0)
        async def hang(order_id: str, cents: int, *, idempotency_key: str) -> None:
            entered.set()
            await asyncio.Event().wait()

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(hang, order_id="X-2", cents=1)

        child = await sup.delegate(agent, tools=[hang])
        await entered.wait()
        code, out, err = await tether_cli("terminate", child.id, "--journal", journal_url,
                                          "--json")
        report = json.loads(out)["report"]
        # Exit 0 only when it settled; drained with a call not final yet is exit 1.
        assert code == (1 if report["outcome"] == "TERMINATING" else 0), err
        (action,) = report["actions"]
        if report["outcome"] == "TERMINATING":  # drained within the deadline: not final yet
            assert action["state"] == "IN_DOUBT"
            assert "not applied yet" in action["evidence"]["not_final"]
            report = (await settled(sup, child.id)).to_json()  # the owner probes again
            (action,) = report["actions"]
        assert report["outcome"] == "RECONCILED"
        assert action["state"] == "NOT_APPLIED"
        assert action["evidence"]["provider"] == "no entry for key"


async def test_listing_and_show_with_verified_intents(journal_url: str, shop: Any) -> None:
    shop.gate = asyncio.Event()
    async with tether.Supervisor(journal_url, tools=shop.tools) as sup:
        child = await sup.delegate(shop.refund_agent, "L-1", tools=shop.tools)
        await child.terminate("done here")
    code, out, _ = await tether_cli("ls", "--journal", journal_url, "--json")
    assert code == 0
    assert [(r["id"], r["state"]) for r in json.loads(out)] == [(child.id, "TERMINATED")]
    code, out, _ = await tether_cli("show", child.id, "--journal", journal_url, "--json")
    data = json.loads(out)
    assert [i["kind"] for i in data["intents"]] == ["TERMINATE"]
    assert data["intents"][0]["verified"] == "ok"
    assert data["intents"][0]["body"]["reason"] == "done here"
    code, out, _ = await tether_cli("show", child.id, "--journal", journal_url)
    assert code == 0 and "verified" in out and "TERMINATE" in out


async def test_show_flags_an_intent_whose_key_is_no_longer_trusted(journal_url: str,
                                                                   shop: Any,
                                                                   tmp_path: Path) -> None:
    shop.gate = asyncio.Event()
    async with tether.Supervisor(journal_url, tools=shop.tools) as sup:
        child = await sup.delegate(shop.refund_agent, "L-2", tools=shop.tools)
        await child.terminate()
    tether.KeyRing.init(tmp_path / "other-keys")
    _, out, _ = await tether_cli("show", child.id, "--journal", journal_url, "--json",
                                 "--keys", str(tmp_path / "other-keys"))
    assert "REFUSED" in json.loads(out)["intents"][0]["verified"]


runner = CliRunner()


def one_line_error(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    journal = f"sqlite:///{tmp_path / 'j.db'}"
    text = tmp_path / "notes.txt"
    text.write_text("not a journal")
    assert "no journal" in one_line_error(["ls", "--journal", journal])
    assert "not a tether journal" in one_line_error(["ls", "--journal", f"sqlite:///{text}"])
    assert "not understood" in one_line_error(["ls", "--journal", "mysql://x"])
    assert "grace" in one_line_error(["recall", "d_x", "--grace", "nan", "--journal", journal])
    assert "grace" in one_line_error(["recall", "d_x", "--grace", "0", "--journal", journal])
    assert "module:attribute" in one_line_error(["reconcile", "--tools", "nocolon",
                                                 "--journal", journal])
    assert "no signing key" in one_line_error(["keys", "show", "--keys", str(tmp_path / "k")])
    assert text.read_text() == "not a journal"


@pytest.mark.parametrize("args", [["recall", "d_missing"], ["show", "d_missing"],
                                  ["terminate", "d_missing"]])
async def test_unknown_delegation_is_one_line(journal_url: str, args: list[str]) -> None:
    async with tether.Supervisor(journal_url):
        pass
    code, out, err = await tether_cli(*args, "--journal", journal_url)
    assert code == 2
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err + out


def test_keys_init_refuses_to_overwrite(tmp_path: Path) -> None:
    first = runner.invoke(app, ["keys", "init", "--keys", str(tmp_path)])
    assert first.exit_code == 0
    before = (tmp_path / "signing.json").read_bytes()
    assert "refusing" in one_line_error(["keys", "init", "--keys", str(tmp_path)])
    assert (tmp_path / "signing.json").read_bytes() == before
    shown = runner.invoke(app, ["keys", "show", "--keys", str(tmp_path), "--json"])
    data = json.loads(shown.output)
    assert data["signing"] in data["trusted"]


def test_usage_errors_exit_nonzero_without_traceback() -> None:
    result = runner.invoke(app, ["recall"])
    assert result.exit_code == 2 and "Traceback" not in result.output


async def test_demo_prevents_each_failure_and_reports_counts(tmp_path: Path) -> None:
    journal = f"sqlite:///{tmp_path / 'demo.db'}"
    code, out, err = await tether_cli("demo", "--json", "--journal", journal)
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] and data["journal"] == str(tmp_path / "demo.db")
    assert [s["id"] for s in data["scenes"]] == ["a", "b", "c", "d"]
    for scene in data["scenes"]:
        assert scene["prevented"], scene
        assert scene["naive"]["duplicated"] >= 1  # the failure really happens without tether
        t = scene["tether"]
        assert (t["intended"], t["applied"], t["duplicated"]) == (1, 1, 0)
        assert scene["tether"]["unrecorded"] == 0
    code, out, _ = await tether_cli("ls", "--journal", journal, "--json")
    assert code == 0 and len(json.loads(out)) >= 4


async def test_demo_on_postgresql(pg_url: str) -> None:
    """The README's PostgreSQL command: the same demo, the same checks, on the server."""
    code, out, err = await tether_cli("demo", "--json", "--journal", pg_url)
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] and all(s["prevented"] for s in data["scenes"])
    assert data["journal"].startswith("postgresql://") and "@" not in data["journal"]
    # The URL it used, schema and all: the one to give tether ls (the server holds others).
    schema = dict(parse_qsl(urlparse(pg_url).query))["schema"]
    assert data["journal"].endswith(f"?schema={schema}"), data["journal"]
    code, out, _ = await tether_cli("demo", "--journal", pg_url)
    assert code == 0 and f"?schema={schema}" in out, out


@contextlib.asynccontextmanager
async def child_needs_a_person(journal_url: str) -> AsyncIterator[tether.Handle]:
    """A root (agent "root") whose child's call hangs and cannot be probed (the provider's
    lookup is down): a terminate leaves the child NEEDS_ATTENTION. Yields the root's handle
    once the call is in flight."""
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        entered = asyncio.Event()

        async def down(order_id: str, cents: int, *, idempotency_key: str) -> tether.ProbeResult:
            raise RuntimeError("the provider's lookup is down")

        @tether.tool(probe=down)
        async def hang(order_id: str, cents: int, *, idempotency_key: str) -> None:
            entered.set()
            await asyncio.Event().wait()

        async def kid(ctx: tether.Context) -> None:
            await ctx.call(hang, order_id="X-9", cents=1)

        kid_agent = tether.Agent("kid", kid, (hang,))

        async def root(ctx: tether.Context) -> None:
            await (await ctx.delegate(kid_agent)).result()

        parent = await sup.delegate(tether.Agent("root", root, (kid_agent,)))
        await entered.wait()
        yield parent


async def test_terminate_exits_1_when_a_child_needs_a_person(journal_url: str) -> None:
    """The root's own calls are done, but its child's call was cut and cannot be probed (the
    provider's lookup is down): the child needs a person, so the command says so with exit 1,
    not 0 for the root's own TERMINATED."""
    async with child_needs_a_person(journal_url) as parent:
        code, out, err = await tether_cli("terminate", parent.id, "--journal", journal_url,
                                          "--json")
        report = json.loads(out)["report"]
        (child,) = report["children"]
        assert (report["outcome"], child["outcome"]) == ("TERMINATED", "NEEDS_ATTENTION")
        assert code == 1, err


async def test_recall_of_a_queued_task_no_worker_claimed_settles_it_at_once(
        journal_url: str) -> None:
    """No worker has claimed the queued task, and none can once it is fenced: nothing ran and
    no owner drains it, so the command settles it itself (NEVER_STARTED) and exits 0, rather
    than wait out its budget for an owner that has nothing to do."""

    async def queued(ctx: tether.Context) -> str:
        return "never runs here"

    async with tether.Supervisor(journal_url) as sup:
        handle = await sup.delegate(tether.Agent("queued_only", queued), remote=True)
        code, out, err = await tether_cli("recall", handle.id, "--grace", "1", "--journal",
                                          journal_url, "--json")
        entry = await sup.journal.queue_entry(handle.id)
    assert code == 0, err
    report = json.loads(out)["report"]
    assert (report["outcome"], report["verdict"]) == ("RECALLED", "NEVER_STARTED")
    assert entry is not None and entry.done_at is not None


async def test_terminate_from_another_process_cuts_a_call_a_recalls_grace_left_running(
        journal_url: str) -> None:
    """A recall's grace ended with the call still running (left to finish, in doubt), so the
    owner's drain is over. A terminate from a shell must still reach it: the owner cuts the
    call and answers with a report, instead of the command waiting out its budget."""
    pay = PaymentService(latency=0.0)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        entered, cut = asyncio.Event(), asyncio.Event()

        @tether.tool(probe=pay.lookup, dispatch_deadline=30.0)
        async def hang(order_id: str, cents: int, *, idempotency_key: str) -> None:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cut.set()
                raise

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(hang, order_id="X-3", cents=1)

        child = await sup.delegate(agent, tools=[hang])
        await entered.wait()
        first = await child.recall(grace=0.2)
        assert (first.verdict, first.outcome) == ("GRACE_EXPIRED",
                                                  tether.DelegationState.RECALLING)
        assert not cut.is_set()
        code, out, err = await tether_cli("terminate", child.id, "--journal", journal_url,
                                          "--json")
        answer = json.loads(out)
    assert "report" in answer, answer.get("waiting")
    assert cut.is_set()
    (action,) = answer["report"]["actions"]
    assert action["state"] == "IN_DOUBT"  # cut, and "not applied" is not final before 30 s
    assert code == 1, err


async def test_a_long_lived_owner_forgets_the_intents_it_is_done_with(
        journal_url: str) -> None:
    """Another process recalls twenty of an owner's children, one after another; the owner
    adopts and drains each. Once they are settled, its next poll lists none of those intents
    again, and it keeps no note of them: an orchestrator that runs for months does not grow
    by one entry per recall it was sent."""
    async def waits(ctx: tether.Context) -> None:
        await asyncio.Event().wait()

    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as owner, \
            tether.Supervisor(journal_url, policy=ONE_CLOCK) as other:
        for _ in range(20):
            child = await owner.delegate(waits)
            report = await other.handle_for(child.id).recall(grace=5.0, reason="done")
            assert report.outcome is tether.DelegationState.RECALLED, report
        await until(lambda: not owner._adoption._untracked, "the notes forgotten", within=10)


async def test_a_shell_recall_the_owner_drained_is_never_settled_again(
        journal_url: str) -> None:
    """A recall from a shell: the owner adopts it and its grace ends with the refund still
    running (GRACE_EXPIRED). Looking at that control row again (PostgreSQL's poll lists it
    as long as the delegation is RECALLING) settles nothing a second time: the verdict stays
    GRACE_EXPIRED, never RECALLED_CLEAN over a call still in doubt."""
    pay = PaymentService(latency=0.0)
    async with tether.Supervisor(journal_url, policy=ONE_CLOCK) as sup:
        entered, release = asyncio.Event(), asyncio.Event()

        @tether.tool(probe=pay.lookup, dispatch_deadline=30.0)
        async def slow(order_id: str, cents: int, *, idempotency_key: str) -> str:
            entered.set()
            await release.wait()
            return await pay.refund(order_id, cents, idempotency_key=idempotency_key)

        async def agent(ctx: tether.Context) -> None:
            await ctx.call(slow, order_id="X-7", cents=1)

        child = await sup.delegate(agent, tools=[slow])
        await entered.wait()
        code, out, err = await tether_cli("recall", child.id, "--grace", "0.3", "--journal",
                                          journal_url, "--json")
        assert code == 1 and json.loads(out)["report"]["verdict"] == "GRACE_EXPIRED", out + err
        (row,) = await sup.journal.controls(child.id)
        await sup._adoption.settle_untracked(row)  # as the owner's next poll may
        again = await sup.report(child.id)
        release.set()
    assert (again.verdict, [a.state for a in again.actions]) == (
        "GRACE_EXPIRED", [tether.ActionState.IN_DOUBT])
