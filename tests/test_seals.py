"""A commit's chain seal is stored once (``chain_seals``), its heads naming it with a binary path
to its root; a seal goes once no head names it (its writer deletes it when it moves the last
head it sealed with it, a prune takes any other), and a journal whose heads each kept their own
seal (schema 6) opens, verifies and is extended. Both backends."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import tether
from tests.test_chain import ATTACKS, one_refund, refund, verify_json
from tests.test_trust import raw
from tether._core import chain
from tether._journal import ops
from tether._journal.journal import Journal

ORPHANS = ("SELECT COUNT(*) FROM chain_seals WHERE id NOT IN "
           "(SELECT seal_id FROM chain_heads WHERE seal_id IS NOT NULL)")


def notes(*ids: str) -> Any:
    """A batch that writes a note on each of ``ids``: one commit moves their heads."""

    def write(db: Any) -> None:
        for d in ids:
            ops.event(db, time.time(), "note", d, None)

    return write


async def sealed_together(sup: tether.Supervisor, prefix: str) -> tuple[str, str]:
    """Two delegations that each refunded once, their heads then moved by one commit: one
    seal row, named by both."""
    _, once = one_refund(prefix)
    h, g = await sup.delegate(once, tools=[refund]), await sup.delegate(once, tools=[refund])
    await h.result()
    await g.result()
    await sup.journal._write(notes(h.id, g.id))
    await sup.journal.flush()
    return h.id, g.id


async def scalar(j: Journal, sql: str, *params: Any) -> Any:
    return await j._read(lambda db: db.execute(sql, params).fetchone()[0])


async def test_a_commits_heads_share_one_seal_and_no_seal_outlives_its_heads(
        journal_url: str) -> None:
    """Forty children at once: their commits seal many heads each, once; and a writer that
    moved every head it sealed with a seal has deleted it (one child's twenty actions, one
    after another, leave the seal of its last commit alone)."""

    async def many(ctx: tether.Context, n: int) -> str:
        for i in range(n):
            await ctx.call(refund, order_id=f"S-{ctx.delegation_id}-{i}", cents=1)
        return "ok"

    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        agent = tether.Agent("many", many, (refund,))
        handles = await asyncio.gather(*(sup.delegate(agent, 2, tools=[refund])
                                         for _ in range(40)))
        assert [await h.result() for h in handles] == ["ok"] * 40
        await sup.journal.flush()
        heads = await scalar(sup.journal, "SELECT COUNT(*) FROM chain_heads")
        seals = await scalar(sup.journal, "SELECT COUNT(*) FROM chain_seals")
        named = await scalar(sup.journal,
                             "SELECT COUNT(DISTINCT seal_id) FROM chain_heads")
        assert heads >= 40 and seals == named < heads, (heads, seals, named)
        assert await scalar(sup.journal, ORPHANS) == 0
        one = await sup.delegate(agent, 20, tools=[refund])
        assert await one.result() == "ok"
        await sup.journal.flush()
        assert await scalar(sup.journal, ORPHANS) == 0
        assert await scalar(sup.journal, "SELECT COUNT(*) FROM chain_seals") <= seals + 1
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data


async def test_a_seal_goes_with_the_last_head_that_names_it_whoever_moves_it(
        journal_url: str) -> None:
    """Process A seals two delegations' heads in one commit; process B (with no memory of
    A's seals) moves one, then the other: the seal stays while a head names it and goes in
    the commit that moves the last."""
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h, g = await sealed_together(sup, "PR")
        (seal_id,) = await sup.journal._read(lambda db: [r[0] for r in db.execute(
            "SELECT id FROM chain_seals").fetchall()])
        keys = sup.keys
        async with Journal(journal_url) as other:
            other.seal_with(keys.signer, keys.trusted)
            await other._write(notes(h))
            assert await scalar(other, "SELECT COUNT(*) FROM chain_seals WHERE id = ?",
                                seal_id) == 1
            await other._write(notes(g))
            assert await scalar(other, "SELECT COUNT(*) FROM chain_seals WHERE id = ?",
                                seal_id) == 0
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data


async def test_a_prune_takes_every_seal_no_head_names(journal_url: str) -> None:
    """A seal left by two writers that each saw the other's head still naming it (written
    here by hand, as they leave it) goes with the next prune, and so do the pruned trees'."""
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        await sealed_together(sup, "PS")
        await raw(sup.journal, "INSERT INTO chain_seals (id, seal, signer, signature) SELECT "
                  "id + 1, seal, signer, signature FROM chain_seals")
        assert await scalar(sup.journal, ORPHANS) == 1
        code, data = await verify_json(journal_url)
        assert (code, data["problems"]) == (0, []), data
        # Aged by hand past the deadline prune waits for (as the retention tests do): an
        # alteration, and the tree it is in goes with the prune.
        await raw(sup.journal, "UPDATE actions SET deadline_at = 0, started_at = 0")
    from tests.cli_helpers import tether_here

    code, out, err = await tether_here("prune", "--before", "0s", "--journal", journal_url)
    assert code == 0, out + err
    async with Journal(journal_url) as j:
        assert await scalar(j, "SELECT COUNT(*) FROM chain_seals") == 0
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data


