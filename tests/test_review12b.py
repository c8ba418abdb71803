"""Adversarial review of the tamper-evident journal (issue 12): an intruder with write access
to the journal and no trusted key, and a misconfigured operator. Both backends."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.test_chain import PAY, one_refund, refund
from tests.test_cli import tether_cli
from tests.test_trust import one_error_line, raw
from tether._journal.journal import Journal


async def test_redelegation_refuses_when_an_earlier_epoch_holding_the_key_was_tampered(
        journal_url: str) -> None:
    """A task's idempotency keys are shared by all its epochs, and a replay adds no row: the
    COMPLETED refund stays the first epoch's record. Re-delegating the second epoch must not
    believe the first one's flipped row (NOT_APPLIED frees the key), or it pays again."""
    order, agent = one_refund("E", cents=100)
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        first = await sup.delegate(agent, tools=[refund])
        assert await first.result() == "ok"
        second = await first.redelegate()
        assert await second.result() == "ok"
        assert PAY.refund_count(order) == 1
        (done,) = (await first.report()).actions
        await raw(sup.journal, "UPDATE actions SET state = 'NOT_APPLIED' WHERE id = ?",
                  done.id)
        with pytest.raises(tether.JournalError, match="fail verification") as refused:
            await second.redelegate()
        assert f"action {done.id}" in str(refused.value)
    assert PAY.refund_count(order) == 1


