"""Triage: delegations newest first, filtered and paged through indexes; the queue of actions
that need a person; ids that sort by time; a limit the database cannot hold is a usage error."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tether
from tether._cli.app import app
from tether._core.model import DelegationState, Effect
from tether._journal.rows import NewAction, NewDelegation
from tether._journal.triage import DelegationQuery, page_delegations
from tether._runtime.state import new_id

from .operator_world import stuck_payment

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def listed(*args: str) -> list[dict[str, Any]]:
    code, out, err = invoke(*args, "--json")
    assert code == 0, err
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


async def fill(url: str, n: int) -> list[str]:
    """``n`` delegations one minute apart (the last one now), agents alternating; every third
    succeeded. Returns their ids, oldest first."""
    now = time.time()
    ids = []
    async with tether.Journal(url, durable=False) as j:
        for i in range(n):
            did = new_id("d")
            await j.create_delegation(NewDelegation(
                id=did, task_id=new_id("t"), parent_id=None, attempt=1,
                agent="pay" if i % 2 else "mail", surface=(), args={}, owner_id="o_x",
                now=now - 60.0 * (n - 1 - i)))
            if i % 3 == 0:
                await j.set_state(did, DelegationState.SUCCEEDED, now)
            ids.append(did)
    return ids


def test_ls_pages_newest_first_and_filters(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    ids = asyncio.run(fill(url, 25))
    newest = list(reversed(ids))
    first = listed("ls", "--limit", "10", "--journal", url)
    assert [r["id"] for r in first] == newest[:10]
    code, out, _ = invoke("ls", "--limit", "10", "--journal", url)
    assert code == 0
    assert f"next page: --before {newest[9]}" in out
    pages, cursor = [], None
    while True:
        page = listed("ls", "--limit", "10", "--journal", url,
                      *(["--before", cursor] if cursor else []))
        pages += [r["id"] for r in page]
        if len(page) < 10:
            break
        cursor = page[-1]["id"]
    assert pages == newest
    pay = listed("ls", "--agent", "pay", "--limit", "0", "--journal", url)
    assert [r["id"] for r in pay] == [d for i, d in enumerate(newest) if (24 - i) % 2]
    ended = listed("ls", "--state", "SUCCEEDED", "--limit", "0", "--journal", url)
    assert {r["id"] for r in ended} == {d for i, d in enumerate(ids) if i % 3 == 0}
    live = listed("ls", "--live", "--agent", "mail", "--limit", "0", "--journal", url)
    assert all(r["state"] == "RUNNING" and r["agent"] == "mail" for r in live) and live
    recent = listed("ls", "--since", "330s", "--journal", url)
    assert [r["id"] for r in recent] == newest[:6]
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 330))
    assert listed("ls", "--since", since, "--journal", url) == recent


@pytest.mark.parametrize(("args", "message"), [
    (["--state", "RUNNIN"], "unknown state"),
    (["--since", "yesterday"], "--since"),
    (["--before", "d_nobody"], "d_nobody"),
    (["--live", "--state", "SUCCEEDED"], "in common"),
])
def test_ls_mistakes_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(fill(url, 2))
    code, out, err = invoke("ls", *args, "--journal", url)
    assert code == 2 and out == "" and err.startswith("error:") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_ls_reads_through_an_index(tmp_path: Path) -> None:
    """The first page at any journal size: no full scan and no sort of the whole table."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(fill(url, 3))
    conn = sqlite3.connect(tmp_path / "j.db")
    plans: list[str] = []

    class Explain:
        def execute(self, sql: str, params: Any = ()) -> Any:
            plans.extend(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
            return conn.execute(sql, params)

    for query in (DelegationQuery(), DelegationQuery(states=("RUNNING",)),
                  DelegationQuery(agent="pay"), DelegationQuery(since=time.time() - 60)):
        plans.clear()
        page_delegations(Explain(), query)
        plan = " / ".join(plans)
        assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, (query, plan)
        assert "TEMP B-TREE" not in plan, (query, plan)


async def pending_since(url: str, delegation: str, started: float) -> str:
    async with tether.Journal(url) as j:
        row = await j.get(delegation)
        action = new_id("a")
        await j.begin_action(NewAction(
            id=action, delegation_id=row.id, epoch=row.epoch, ordinal=0, tool="transfer",
            effect=Effect.EXTERNAL, args_json="{}", args_hash="h", idem_key=new_id("k"),
            now=started, deadline_at=started + 30))
    return action


def test_the_operators_queue(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    ids = asyncio.run(fill(url, 4))
    old = asyncio.run(pending_since(url, ids[1], time.time() - 120))
    asyncio.run(pending_since(url, ids[2], time.time()))
    code, out, _ = invoke("actions", "--state", "UNKNOWN", "--journal", url, "--json")
    assert code == 1  # something needs a person
    assert [(a["id"], a["agent"]) for a in json.loads(out)] == [(stuck.action, "payer")]
    code, out, _ = invoke("actions", "--in-flight", "--older-than", "30s", "--journal", url,
                          "--json")
    assert code == 1 and [a["id"] for a in json.loads(out)] == [old]
    code, out, _ = invoke("actions", "--in-flight", "--older-than", "1h", "--journal", url)
    assert code == 0 and "actions: 0, none needs a person" in out
    code, out, _ = invoke("actions", "--state", "UNKNOWN", "--journal", url)
    assert stuck.action in out and stuck.key in out
    code, _, err = invoke("actions", "--older-than", "soon", "--journal", url)
    assert code == 2 and err.startswith("error:")


def test_ids_sort_by_time() -> None:
    ids = [new_id("d") for _ in range(2000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(len(i) == len(ids[0]) for i in ids)
    # The first 48 bits are the creation time in milliseconds (UUIDv7).
    raw = base64.b32hexdecode(ids[0][2:].upper() + "======")
    assert abs(int.from_bytes(raw[:6], "big") / 1000 - time.time()) < 60


@pytest.mark.parametrize("command", ["ls", "actions"])
def test_a_huge_limit_is_a_usage_error_not_a_traceback(tmp_path: Path, command: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    code, out, err = invoke(command, "--limit", str(2 ** 80), "--journal", url)
    assert code == 2 and out == "" and "--limit" in err, (code, out, err)
    code, out, _ = invoke(command, "--limit", str(2 ** 62), "--journal", url)
    assert code in (0, 1) and ("charge" in out or "payer" in out), out


async def settled_actions(url: str, n: int, started: float) -> list[str]:
    """``n`` COMPLETED actions of one delegation, a second apart from ``started``."""
    (delegation,) = await fill_one(url)
    ids = []
    async with tether.Journal(url) as j:
        row = await j.get(delegation)
        for i in range(n):
            action = new_id("a")
            await j.begin_action(NewAction(
                id=action, delegation_id=row.id, epoch=row.epoch, ordinal=i, tool="refund",
                effect=Effect.EXTERNAL, args_json="{}", args_hash="h", idem_key=new_id("k"),
                now=started + i, deadline_at=started + i + 30))
            await j.settle_action(action, tether.ActionState.COMPLETED, started + i + 0.5,
                                  {"probe": "COMPLETED"})
            ids.append(action)
    return ids


async def fill_one(url: str) -> list[str]:
    async with tether.Journal(url, durable=False) as j:
        did = new_id("d")
        await j.create_delegation(NewDelegation(
            id=did, task_id=new_id("t"), parent_id=None, attempt=1, agent="refunds",
            surface=(), args={}, owner_id="o_x", now=time.time() - 3600))
    return [did]


def test_the_queue_never_hides_a_decision(tmp_path: Path) -> None:
    """60 settled actions and one UNKNOWN, the newest: the default page of 50 (oldest first)
    listed 50 COMPLETED ones, said nothing of the other 11 and exited 0."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    settled = asyncio.run(settled_actions(url, 60, time.time() - 3000))
    stuck = asyncio.run(stuck_payment(url))
    code, out, _ = invoke("actions", "--journal", url)
    assert code == 1, out
    assert stuck.action in out
    assert "11 more; --limit / --state to see them" in out, out
    code, out, _ = invoke("actions", "--journal", url, "--json")
    assert code == 1
    listed_ids = [a["id"] for a in json.loads(out)]
    # What needs a person first, then the rest oldest first.
    assert listed_ids == [stuck.action, *settled[:49]]
    # An explicit --state keeps the order; what is paged out is counted, and so is what of it
    # needs a person.
    (running,) = asyncio.run(fill_one(url))
    pending = asyncio.run(pending_since(url, running, time.time() - 120))
    code, out, _ = invoke("actions", "--limit", "1", "--state", "COMPLETED,UNKNOWN,PENDING",
                          "--journal", url)
    assert code == 1 and pending in out and stuck.action not in out, out
    assert "61 more (1 needs a person); --limit / --state to see them" in out, out
    code, out, _ = invoke("actions", "--state", "COMPLETED", "--limit", "0", "--journal", url)
    assert code == 0 and "more" not in out and "actions: 60, none needs a person" in out, out

    async def settle() -> None:
        async with tether.Journal(url) as j:
            await j.settle_action(pending, tether.ActionState.COMPLETED, time.time(), {})
    asyncio.run(settle())
    # Decided, nothing needs a person: exit 0 whatever the page holds.
    assert invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "ledger",
                  "--journal", url)[0] == 0
    code, out, _ = invoke("actions", "--journal", url)
    assert code == 0 and "12 more; --limit" in out, out