async def test_a_commit_lost_with_the_server_leaves_its_seal_named_and_kept(
        journal_url: str) -> None:
    """A relaxed commit (``synchronous_commit=off``, the MCP proxy's receipts) moves two
    heads off their shared seal; the server then loses it (emulated: its rows put back as a
    crash leaves them). The heads name the seal again: the writer's later commits and
    flushes must keep it, and the chains read clean; a later genuine move deletes it."""
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        j = sup.journal
        h, g = await sealed_together(sup, "RL")
        seal_id = await scalar(j, "SELECT seal_id FROM chain_heads WHERE delegation_id = ?",
                               h)
        heads = await j._read(lambda db: db.execute(
            "SELECT delegation_id, length, hash, seal_id, proof FROM chain_heads "
            "WHERE delegation_id IN (?, ?)", (h, g)).fetchall())
        last_event = await scalar(j, "SELECT MAX(id) FROM events")
        seal = await j._read(lambda db: db.execute(
            "SELECT id, seal, signer, signature FROM chain_seals WHERE id = ?",
            (seal_id,)).fetchone())
        posted = j._runner.submit(notes(h, g), write=True, relaxed=True)
        assert posted is not None
        await posted  # committed, not waiting for the disk
        moved_to = await scalar(j, "SELECT seal_id FROM chain_heads WHERE delegation_id = ?",
                                h)
        # The server crashes before that commit reached its disk: lost, with its seal.
        await raw(j, "DELETE FROM events WHERE id > ?", last_event)
        for d, length, tip, named, proof in heads:
            await raw(j, "DELETE FROM chain WHERE delegation_id = ? AND seq > ?", d, length)
            await raw(j, "UPDATE chain_heads SET length = ?, hash = ?, seal_id = ?, proof = ? "
                      "WHERE delegation_id = ?", length, tip, named, bytes(proof), d)
        await raw(j, "DELETE FROM chain_seals WHERE id = ?", moved_to)
        if not await scalar(j, "SELECT COUNT(*) FROM chain_seals WHERE id = ?", seal_id):
            await raw(j, "INSERT INTO chain_seals (id, seal, signer, signature) "
                      "VALUES (?, ?, ?, ?)", *seal)  # its deletion was lost with it
        _, once = one_refund("RL2")
        for _ in range(20):  # the writer goes on, here on another delegation, and flushes
            other = await sup.delegate(once, tools=[refund])
            await other.result()
        await j.flush()
        assert await scalar(j, "SELECT COUNT(*) FROM chain_seals WHERE id = ?", seal_id) == 1
        code, data = await verify_json(journal_url)
        assert (code, data["problems"]) == (0, []), data


