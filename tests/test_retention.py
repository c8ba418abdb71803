"""Retention: export as JSON Lines with verification status; prune only whole settled trees,
archived first, the prune recorded; a re-delegated task's old attempt pruned keeps its keys
while the task may run again, so a payment is never made twice."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._core.model import ActionState, DelegationState
from tether._core.retention import CallFacts, NodeFacts, prunable

from .operator_world import orphan, stuck_payment

runner = CliRunner()
S, A = DelegationState, ActionState


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


async def paid(url: str, order: str) -> str:
    """A delegation that succeeded with one completed payment whose deadline has passed."""

    @tether.tool(name="charge", dispatch_deadline=0.5)
    async def charge(order_id: str, *, idempotency_key: str) -> str:
        return f"ch-{order_id}"

    async def payer(ctx: tether.Context) -> None:
        await ctx.call(charge, order_id=order)

    async with tether.Supervisor(url, tools=[charge]) as sup:
        handle = await sup.delegate(payer, tools=[charge])
        await handle.result()
        return handle.id


def past_deadlines(db: Path) -> None:
    """Wait (polling, bounded) until every call's dispatch deadline has passed, then age the
    rows by the clock tolerance that ``tether prune`` allows past it (as if another host's
    clock had written them that far behind), rather than wait for it in real time."""
    (last,) = sqlite3.connect(db).execute("SELECT MAX(deadline_at) FROM actions").fetchone()
    give_up = time.monotonic() + 5
    while time.time() <= last:
        assert time.monotonic() < give_up
        time.sleep(0.01)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE actions SET deadline_at = deadline_at - ?",
                     (tether.Policy().clock_tolerance,))


def test_export_is_json_lines_with_verification(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    code, out, _ = invoke("export", "--journal", url)
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    kinds = {r["record"] for r in records}
    assert kinds == {"delegation", "action", "control", "event"}
    assert all("verified" in r for r in records)
    (control,) = [r for r in records if r["record"] == "control"]
    assert control["verified"] == "ok" and control["delegation"] == stuck.delegation
    assert [r["id"] for r in records if r["record"] == "action"] == [stuck.action]
    # A flipped bit in the stored signature shows in the export.
    conn = sqlite3.connect(tmp_path / "j.db")
    (sig,) = conn.execute("SELECT signature FROM controls").fetchone()
    conn.execute("UPDATE controls SET signature = ?", (bytes([sig[0] ^ 1]) + sig[1:],))
    conn.commit()
    out_file = tmp_path / "out.jsonl"
    assert invoke("export", "--journal", url, "--output", str(out_file))[0] == 0
    (control,) = [json.loads(x) for x in out_file.read_text().splitlines()
                  if json.loads(x)["record"] == "control"]
    assert control["verified"].startswith("REFUSED")
    assert invoke("export", "--journal", url, "--since", "1h", "--until", "30m")[1] == ""


def test_export_names_a_rewritten_column_no_signature_covers(tmp_path: Path) -> None:
    """A recall's issuer column rewritten by hand: its signature still verifies (the column is
    outside it), and the export says so no more than the chain allows: the control is
    TAMPERED, the other records of its delegation are flagged, and before the rewrite every
    record's chain was ok."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    code, out, _ = invoke("export", "--journal", url)
    assert code == 0
    assert {json.loads(line)["chain"] for line in out.splitlines()} == {"ok"}
    with sqlite3.connect(tmp_path / "j.db") as conn:
        conn.execute("UPDATE controls SET issuer = 'cli:Mallory'")
    code, out, _ = invoke("export", "--journal", url)
    records = [json.loads(line) for line in out.splitlines()]
    (control,) = [r for r in records if r["record"] == "control"]
    assert control["verified"] == "ok" and control["issuer"] == "cli:Mallory"
    assert control["chain"].startswith("TAMPERED: altered"), control
    (delegation,) = [r for r in records if r["record"] == "delegation"]
    assert delegation["id"] == stuck.delegation
    assert delegation["chain"].startswith("its delegation's chain fails"), delegation
    # An event that names only its action (an outcome, say) is chained with the action's
    # delegation: one inserted by hand is named too.
    with sqlite3.connect(tmp_path / "j.db") as conn:
        (forged,) = conn.execute(
            "INSERT INTO events (delegation_id, action_id, at, kind, detail) VALUES "
            "(NULL, ?, 0, 'outcome', '{}') RETURNING id", (stuck.action,)).fetchone()
    records = [json.loads(line) for line in invoke("export", "--journal", url)[1].splitlines()]
    (event,) = [r for r in records if r["record"] == "event" and r["id"] == forged]
    assert event["chain"].startswith("TAMPERED: inserted"), event