async def test_a_chain_read_while_its_writer_commits_is_no_false_alarm(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader (`tether verify`, `show`, a worker's check) reads a delegation's head, then its
    entries and rows, in several statements. Its owner commits between them: on PostgreSQL at
    READ COMMITTED each statement sees the newer commit, and entries beyond the head read
    first, or rows newer than the entries, were named as tampering (consumers then refuse a
    delegation nobody touched)."""
    from tether._journal import chainops

    _, once = one_refund("V")
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(once, tools=[refund])
        assert await h.result() == "ok"
    loop = asyncio.get_running_loop()
    async with Journal(journal_url) as reader, Journal(journal_url) as writer:
        keys = tether.KeyRing.load(reader.keys_dir)
        writer.seal_with(keys.signer, keys.trusted)
        fired: list[int] = []

        async def commit(n: int) -> None:
            writer.event(time.time(), "note", h.id, None, n=n)
            await writer.flush()

        real = chainops.read

        def racing(db: Any, delegation_id: str) -> Any:
            class Between:
                """Runs the reader's statements; the owner commits once after the first."""

                def execute(self, statement: str, params: Any = ()) -> Any:
                    cur = db.execute(statement, params)
                    if not fired:
                        fired.append(1)
                        rows = cur.fetchall()
                        asyncio.run_coroutine_threadsafe(commit(1), loop).result(30)
                        return _Rows(rows)
                    return cur

            return real(Between(), delegation_id)

        monkeypatch.setattr(chainops, "read", racing)
        (verdict,) = await reader.chain_verdicts([h.id], keys.trusted)
        assert fired
        assert verdict.ok, verdict.problems
        monkeypatch.setattr(chainops, "read", real)
        (after,) = await reader.chain_verdicts([h.id], keys.trusted)
        assert after.ok, after.problems


class _Rows:
    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def fetchone(self) -> Any:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[Any]:
        return self.rows


GARBAGE = {
    "head_length_text": "UPDATE chain_heads SET length = 'abc' WHERE delegation_id = ?",
    "head_path_nested": "UPDATE chain_heads SET path = '" + "[" * 5000 + "]" * 5000
                        + "' WHERE delegation_id = ?",
    "entry_seq_text": "UPDATE chain SET seq = 'x' WHERE seq = 1 AND delegation_id = ?",
    "entry_record_huge": "UPDATE chain SET record = 'event 99999999999999999999999' "
                         "WHERE seq = 1 AND delegation_id = ?",
}


@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_garbage_in_the_chain_is_named_not_a_traceback(tmp_path: Path,
                                                             garbage: str) -> None:
    """SQLite columns take any type (PostgreSQL's are typed: this cannot be written there):
    a chain head or entry written by hand as text, a path nested thousands deep, a record
    naming a row id no integer column holds, crashed `verify`, `show` and `reconcile` with
    a traceback. Each is a named problem (verify exits 1) and a refusal (one error line)."""
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    _, once = one_refund("G")
    async with tether.Supervisor(url, tools=[refund]) as sup:
        h = await sup.delegate(once, tools=[refund])
        assert await h.result() == "ok"
        await raw(sup.journal, GARBAGE[garbage], h.id)
    code, out, err = await tether_cli("verify", "--journal", url, "--json")
    assert code == 1, out + err
    assert h.id in {p["delegation"] for p in json.loads(out)["problems"]}, out
    code, out, err = await tether_cli("show", h.id, "--journal", url)
    assert code == 0 and "TAMPERED" in out, out + err
    code, out, err = await tether_cli("reconcile", h.id, "--journal", url)
    assert code == 2 and "fail verification" in one_error_line(err), out + err


async def test_a_delegation_pruned_while_it_is_verified_is_not_called_tampered(
        journal_url: str) -> None:
    """`tether verify` lists the delegations, then reads their chains: a `tether prune` that
    commits in between takes whole trees with their chains (nothing of them is left). A
    delegation gone entirely reads as pruned, not as "no chain head (deleted by hand)"."""
    _, once = one_refund("P")
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(once, tools=[refund])
        assert await h.result() == "ok"
        listed = [d.id for d in await sup.journal.delegations()]  # verify's listing
        await raw(sup.journal, "UPDATE actions SET deadline_at = 0, started_at = 0")
    code, out, err = await tether_cli("prune", "--before", "0s", "--journal", journal_url,
                                      "--json")
    assert code == 0 and json.loads(out)["delegations"] == 1, out + err
    async with Journal(journal_url) as j:
        keys = tether.KeyRing.load(j.keys_dir)
        (verdict,) = await j.chain_verdicts(listed, keys.trusted)
    assert verdict.ok, verdict.problems


async def test_a_forged_receipt_under_a_key_a_call_will_use_is_not_replayed(
        journal_url: str) -> None:
    """An intruder writes a COMPLETED action, with a result of its own, under the key a
    coming call will use (an explicit key, or ``task:tool:n``): the journal replays the
    earliest live use of a key, so the call returned the forged result, nothing was paid and
    the agent believed it had been. A replay is believed only from records that verify."""
    order = f"F-{uuid.uuid4().hex[:6]}"

    async def first(ctx: tether.Context) -> str:
        return str(await ctx.call(refund, order_id=order, cents=100))

    async def victim(ctx: tether.Context) -> str:
        return str(await ctx.call(refund, order_id=order, cents=100,
                                  idempotency_key=f"again-{order}"))

    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(tether.Agent("first", first, (refund,)), tools=[refund])
        await h.result()
        (done,) = (await h.report()).actions
        await raw(sup.journal, "INSERT INTO actions (id, delegation_id, ordinal, tool, effect, "
                  "args, args_hash, idem_key, state, result, started_at) SELECT 'a_forged', "
                  "delegation_id, 9, tool, effect, args, args_hash, ?, 'COMPLETED', "
                  "'\"re_forged\"', started_at FROM actions WHERE id = ?",
                  f"again-{order}", done.id)
        v = await sup.delegate(tether.Agent("victim", victim, (refund,)), tools=[refund])
        with pytest.raises(tether.DelegationError) as failed:
            await v.result()
        assert "fail verification" in str(failed.value), failed.value
        assert "action a_forged" in str(failed.value), failed.value


async def test_redelegation_refuses_when_an_earlier_epoch_was_deleted_as_a_whole(
        journal_url: str) -> None:
    """The first epoch, which holds the COMPLETED refund, deleted with its chain: it reads as
    pruned, yet `tether prune` only ever removes a task's epochs together. The second epoch's
    signed row says epoch 1: a task whose epochs have a gap lost one by hand, and re-delegating
    it would pay the refund again."""
    order, once = one_refund("W", cents=100)
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        first = await sup.delegate(once, tools=[refund])
        assert await first.result() == "ok"
        second = await first.redelegate()
        assert await second.result() == "ok"
        for sql in ("DELETE FROM events WHERE delegation_id = ? OR (delegation_id IS NULL "
                    "AND action_id IN (SELECT id FROM actions WHERE delegation_id = ?))",
                    "DELETE FROM actions WHERE delegation_id = ? AND ? <> ''",
                    "DELETE FROM controls WHERE delegation_id = ? AND ? <> ''",
                    "DELETE FROM documents WHERE delegation_id = ? AND ? <> ''",
                    "DELETE FROM chain WHERE delegation_id = ? AND ? <> ''",
                    "DELETE FROM chain_heads WHERE delegation_id = ? AND ? <> ''",
                    "DELETE FROM delegations WHERE id = ? AND ? <> ''"):
            await raw(sup.journal, sql, first.id, first.id)
        with pytest.raises(tether.JournalError, match="fail verification") as refused:
            await second.redelegate()
        assert "epoch 0" in str(refused.value)
    assert PAY.refund_count(order) == 1
    code, out, _ = await tether_cli("verify", "--journal", journal_url, "--json")
    assert code == 1 and {"delegation": f"task {second.task_id}", "record": "epoch 0"} in [
        {k: p[k] for k in ("delegation", "record")} for p in json.loads(out)["problems"]], out