async def to_schema_6(j: Journal) -> None:
    """Write every head back as schema 6 kept it (its own copy of the seal, its path as text)
    and drop what schema 7 added, as a journal written before the upgrade is."""

    def back(db: Any) -> None:
        for d, seal_id, proof, *inline in db.execute(
                "SELECT delegation_id, seal_id, proof, seal, signer, signature FROM chain_heads "
                "WHERE proof IS NOT NULL").fetchall():
            body, signer, signature = inline if seal_id is None else db.execute(
                "SELECT seal, signer, signature FROM chain_seals WHERE id = ?",
                (seal_id,)).fetchone()
            path = chain._decode_proof(bytes(proof))
            db.execute("UPDATE chain_heads SET path = ?, seal = ?, signer = ?, signature = ?, "
                       "seal_id = NULL, proof = NULL WHERE delegation_id = ?",
                       (json.dumps(path, separators=(",", ":")), body, signer, signature, d))

    await j._write(back)
    # The chain's hashes as hex text, in a table with a rowid (SQLite), as schema 6 made it.
    pg = not j.url.startswith("sqlite")

    def text(column: str) -> str:
        return f"encode({column}, 'hex')" if pg else f"lower(hex({column}))"

    await raw(j, "CREATE TABLE chain6 (delegation_id TEXT NOT NULL, seq INTEGER NOT NULL, "
              "record TEXT NOT NULL, content TEXT NOT NULL, pre TEXT NOT NULL, hash TEXT NOT "
              "NULL, PRIMARY KEY (delegation_id, seq))")
    await raw(j, f"INSERT INTO chain6 SELECT delegation_id, seq, record, {text('content')}, "
              f"{text('pre')}, {text('hash')} FROM chain")
    await raw(j, "DROP TABLE chain")
    await raw(j, "ALTER TABLE chain6 RENAME TO chain")
    await raw(j, "DROP TABLE chain_seals")
    await raw(j, "DROP INDEX chain_heads_seal")
    await raw(j, "ALTER TABLE chain_heads DROP COLUMN seal_id")
    await raw(j, "ALTER TABLE chain_heads DROP COLUMN proof")
    await raw(j, "UPDATE tether_meta SET value = '6' WHERE key = 'schema_version'")


async def paid_at_schema_6(url: str, prefix: str, *edits: str) -> str:
    """A delegation that refunded once, in a journal written back to schema 6's form (then
    ``edits``, each given its id, made on it as schema 6 holds it): its id."""
    _, once = one_refund(prefix)
    async with tether.Supervisor(url, tools=[refund]) as sup:
        h = await sup.delegate(once, tools=[refund])
        await h.result()
        await to_schema_6(sup.journal)
        for edit in edits:
            await raw(sup.journal, edit, h.id)
    return h.id


async def test_a_journal_whose_heads_kept_their_own_seals_is_upgraded_and_extended(
        journal_url: str) -> None:
    h = await paid_at_schema_6(journal_url, "V6")
    code, data = await verify_json(journal_url)  # opening upgrades; the old seals verify
    assert (code, data["problems"], data["unchained"]) == (0, [], []), data
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        await sup.journal._write(lambda db: ops.event(db, time.time(), "note", h, None))
        await sup.journal.flush()
        form = await sup.journal._read(lambda db: db.execute(
            "SELECT path, proof FROM chain_heads WHERE delegation_id = ?", (h,)).fetchone())
        assert form[0] is None and form[1] is not None, form  # the path as bytes now
    code, data = await verify_json(journal_url)
    assert (code, data["problems"], data["unchained"]) == (0, [], []), data


async def test_an_old_form_head_altered_by_hand_is_still_named(journal_url: str) -> None:
    """A head of schema 6's form whose length was changed by hand fails its own seal, as it
    did before the upgrade."""
    h = await paid_at_schema_6(journal_url, "V6X")
    async with Journal(journal_url) as j:  # upgraded here
        await raw(j, "UPDATE chain_heads SET length = length - 1 WHERE delegation_id = ?", h)
    code, data = await verify_json(journal_url)
    assert code == 1 and any(p["delegation"] == h and p["record"] == "chain"
                             for p in data["problems"]), data


def test_the_seal_attacks_are_in_the_tamper_catalogue() -> None:
    assert {"deleted_seal", "rewritten_seal", "extended_proof"} <= set(ATTACKS)


async def test_an_entry_written_by_hand_as_other_text_is_upgraded_and_named(
        journal_url: str) -> None:
    """A schema 6 chain entry whose hash is not lowercase hex (written by hand; on SQLite not
    even UTF-8): the upgrade keeps it as its bytes rather than failing to open the journal,
    and verify names it."""
    garbage = "CAST(X'FF' AS TEXT)" if journal_url.startswith("sqlite") else "'NOT HEX'"
    h = await paid_at_schema_6(journal_url, "V6G", f"UPDATE chain SET content = {garbage} "
                               "WHERE delegation_id = ? AND seq = 1")
    code, data = await verify_json(journal_url)
    assert code == 1 and any(p["delegation"] == h for p in data["problems"]), data