def test_prune_removes_only_settled_trees_and_records_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    done = asyncio.run(paid(url, "P-1"))
    stuck = asyncio.run(stuck_payment(url, deadline=0.5))  # UNKNOWN: needs a person
    running = asyncio.run(orphan(url))  # its owner died; nobody reconciled it yet
    past_deadlines(tmp_path / "j.db")
    archive = tmp_path / "archive.jsonl"
    code, out, _ = invoke("prune", "--before", "0s", "--dry-run", "--journal", url, "--json")
    assert code == 0 and json.loads(out)["root_ids"] == [done]
    code, out, err = invoke("prune", "--before", "0s", "--archive", str(archive),
                            "--journal", url, "--json")
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    assert (result["roots"], result["delegations"], result["actions"]) == (1, 1, 1)
    assert result["archive"]["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    archived = [json.loads(x) for x in archive.read_text().splitlines()]
    assert {r["delegation"] if r["record"] != "delegation" else r["id"]
            for r in archived if r["record"] in ("delegation", "action")} == {done}
    # What went is gone; the rest is untouched; the prune itself stays on record.
    assert invoke("show", done, "--journal", url)[0] == 2
    assert invoke("show", stuck.delegation, "--journal", url)[0] == 0
    assert invoke("show", running, "--journal", url)[0] == 0
    conn = sqlite3.connect(tmp_path / "j.db")
    assert conn.execute("SELECT COUNT(*) FROM actions WHERE delegation_id = ?",
                        (done,)).fetchone() == (0,)
    (detail,) = conn.execute("SELECT detail FROM events WHERE kind = 'pruned'").fetchone()
    assert json.loads(detail)["archive"]["sha256"] == result["archive"]["sha256"]
    # Once a person settles the UNKNOWN payment, that tree may go too.
    assert invoke("resolve", stuck.action, "--as", "NOT_APPLIED", "--note", "not in ledger",
                  "--journal", url)[0] == 0
    code, out, _ = invoke("prune", "--before", "0s", "--journal", url, "--json")
    assert json.loads(out)["roots"] == 1
    assert invoke("show", stuck.delegation, "--journal", url)[0] == 2


def test_prune_mistakes_are_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(paid(url, "P-2"))
    archive = tmp_path / "a.jsonl"
    archive.write_text("keep me")
    for args, message in ((["--before", "someday"], "--before"),
                          (["--before", "0s", "--archive", str(archive)], "exists")):
        code, out, err = invoke("prune", *args, "--journal", url)
        assert code == 2 and out == "" and err.startswith("error:") and message in err
    assert archive.read_text() == "keep me"


def test_what_may_be_pruned() -> None:
    done = [NodeFacts(S.SUCCEEDED, 5.0)]
    final = [CallFacts(A.COMPLETED, 6.0)]
    assert prunable(done, final, before=10, now=20, tolerance=2)
    assert not prunable([NodeFacts(S.NEEDS_ATTENTION, 5.0)], final, before=10, now=20, tolerance=2)
    assert not prunable([NodeFacts(S.RUNNING, None)], [], before=10, now=20, tolerance=2)
    assert not prunable(done, [CallFacts(A.UNKNOWN, 6.0)], before=10, now=20, tolerance=2)
    assert not prunable(done, [CallFacts(A.IN_DOUBT, 6.0)], before=10, now=20, tolerance=2)
    assert not prunable(done, [CallFacts(A.NOT_APPLIED, 30.0)], before=10, now=20,
                        tolerance=2)  # may land
    # Its deadline was written on another host's clock: it may land until the tolerance past it.
    assert not prunable(done, [CallFacts(A.NOT_APPLIED, 19.0)], before=10, now=20, tolerance=2)
    assert prunable(done, [CallFacts(A.NOT_APPLIED, 17.0)], before=10, now=20, tolerance=2)
    assert not prunable([NodeFacts(S.SUCCEEDED, 15.0)], final, before=10, now=20, tolerance=2)
    assert not prunable([*done, NodeFacts(S.RECALLING, None)], final, before=10, now=20,
                        tolerance=2)
    # An INTERRUPTED attempt waits for an answer, until its task was re-delegated with one.
    assert not prunable([NodeFacts(S.INTERRUPTED, 5.0)], final, before=10, now=20, tolerance=2)
    assert prunable([NodeFacts(S.INTERRUPTED, 5.0, superseded=True), *done], final, before=10,
                    now=20, tolerance=2)
    assert not prunable([NodeFacts(S.NEEDS_ATTENTION, 5.0, superseded=True)], final, before=10,
                        now=20, tolerance=2)


async def test_prune_removes_nested_trees_on_both_backends(journal_url: str) -> None:
    @tether.tool(name="charge", dispatch_deadline=0.5)
    async def charge(order_id: str, *, idempotency_key: str) -> str:
        return f"ch-{order_id}"

    @tether.agent(tools=[charge])
    async def leaf(ctx: tether.Context) -> None:
        await ctx.call(charge, order_id="N-1")

    @tether.agent(tools=[leaf])
    async def parent(ctx: tether.Context) -> None:
        child = await ctx.delegate(leaf)
        await child.result()

    # A small clock tolerance: the deadline passes for retention within a real second.
    async with tether.Supervisor(journal_url, tools=[charge],
                                 policy=tether.Policy(clock_tolerance=0.1)) as sup:
        handle = await sup.delegate(parent)
        await handle.result()
        j = sup.journal
        await j.flush()
        assert len(await j.subtree(handle.id)) == 2
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 5
        while not await j.prunable([handle.id], time.time(), time.time()):
            assert loop.time() < give_up, "deadlines never passed"
            await asyncio.sleep(0.01)
        result = await j.prune([handle.id], time.time(), time.time(), None)
        assert (result["delegations"], result["actions"], result["kept"]) == (2, 1, [])
        assert await j.roots(since=None, until=None, after=None, limit=10) == []


async def test_pruning_a_re_delegated_tasks_old_attempt_does_not_pay_twice(
        journal_url: str) -> None:
    """The first attempt paid (key ``task:charge:0``, COMPLETED) and was stopped; the task
    was re-delegated, and its new attempt will call charge with the same key, which the
    journal answers with the recorded receipt (I7). Pruning the old, settled tree in between
    must not make the journal forget that key: the payment would run a second time."""
    paid: list[str] = []
    entered, gate = asyncio.Event(), asyncio.Event()
    attempts = 0

    @tether.tool(name="charge")
    async def charge(order_id: str, cents: int, *, idempotency_key: str) -> str:
        paid.append(idempotency_key)
        return f"ch_{len(paid)}"

    async def payer(ctx: tether.Context) -> str:
        nonlocal attempts
        attempts += 1
        if attempts > 1:
            await gate.wait()
        receipt = await ctx.call(charge, order_id="O-1", cents=1250)
        if attempts == 1:
            entered.set()
            await asyncio.Event().wait()  # stuck after paying: the operator stops it
        return str(receipt)

    far = time.time() + 10 * 86400  # a cut-off and a "now" past every deadline
    async with tether.Supervisor(journal_url, tools=[charge]) as sup:
        first = await sup.delegate(tether.Agent("payer", payer, (charge,)), tools=[charge])
        await entered.wait()
        await first.terminate("stuck after paying")
        assert (await sup.journal.get(first.id)).state.terminal
        second = await first.redelegate()
        j = sup.journal
        roots = await j.roots(since=None, until=far, after=None, limit=500, settled_only=True)
        assert first.id in roots
        await j.prune(await j.prunable(roots, far, far), far, far, None)
        gate.set()
        assert await second.result() == "ch_1"  # the receipt, replayed
        await second.wait()
        # Once every attempt of the task is settled, they go together.
        roots = await j.roots(since=None, until=far, after=None, limit=500, settled_only=True)
        done = await j.prune(await j.prunable(roots, far, far), far, far, None)
        assert done["delegations"] == 2 and done["kept"] == []
    assert paid == [f"{first.task_id}:charge:0"]  # once


async def test_an_answered_task_goes_with_a_child_that_was_interrupted(sqlite_url: str) -> None:
    """Its child's task had been re-delegated (a place used again), so the child's own epoch
    says nothing of its root's: superseded is judged per tree, by the root's epoch (a review
    found the answered task never pruned)."""
    @tether.agent()
    async def asker(ctx: tether.Context, n: int) -> Any:
        return tether.Interrupted({"q": "approve?"}) if n == 1 else "fine"

    @tether.agent(tools=[asker])
    async def parent(ctx: tether.Context, resume: Any = None) -> Any:
        if resume is not None:
            return f"done with {resume}"
        await (await ctx.delegate_at("s1", asker, 0)).result()
        await (await ctx.delegate_at("s1", asker, 1)).result()  # its task at epoch 1
        return tether.Interrupted({"q": "approve?"})

    async with tether.Supervisor(sqlite_url, recover=False) as sup:
        first = await sup.delegate(parent)
        await first.wait()
        second = await first.redelegate(resume="yes")
        assert await second.result() == "done with {'q': 'yes'}"
        later = time.time() + 10**6
        # Both epochs go together (the second replays the first's receipts): the dry run
        # names both, as the archive of a prune must hold both.
        assert await sup.journal.prunable([first.id], later, later) == [first.id, second.id]


def test_an_archive_holds_every_tree_a_prune_takes(tmp_path: Path) -> None:
    """A task that asked a person (INTERRUPTED) and was re-delegated with the answer: the
    first epoch is not a settled root the listing finds on its own, yet it goes with the
    second (which replays its receipts). The archive of the prune holds both: nothing goes
    without being archived when an archive was asked for."""
    @tether.agent()
    async def asker(ctx: tether.Context, resume: Any = None) -> Any:
        return "fine" if resume is not None else tether.Interrupted({"q": "?"})

    url = f"sqlite:///{tmp_path / 'j.db'}"

    async def scenario() -> tuple[str, str]:
        async with tether.Supervisor(url, recover=False) as sup:
            first = await sup.delegate(asker)
            await first.wait()
            second = await first.redelegate(resume="yes")
            assert await second.result() == "fine"
            return first.id, second.id

    first, second = asyncio.run(scenario())
    archive = tmp_path / "archive.jsonl"
    code, out, _ = invoke("prune", "--before", "0s", "--dry-run", "--journal", url, "--json")
    assert code == 0 and set(json.loads(out)["root_ids"]) == {first, second}
    code, out, err = invoke("prune", "--before", "0s", "--archive", str(archive),
                            "--journal", url, "--json")
    assert code == 0, err
    result = json.loads(out)
    archived = {r["id"] for r in map(json.loads, archive.read_text().splitlines())
                if r["record"] == "delegation"}
    assert (result["roots"], result["delegations"]) == (2, 2) and archived == {first, second}


def judged_groups(monkeypatch: Any) -> list[set[str]]:
    """The roots each judgement of a group of trees starts from (``retention._trees``)."""
    from tether._journal import retention

    judged: list[set[str]] = []
    real = retention._trees

    def counted(db: Any, roots: set[str], *rest: Any) -> Any:
        judged.append(roots)
        return real(db, roots, *rest)

    monkeypatch.setattr(retention, "_trees", counted)
    return judged


async def epochs(sup: tether.Supervisor, n: int, last: Any) -> tuple[list[str], Any]:
    """A task asked a person ``n`` times (an epoch each, INTERRUPTED), then answered "last"
    (its last epoch runs ``last``): every root, and the last epoch's handle."""

    @tether.agent()
    async def asker(ctx: tether.Context, resume: Any = None) -> Any:
        if resume == {"q": "last"}:
            return await last()
        return tether.Interrupted({"q": "?"})

    handle = await sup.delegate(asker)
    await handle.wait()
    ids = [handle.id]
    for k in range(n):
        handle = await handle.redelegate(resume="last" if k == n - 1 else "again")
        if k < n - 1:
            await handle.wait()
        ids.append(handle.id)
    return ids, handle


async def test_a_tasks_many_roots_are_judged_once_per_prune(sqlite_url: str,
                                                            monkeypatch: Any) -> None:
    """A task re-delegated again and again (a Temporal cron, a person asked each time) has a
    root per epoch, and its trees go together. A prune or its dry run listing all K of them
    judges that group once, not once per listed root (K x the group's K subtrees each time,
    read twice: about 2K^2 subtree reads, minutes for a long-lived cron)."""

    async def fine() -> str:
        return "fine"

    judged = judged_groups(monkeypatch)
    async with tether.Supervisor(sqlite_url, recover=False) as sup:
        ids, handle = await epochs(sup, 7, fine)
        assert await handle.result() == "fine"
        later = time.time() + 10**6
        judged.clear()
        assert sorted(await sup.journal.prunable(ids, later, later)) == sorted(ids)
        assert len(judged) <= 2, len(judged)
        judged.clear()
        done = await sup.journal.prune(ids, later, later, None)
        assert (done["roots"], done["kept"]) == (8, [])
        assert len(judged) <= 2, len(judged)


async def test_a_group_that_may_not_go_is_judged_once_and_every_listed_root_kept(
        sqlite_url: str, monkeypatch: Any) -> None:
    """The same task, its last epoch still running: no epoch may go (the last replays their
    receipts), each listed root is reported kept, and the group is judged once."""
    gate = asyncio.Event()

    async def waits() -> str:
        await gate.wait()
        return "fine"

    judged = judged_groups(monkeypatch)
    async with tether.Supervisor(sqlite_url, recover=False) as sup:
        ids, handle = await epochs(sup, 5, waits)
        later = time.time() + 10**6
        judged.clear()
        assert await sup.journal.prunable(ids, later, later) == []
        assert len(judged) <= 2, len(judged)
        judged.clear()
        done = await sup.journal.prune(ids, later, later, None)
        assert (done["roots"], sorted(done["kept"])) == (0, sorted(ids))
        assert len(judged) <= 2, len(judged)
        gate.set()
        assert await handle.result() == "fine"