async def test_a_shared_seal_deleted_or_rewritten_is_named_for_every_head_it_sealed(
        journal_url: str) -> None:
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h, g = await sealed_together(sup, "SH")
        (seal_id, body), = await sup.journal._read(lambda db: db.execute(
            "SELECT id, seal FROM chain_seals").fetchall())
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data
    async with Journal(journal_url) as j:
        await raw(j, "UPDATE chain_seals SET seal = ? WHERE id = ?",
                  bytes(body).replace(b'"heads":2', b'"heads":3'), seal_id)
    code, data = await verify_json(journal_url)
    assert code == 1 and {p["delegation"] for p in data["problems"]} == {h, g}, data
    async with Journal(journal_url) as j:
        await raw(j, "DELETE FROM chain_seals")
    code, data = await verify_json(journal_url)
    assert code == 1 and {p["delegation"] for p in data["problems"]} == {h, g}, data
    assert all("not sealed" in p["problem"] for p in data["problems"]), data


async def test_a_seal_left_by_rival_commits_is_found_without_a_prune(
        journal_url: str, monkeypatch: Any) -> None:
    """Two commits that each saw the other's head still naming a seal leave it (written here
    by hand, as they leave it). A writer's later commits sweep a slice of the seals' ids now
    and then (here: every commit, and the slice up to the highest id), without a prune."""
    from tether._journal import chainops

    monkeypatch.setattr(chainops, "_SWEEP_EVERY", 1)
    monkeypatch.setattr(chainops, "_SLICE", 2**63 - 1)
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h, g = await sealed_together(sup, "SW")
        await raw(sup.journal, "INSERT INTO chain_seals (id, seal, signer, signature) SELECT "
                  "?, seal, signer, signature FROM chain_seals", 2**63 - 1)
        assert await scalar(sup.journal, ORPHANS) == 1
        await sup.journal._write(notes(h, g))
        assert await scalar(sup.journal, ORPHANS) == 0
        assert await scalar(sup.journal, "SELECT COUNT(*) FROM chain_seals") == 1
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data


async def test_a_writer_stalled_while_its_seal_is_sent_holds_no_lock_past_the_idle_timeout(
        pg_url: str, monkeypatch: Any) -> None:
    """A process paused (a VM, SIGSTOP) in the middle of sending a commit's seal, its heads
    and its deletes: the server must see it idle in its transaction, so that the idle timeout
    ends the session and frees the heads' locks for the others. Sent as pipelined statements,
    the first had reached the server with no Sync after it, and the session waited with no
    timeout, holding the locks for as long as the pause lasted."""
    import psycopg

    from tests.conftest import PG_URL
    from tether._journal import postgres

    real, gate, stalled = postgres.translate, threading.Event(), threading.Event()

    def stalling(statement: str) -> str:
        if statement.startswith("UPDATE chain_heads") and not stalled.is_set():
            stalled.set()
            gate.wait(30)  # the process stops here, halfway through the seal's statements
        return real(statement)

    async with tether.Supervisor(pg_url, tools=[refund]) as sup:
        h, g = await sealed_together(sup, "ST")
        schema = sup.journal.url.split("schema=")[1].split("&")[0]
        monkeypatch.setattr(postgres, "translate", stalling)
        written = asyncio.ensure_future(sup.journal._write(notes(h, g)))
        await asyncio.get_running_loop().run_in_executor(None, stalled.wait, 30)

        def lock() -> None:
            with psycopg.connect(PG_URL, autocommit=True) as other:
                other.execute(f'SET search_path = "{schema}"')
                other.execute("SET lock_timeout = '15s'")
                other.execute("BEGIN")
                other.execute("SELECT 1 FROM chain_heads WHERE delegation_id = %s FOR UPDATE",
                              (h,))
                other.execute("ROLLBACK")

        try:
            await asyncio.get_running_loop().run_in_executor(None, lock)  # raises past 15 s
        finally:
            gate.set()
            monkeypatch.setattr(postgres, "translate", real)
        await written  # the batch lost its session, and ran again on a new one
    code, data = await verify_json(pg_url)
    assert (code, data["problems"]) == (0, []), data
