"""The tamper-evident journal (docs/security.md): a process with write access to the journal but
no trusted key alters, inserts or deletes records (an action's state or result, an intent's
reason, an event, a whole earlier epoch of the task, a forged receipt under a key a call will
use); `tether verify` names each, `tether show` marks it, and reconciliation, re-delegation and
replay refuse to act on the delegation. No false alarms either: a chain read while its writer
commits, or a delegation pruned while it is verified; and garbage in the chain's own rows is a
named problem, not a traceback. Both backends."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tether
from tests.cli_helpers import tether_here
from tests.test_cli import tether_cli
from tests.test_trust import one_error_line, raw
from tether._core.redispatch import AttemptFacts, Ending, RedispatchPolicy, decide_redispatch
from tether._journal.journal import Journal
from tether.errors import Tampered
from tether.testing import PaymentService

PAY = PaymentService(latency=0.0)


@tether.tool(effect=tether.Effect.EXTERNAL, probe=PAY.lookup)
async def refund(order_id: str, cents: int, *, idempotency_key: str) -> str:
    return await PAY.refund(order_id, cents, idempotency_key=idempotency_key)


def one_refund(prefix: str, cents: int = 1) -> tuple[str, tether.Agent]:
    """A fresh order, and an agent that refunds it once and returns "ok"."""
    order = f"{prefix}-{uuid.uuid4().hex[:6]}"

    async def once(ctx: tether.Context) -> str:
        await ctx.call(refund, order_id=order, cents=cents)
        return "ok"

    return order, tether.Agent("once", once, (refund,))


@dataclass
class Scene:
    delegation: str
    done: str  # a COMPLETED refund
    stuck: str  # a charge left UNKNOWN (its tool has no probe)
    control_event: int  # the event that journaled the TERMINATE and its reason


async def scene(url: str) -> Scene:
    """A delegation that refunded once, then was terminated with a charge in flight: its
    charge ends UNKNOWN, so `tether reconcile` has work to do on it."""
    entered = asyncio.Event()
    order = f"C-{uuid.uuid4().hex[:6]}"

    @tether.tool(name="charge")
    async def charge(order_id: str, cents: int, *, idempotency_key: str) -> str:
        entered.set()
        await asyncio.Event().wait()
        return "never"

    async def worker(ctx: tether.Context) -> None:
        await ctx.call(refund, order_id=order, cents=100)
        await ctx.call(charge, order_id=order, cents=1250)

    async with tether.Supervisor(url, tools=[refund, charge]) as sup:
        child = await sup.delegate(tether.Agent("payer", worker, (refund, charge)),
                                   tools=[refund, charge])
        await entered.wait()
        report = await child.terminate("customer withdrew")
        done, stuck = report.actions
        assert (done.state, stuck.state) == (tether.ActionState.COMPLETED,
                                             tether.ActionState.UNKNOWN), report
        (control,) = [e for e in await sup.journal.events([child.id]) if e.kind == "control"]
    return Scene(child.id, done.id, stuck.id, control.id)


async def before_the_chain(j: Journal, root: tether.KeyRing) -> None:
    """Turn a journal back into one that schema 5 wrote (no chain tables; a root registry
    entry without the "chained" mark, signed by ``root``): opened again, it is upgraded, and
    its delegations' records are unchained, as an old journal's are."""
    from tether._core.documents import KeyGrant, decode

    await raw(j, "DROP TABLE chain")
    await raw(j, "DROP TABLE chain_heads")
    await raw(j, "DROP TABLE chain_seals")
    await raw(j, "UPDATE tether_meta SET value = '5' WHERE key = 'schema_version'")
    body = await j._read(lambda db: db.execute(
        "SELECT body FROM trust WHERE op = 'root'").fetchone()[0])
    grant = decode(bytes(body))
    assert isinstance(grant, KeyGrant) and grant.extra == {"chained": True}
    signed = root.signer.sign(KeyGrant(grant.op, grant.key_id, grant.public, grant.label,
                                       grant.issued_at))
    await raw(j, "UPDATE trust SET body = ?, signature = ? WHERE op = 'root'",
              signed.body, signed.signature)
    # That tether remembered no chain heads either (docs/security.md, "Rollback"): otherwise
    # the configuration names each delegation it saw chained as rolled back, rightly.
    from tether._core.headmark import HeadMemory
    from tether._runtime.keys import HEADS

    (j.keys_dir / HEADS).unlink(missing_ok=True)
    root.trusted.heads = HeadMemory()


Attack = Callable[[Journal, Scene], Awaitable[str]]  # does it; returns the record to be named


async def flip(j: Journal, s: Scene) -> str:
    await raw(j, "UPDATE actions SET state = 'NOT_APPLIED' WHERE id = ?", s.done)
    return f"action {s.done}"


async def rewrite_result(j: Journal, s: Scene) -> str:
    await raw(j, "UPDATE actions SET result = ? WHERE id = ?", '"re_forged"', s.done)
    return f"action {s.done}"


async def rewrite_reason(j: Journal, s: Scene) -> str:
    await raw(j, "UPDATE events SET detail = replace(detail, 'customer withdrew', "
              "'fraud suspected') WHERE id = ?", s.control_event)
    return f"event {s.control_event}"


async def rewrite_delegation(j: Journal, s: Scene) -> str:
    await raw(j, "UPDATE delegations SET state = 'SUCCEEDED', error = NULL WHERE id = ?",
              s.delegation)
    return f"delegation {s.delegation}"


async def insert_action(j: Journal, s: Scene) -> str:
    await raw(j, "INSERT INTO actions (id, delegation_id, ordinal, tool, effect, args, "
              "args_hash, idem_key, state, result, started_at) SELECT 'a_forged', "
              "delegation_id, 9, tool, effect, args, args_hash, 'k_forged', 'COMPLETED', "
              "result, started_at FROM actions WHERE id = ?", s.done)
    return "action a_forged"


async def delete_action(j: Journal, s: Scene) -> str:
    await raw(j, "DELETE FROM actions WHERE id = ?", s.done)
    return f"action {s.done}"


async def delete_event(j: Journal, s: Scene) -> str:
    await raw(j, "DELETE FROM events WHERE id = ?", s.control_event)
    return f"event {s.control_event}"


async def delete_chain_tail(j: Journal, s: Scene) -> str:
    """Covering tracks: the row and its last chain entries deleted together."""
    await raw(j, "DELETE FROM chain WHERE delegation_id = ? AND seq > (SELECT MAX(seq) - 3 "
              "FROM chain WHERE delegation_id = ?)", s.delegation, s.delegation)
    return "chain"


async def reseal(j: Journal, s: Scene) -> str:
    """Covering tracks: flip the state, then chain and seal it again with a key of one's
    own, exactly as the journal would."""
    from tether._journal import chainops

    class Anything(chainops.Sealer):  # the intruder's own code extends any head
        def trusts(self, delegation_id: str, head: Any, registry: Any) -> bool:
            return True

    await raw(j, "UPDATE actions SET state = 'NOT_APPLIED' WHERE id = ?", s.done)
    intruder = Anything()
    intruder.signer = tether.KeyRing.ephemeral().signer
    await j._write(lambda db: chainops.seal(db, [("actions", s.done)], intruder, time.time()))
    return "chain"


async def rewrite_chain(j: Journal, s: Scene) -> str:
    """Covering tracks in the chain itself: flip the state, rewrite the action's entries to
    match, and re-link every later entry and the head's hash (the seal cannot be redone)."""
    from tether._core import chain

    await raw(j, "UPDATE actions SET state = 'NOT_APPLIED' WHERE id = ?", s.done)

    def rewrite(db: Any) -> None:
        (row,) = db.execute(f"SELECT {chain.COLUMNS['actions']} FROM actions WHERE id = ?",
                            (s.done,)).fetchall()
        forged = chain.content_hash(row)
        entries = [(seq, rec, bytes(content).hex(), bytes(pre).hex()) for seq, rec, content, pre
                   in db.execute("SELECT seq, record, content, pre FROM chain WHERE "
                                 "delegation_id = ? ORDER BY seq", (s.delegation,)).fetchall()]
        last = max(seq for seq, rec, _, _ in entries if rec == f"action {s.done}")
        prev = ""
        for seq, rec, content, pre in entries:
            if seq == last:
                content = forged
            prev = chain.entry_hash(prev, s.delegation, seq, rec, content, pre)
            db.execute("UPDATE chain SET content = ?, pre = ?, hash = ? WHERE "
                       "delegation_id = ? AND seq = ?",
                       (bytes.fromhex(content), bytes.fromhex(pre), bytes.fromhex(prev),
                        s.delegation, seq))
        db.execute("UPDATE chain_heads SET hash = ? WHERE delegation_id = ?",
                   (prev, s.delegation))

    await j._write(rewrite)
    return "chain"


async def delete_seal(j: Journal, s: Scene) -> str:
    """The head's seal deleted: in its own row (sealed alone) or the commit's it names."""
    await raw(j, "DELETE FROM chain_seals WHERE id = (SELECT seal_id FROM chain_heads WHERE "
              "delegation_id = ?)", s.delegation)
    await raw(j, "UPDATE chain_heads SET seal = NULL, signer = NULL, signature = NULL WHERE "
              "delegation_id = ?", s.delegation)
    return "chain"


async def rewrite_seal(j: Journal, s: Scene) -> str:
    """The seal's root replaced by one that would take a forged head (its signature kept)."""
    from tether._core.documents import ChainSeal, decode

    def rewrite(db: Any) -> None:
        seal_id, inline = db.execute("SELECT seal_id, seal FROM chain_heads WHERE "
                                     "delegation_id = ?", (s.delegation,)).fetchone()
        body = inline if seal_id is None else db.execute(
            "SELECT seal FROM chain_seals WHERE id = ?", (seal_id,)).fetchone()[0]
        found = decode(bytes(body))
        assert isinstance(found, ChainSeal)
        forged = ChainSeal("f" * 64, found.heads, found.sealed_at).encode()
        if seal_id is None:
            db.execute("UPDATE chain_heads SET seal = ? WHERE delegation_id = ?",
                       (forged, s.delegation))
        else:
            db.execute("UPDATE chain_seals SET seal = ? WHERE id = ?", (forged, seal_id))

    await j._write(rewrite)
    return "chain"


async def extend_proof(j: Journal, s: Scene) -> str:
    """The head's path to its seal given one more level: it leads elsewhere."""

    def extend(db: Any) -> None:
        (proof,) = db.execute("SELECT proof FROM chain_heads WHERE delegation_id = ?",
                              (s.delegation,)).fetchone()
        db.execute("UPDATE chain_heads SET proof = ? WHERE delegation_id = ?",
                   (bytes(proof) + b"R" + bytes(32), s.delegation))

    await j._write(extend)
    return "chain"


ATTACKS: dict[str, Attack] = {
    "deleted_seal": delete_seal, "rewritten_seal": rewrite_seal, "extended_proof": extend_proof,
    "flipped_state": flip, "rewritten_result": rewrite_result,
    "rewritten_reason": rewrite_reason, "rewritten_delegation": rewrite_delegation,
    "inserted_action": insert_action, "deleted_action": delete_action,
    "deleted_event": delete_event, "deleted_chain_tail": delete_chain_tail,
    "resealed_by_intruder": reseal, "rewritten_chain": rewrite_chain,
}


async def verify_json(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = await tether_here("verify", *args, "--journal", url, "--json")
    assert code in (0, 1), out + err
    return code, json.loads(out)


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_tampering_is_named_by_verify_and_refused_by_reconcile(
        journal_url: str, attack: str) -> None:
    s = await scene(journal_url)
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data
    async with Journal(journal_url) as j:
        record = await ATTACKS[attack](j, s)
        stuck_before = await j.action(s.stuck)
    code, data = await verify_json(journal_url)
    assert code == 1, data
    assert {"delegation": s.delegation, "record": record} in [
        {k: p[k] for k in ("delegation", "record")} for p in data["problems"]], data
    code, data = await verify_json(journal_url, s.delegation)  # one subtree: the same
    assert code == 1 and any(p["record"] == record for p in data["problems"]), data
    # Reconciliation refuses to act on it: one error line naming the record; nothing probed.
    code, out, err = await tether_here("reconcile", s.delegation, "--journal", journal_url)
    assert code == 2, out + err
    line = one_error_line(err)
    assert "fail verification" in line and s.delegation in line, line
    if record != "chain":
        assert record in line, line
    async with Journal(journal_url) as j:
        assert (await j.action(s.stuck)).evidence == stuck_before.evidence


async def test_an_alteration_the_writer_then_writes_over_is_still_named(
        journal_url: str) -> None:
    """The writer chains a row as it commits it: a row altered by hand and then written by a
    legitimate process (here a person's decision on the stuck charge, whose amount was
    changed first) would be sealed as that process's own, unless the chain also keeps the
    row as its writer found it."""
    s = await scene(journal_url)
    async with Journal(journal_url) as j:
        await raw(j, "UPDATE actions SET args = replace(args, '1250', '125000') WHERE id = ?",
                  s.stuck)
    code, _, err = await tether_cli("resolve", s.stuck, "--as", "COMPLETED", "--note",
                                    "bank statement", "--by", "alice", "--journal", journal_url)
    assert code == 0, err
    code, data = await verify_json(journal_url)
    assert code == 1, data
    named = [p for p in data["problems"] if p["record"] == f"action {s.stuck}"]
    assert named and "altered before chain entry" in named[0]["problem"], data


async def test_a_rewritten_chain_is_not_sealed_over_by_the_next_writer(
        journal_url: str) -> None:
    """An intruder who rewrites the chain to match an altered row cannot seal it; the next
    legitimate writer (a person's decision, in another process) must not seal it either,
    or the rewrite would pass as that writer's own."""
    s = await scene(journal_url)
    async with Journal(journal_url) as j:
        await rewrite_chain(j, s)
    code, _, err = await tether_cli("resolve", s.stuck, "--as", "COMPLETED", "--note",
                                    "bank statement", "--by", "alice", "--journal", journal_url)
    assert code == 0, err
    code, data = await verify_json(journal_url)
    assert code == 1, data
    assert any(p["record"] == "chain" and "seal" in p["problem"]
               for p in data["problems"]), data


@pytest.mark.parametrize("attack", ["flipped_state", "rewritten_result", "inserted_action",
                                    "deleted_action", "deleted_event", "resealed_by_intruder"])
async def test_show_marks_what_verify_names(journal_url: str, attack: str) -> None:
    s = await scene(journal_url)
    async with Journal(journal_url) as j:
        record = await ATTACKS[attack](j, s)
    code, out, err = await tether_here("show", s.delegation, "--journal", journal_url, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["chain"] == "TAMPERED"
    assert record in {t["record"] for t in data["tampered"]}, data["tampered"]
    if record.startswith("action ") and attack != "deleted_action":
        (marked,) = [a for a in data["actions"] if f"action {a['id']}" == record]
        assert marked["tampered"] in ("altered", "inserted")
    code, out, err = await tether_here("show", s.delegation, "--journal", journal_url)
    assert code == 0 and "TAMPERED" in out, out + err


@pytest.mark.parametrize("attack", ["flipped_state", "rewritten_result", "deleted_action",
                                    "inserted_action", "deleted_event"])
async def test_redelegation_refuses_a_tampered_delegation(journal_url: str,
                                                          attack: str) -> None:
    """Re-delegating replays the old epoch's completed calls by their keys and believes its
    records: a refund whose row was flipped to NOT_APPLIED (or deleted) would be paid again."""
    order = f"R-{uuid.uuid4().hex[:6]}"

    async def twice(ctx: tether.Context) -> str:
        await ctx.call(refund, order_id=order, cents=100)
        return "ok"

    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(tether.Agent("refunder", twice, (refund,)), tools=[refund])
        assert await h.result() == "ok"
        (done,) = (await h.report()).actions
        control = [e for e in await sup.journal.events([h.id]) if e.kind == "state"][-1]
        record = await ATTACKS[attack](sup.journal, Scene(h.id, done.id, "", control.id))
        with pytest.raises(tether.errors.JournalError, match="fail verification") as refused:
            await h.redelegate()
        assert record in str(refused.value)
        assert [r.id for r in await sup.journal.delegations()] == [h.id]  # nothing new
    assert PAY.refund_count(order) == 1


async def test_an_untouched_journal_verifies_clean(journal_url: str) -> None:
    """No false alarms: recalls, terminates, nested children, receipts, a person's decision
    and re-delegation, by several processes (the CLI's intents), all verify."""
    s = await scene(journal_url)
    code, _, err = await tether_cli("resolve", s.stuck, "--as", "COMPLETED", "--note",
                                    "bank statement", "--by", "alice", "--journal", journal_url)
    assert code == 0, err
    order = f"N-{uuid.uuid4().hex[:6]}"

    @tether.agent(tools=[refund])
    async def inner(ctx: tether.Context) -> str:
        return str(await ctx.call(refund, order_id=order, cents=5))

    async def outer(ctx: tether.Context) -> str:
        return str(await (await ctx.delegate(inner)).result())

    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(outer, tools=[inner])
        await h.result()
        again = await h.redelegate()
        await again.result()
        code, out, err = await tether_cli("reconcile", again.id, "--journal", journal_url)
        assert code == 0, out + err
    code, data = await verify_json(journal_url)
    assert (code, data["problems"], data["unchained"]) == (0, [], []), data
    assert data["chains_checked"] == data["delegations"] >= 4


async def test_two_writers_on_one_delegation_never_fork_its_chain(journal_url: str) -> None:
    """Two processes (two journals, two connections) append to one delegation's chain at
    once: each head move waits for the other's (a row lock on PostgreSQL), never forks."""
    s = await scene(journal_url)
    async with Journal(journal_url) as j:
        keys = tether.KeyRing.load(j.keys_dir)  # the deployment's, as its processes load it

    async def write(n: int) -> None:
        async with Journal(journal_url) as j:
            j.seal_with(keys.signer, keys.trusted)
            for i in range(40):
                j.event(time.time(), "note", s.delegation, None, writer=n, i=i)
                if i % 5 == 0:
                    await j.flush()
            await j.flush()

    await asyncio.gather(write(1), write(2), write(3))
    async with Journal(journal_url) as j:
        (verdict,) = await j.chain_verdicts([s.delegation], keys.trusted)
        notes = [e for e in await j.events([s.delegation]) if e.kind == "note"]
    assert len(notes) == 120
    assert verdict.ok, verdict
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data


async def test_a_journal_from_before_the_chain_opens_and_its_records_are_unchained(
        journal_url: str) -> None:
    """A journal at schema 5 (no chain) opens; its delegations' records are listed as
    unchained, not failures; delegations written after the upgrade are chained."""
    old = await scene(journal_url)
    async with Journal(journal_url) as j:
        await before_the_chain(j, tether.KeyRing.load(j.keys_dir))
    new = await scene(journal_url)  # opening migrates to 6
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data
    assert [u["delegation"] for u in data["unchained"]] == [old.delegation], data
    async with Journal(journal_url) as j:
        await flip(j, new)
    code, data = await verify_json(journal_url)
    assert code == 1 and {p["delegation"] for p in data["problems"]} == {new.delegation}


async def test_a_chained_journals_delegation_cannot_be_passed_off_as_unchained(
        journal_url: str) -> None:
    """Covering tracks by downgrade: the chain's entries deleted and its head replaced by an
    unsealed one marked legacy, as the upgrade makes for delegations older than the chain. In
    a journal chained from the start (its signed root entry says so) that is named."""
    s = await scene(journal_url)
    async with Journal(journal_url) as j:
        await flip(j, s)
        await raw(j, "DELETE FROM chain WHERE delegation_id = ?", s.delegation)
        await raw(j, "UPDATE chain_heads SET length = 0, hash = '', legacy = 1, seal_id = NULL, "
                  "proof = NULL WHERE delegation_id = ?", s.delegation)
    code, data = await verify_json(journal_url)
    assert code == 1, data
    assert any(p["delegation"] == s.delegation and "chained from the start" in p["problem"]
               for p in data["problems"]), data


async def test_pruned_delegations_take_their_chain_along(journal_url: str) -> None:
    """`tether prune` removes whole settled trees: their chains go with them, so nothing is
    left for `tether verify` to call deleted."""
    _, once = one_refund("P")
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(once, tools=[refund])
        await h.result()
        # Aged by hand past the deadline and clock tolerance prune waits for (as the
        # retention tests do): an alteration, and the tree it is in goes with the prune.
        await raw(sup.journal, "UPDATE actions SET deadline_at = 0, started_at = 0")
    code, out, err = await tether_here("prune", "--before", "0s", "--journal", journal_url,
                                      "--json")
    assert code == 0 and json.loads(out)["delegations"] == 1, out + err
    async with Journal(journal_url) as j:
        left = await j._read(lambda db: db.execute(
            "SELECT (SELECT COUNT(*) FROM chain WHERE delegation_id = ?) + (SELECT COUNT(*) "
            "FROM chain_heads WHERE delegation_id = ?)", (h.id, h.id)).fetchone()[0])
    assert left == 0
    code, data = await verify_json(journal_url)
    assert (code, data["problems"]) == (0, []), data


def merkle(leaves: list[str]) -> tuple[str, list[list[list[str]]]]:
    """The root and each leaf's path as ``fold`` takes it."""
    from tether._core.chain import _decode_proof, merkle_proofs

    root, proofs = merkle_proofs(leaves)
    return root, [_decode_proof(p) for p in proofs]


def test_a_merkle_path_leads_each_head_to_the_signed_root() -> None:
    from tether._core.chain import fold

    for n in (*range(1, 40), 63, 64, 65, 511, 512, 513):
        leaves = [f"{i:064x}" for i in range(1, n + 1)]
        root, paths = merkle(leaves)
        assert all(fold(leaf, path) == root for leaf, path in zip(leaves, paths, strict=True))
        assert all(len(path) <= max(1, n - 1).bit_length() for path in paths)
        if n > 1:
            assert fold(leaves[0], paths[1]) != root
            assert merkle(leaves[::-1])[0] != root  # the order of the heads is sealed too
    assert merkle(["ab" * 32]) == ("ab" * 32, [[]])


def test_a_binary_proof_is_the_same_path() -> None:
    from tether._core.chain import _decode_proof, fold, merkle_proofs
    from tether._core.errors import Malformed

    leaves = [f"{i:064x}" for i in range(1, 601)]
    root, proofs = merkle_proofs(leaves)
    for leaf, proof in zip(leaves, proofs, strict=True):
        assert len(proof) % 33 == 0 and len(proof) // 33 <= 10
        assert fold(leaf, _decode_proof(proof)) == root
    for bad in (b"L" * 32, b"X" + bytes(32), b"L" + bytes(32) + b"R", bytes(33 * 65)):
        with pytest.raises(Malformed):
            _decode_proof(bad)


def test_redispatch_never_believes_tampered_records() -> None:
    """I6(b) reads the journal's count of side effects: with records that fail their chain
    (an action row deleted by hand reads as "no side effect"), a cut is not re-dispatched."""
    facts = AttemptFacts(ending=Ending.STREAM_CUT, partial_usable=False, attempt=1,
                         side_effects_started=0, tools_ran=0, surface=(), agents={},
                         known_tools=frozenset(), generation_at_start=0, generation_now=0)
    assert decide_redispatch(facts, RedispatchPolicy()).redispatch
    bad = AttemptFacts(**{**facts.__dict__, "tampered": ("d-1: chain",)})
    assert decide_redispatch(bad, RedispatchPolicy()).code.value == "records_tampered"


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
        with pytest.raises(tether.errors.JournalError, match="fail verification") as refused:
            await second.redelegate()
        assert f"action {done.id}" in str(refused.value)
    assert PAY.refund_count(order) == 1


async def delete_whole(journal: Journal, delegation_id: str) -> None:
    """A delegation deleted by hand with everything of it, chain and sealed head included."""
    for sql in ("DELETE FROM events WHERE delegation_id = ? OR (delegation_id IS NULL "
                "AND action_id IN (SELECT id FROM actions WHERE delegation_id = ?))",
                "DELETE FROM actions WHERE delegation_id = ? AND ? <> ''",
                "DELETE FROM controls WHERE delegation_id = ? AND ? <> ''",
                "DELETE FROM documents WHERE delegation_id = ? AND ? <> ''",
                "DELETE FROM chain WHERE delegation_id = ? AND ? <> ''",
                "DELETE FROM chain_heads WHERE delegation_id = ? AND ? <> ''",
                "DELETE FROM delegations WHERE id = ? AND ? <> ''"):
        await raw(journal, sql, delegation_id, delegation_id)


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
        await delete_whole(sup.journal, first.id)
        with pytest.raises(tether.errors.JournalError, match="fail verification") as refused:
            await second.redelegate()
        assert "epoch 0" in str(refused.value)
    assert PAY.refund_count(order) == 1
    code, out, _ = await tether_here("verify", "--journal", journal_url, "--json")
    assert code == 1 and {"delegation": f"task {second.task_id}", "record": "epoch 0"} in [
        {k: p[k] for k in ("delegation", "record")} for p in json.loads(out)["problems"]], out


async def test_the_newest_epoch_deleted_as_a_whole_is_named_by_the_one_before(
        journal_url: str) -> None:
    """The second epoch deleted with its chain, and the task's epoch set back: no gap is left
    among the rows that remain, but the first epoch's chain records which delegation replaced
    it. Re-delegating is refused (the deleted epoch may have held a recall that kept the task
    out, or a key's COMPLETED call), and `tether verify` names the missing epoch."""
    order, once = one_refund("N", cents=100)
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        first = await sup.delegate(once, tools=[refund])
        assert await first.result() == "ok"
        second = await first.redelegate()
        assert await second.result() == "ok"
        await delete_whole(sup.journal, second.id)
        await raw(sup.journal, "UPDATE tasks SET epoch = 0 WHERE id = ?", first.task_id)
        with pytest.raises(tether.errors.JournalError, match="fail verification") as refused:
            await first.redelegate()
        assert "epoch 1 (deleted as a whole)" in str(refused.value)
    assert PAY.refund_count(order) == 1
    code, out, _ = await tether_here("verify", "--journal", journal_url, "--json")
    assert code == 1 and {"delegation": f"task {first.task_id}", "record": "epoch 1"} in [
        {k: p[k] for k in ("delegation", "record")} for p in json.loads(out)["problems"]], out


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
    code, out, err = await tether_here("prune", "--before", "0s", "--journal", journal_url,
                                      "--json")
    assert code == 0 and json.loads(out)["delegations"] == 1, out + err
    async with Journal(journal_url) as j:
        keys = tether.KeyRing.load(j.keys_dir)
        (verdict,) = await j.chain_verdicts(listed, keys.trusted)
    assert verdict.ok, verdict.problems


GARBAGE = {
    "head_length_text": "UPDATE chain_heads SET length = 'abc' WHERE delegation_id = ?",
    "head_path_nested": "UPDATE chain_heads SET seal_id = NULL, proof = NULL, path = '"
                        + "[" * 5000 + "]" * 5000 + "' WHERE delegation_id = ?",
    "head_proof_huge": "UPDATE chain_heads SET proof = zeroblob(100000) WHERE delegation_id = ?",
    "head_seal_id_text": "UPDATE chain_heads SET seal_id = 'x' WHERE delegation_id = ?",
    "seal_body_text": "UPDATE chain_heads SET seal = 'x' WHERE delegation_id = ?",
    "entry_seq_text": "UPDATE chain SET seq = 'x' WHERE seq = 1 AND delegation_id = ?",
    "entry_hash_text": "UPDATE chain SET hash = 'ab' WHERE seq = 1 AND delegation_id = ?",
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
    code, out, err = await tether_here("verify", "--journal", url, "--json")
    assert code == 1, out + err
    assert h.id in {p["delegation"] for p in json.loads(out)["problems"]}, out
    code, out, err = await tether_here("show", h.id, "--journal", url)
    assert code == 0 and "TAMPERED" in out, out + err
    code, out, err = await tether_cli("reconcile", h.id, "--journal", url)
    assert code == 2 and "fail verification" in one_error_line(err), out + err


async def test_reconcile_of_the_whole_journal_names_each_tampered_delegation(
        journal_url: str) -> None:
    """`tether reconcile` with no id: a tampered delegation is left alone as with an id, and
    said so (one line each, exit 1), never "Nothing to reconcile" and exit 0."""
    from typer.testing import CliRunner

    from tether._cli.app import app

    s = await scene(journal_url)
    async with Journal(journal_url) as j:
        await flip(j, s)
    runner = CliRunner()
    result = await asyncio.to_thread(runner.invoke, app, ["reconcile", "--journal", journal_url])
    assert result.exit_code == 1, result.output
    assert "Nothing to reconcile" not in result.stdout
    lines = [ln for ln in result.stderr.splitlines() if s.delegation in ln]
    assert len(lines) == 1, (result.stdout, result.stderr)
    line = lines[0]
    assert line.startswith("refused") and "fail verification" in line, line
    result = await asyncio.to_thread(runner.invoke, app,
                                     ["reconcile", "--journal", journal_url, "--json"])
    assert result.exit_code == 1
    (entry,) = [r for r in json.loads(result.stdout) if r["delegation_id"] == s.delegation]
    assert entry["outcome"] == "REFUSED" and "fail verification" in entry["error"]


async def test_a_writers_own_batch_never_reads_as_tampered(journal_url: str) -> None:
    """A check of a delegation's records that runs in the same batch as this process's own
    writes to them (the writer takes every operation queued as one batch, and seals its
    writes at its end) sees those writes before their chain entries: they are this process's
    own, never someone's tampering, so the check passes."""
    from tether._journal import chainops, ops

    _, once = one_refund("W")
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(once)
        await h.result()
        trusted = sup.keys.trusted
        registry = await sup.journal.registry(trusted)

        def write_then_check(db: Any) -> list[Any]:
            ops.event(db, time.time(), "note", h.id, None)
            return chainops.verdicts(db, [h.id], registry, {}, None)

        (verdict,) = await sup.journal._write(write_then_check)
        assert verdict.problems == []
        await sup.journal.untampered([h.id], trusted, "check it again once sealed")


async def test_a_row_edited_by_hand_stays_named_when_the_writer_writes_it_in_the_batch(
        journal_url: str) -> None:
    """The batch's own writes are excused only where the row they found was the one last
    sealed: a row edited by hand (its run and control sequence), which this process then
    writes over in the same batch as a check, is still named by that check, and so is the
    edit in every later batch."""
    from tether._core.model import DelegationState
    from tether._journal import chainops, ops

    _, once = one_refund("R3")
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        h = await sup.delegate(once)
        await h.result()
        registry = await sup.journal.registry(sup.keys.trusted)
        await raw(sup.journal, "UPDATE delegations SET control_seq = 7, args = ? WHERE id = ?",
                  '{"args": ["evil", "run-of-someone-else"]}', h.id)
        named = []
        for state in (DelegationState.NEEDS_ATTENTION, DelegationState.RECONCILED):

            def write_then_check(db: Any, state: DelegationState = state) -> list[Any]:
                ops.set_state(db, h.id, state, time.time())
                return chainops.verdicts(db, [h.id], registry, {}, None)

            (verdict,) = await sup.journal._write(write_then_check)
            named.append([p.record for p in verdict.problems])
    assert all(f"delegation {h.id}" in records for records in named), named


async def test_a_head_written_back_by_hand_is_left_as_found_while_its_batch_chains_the_rest(
        journal_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An intruder writes a delegation's head back to an earlier sealed state, leaving the
    entries beyond it. The next batch that writes it and another delegation finds entries
    already at the seqs it would append: it appends nothing to that chain (what it had
    inserted is taken out again) and still chains and seals the other one."""
    from tether._journal import chainops, ops

    refused = []
    real_entries = chainops._entries

    def entries(db: Any, plan: Any) -> bool:
        ok = real_entries(db, plan)
        refused.extend([] if ok else [{e[0] for e in plan}])
        return ok

    monkeypatch.setattr(chainops, "_entries", entries)
    # A configuration that remembers no heads (new, or none kept): only the entries tell.
    monkeypatch.setattr(chainops.Sealer, "witness", property(lambda self: None))
    _, once_a = one_refund("HA")
    _, once_b = one_refund("HB")
    head_of = ("SELECT length, hash, seal_id, proof, seal, signer, signature FROM chain_heads "
               "WHERE delegation_id = ?")
    count_of = "SELECT COUNT(*) FROM chain WHERE delegation_id = ?"
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        journal, trusted = sup.journal, sup.keys.trusted
        a, b = await sup.delegate(once_a), await sup.delegate(once_b)
        await a.result()
        await b.result()

        def read(sql: str, d: str) -> Any:
            return journal._read(lambda db: db.execute(sql, (d,)).fetchone())

        earlier = await read(head_of, a.id)
        seal = await journal._read(lambda db: db.execute(
            "SELECT id, seal, signer, signature FROM chain_seals WHERE id = ?",
            (earlier[2],)).fetchone())
        await journal._write(lambda db: ops.event(db, time.time(), "note", a.id, None))
        # The head written back with its seal (gone with the head's last move): a whole
        # earlier state, as a backup holds it.
        if seal is not None:  # sealed with another head (else in its own row)
            await raw(journal, "DELETE FROM chain_seals WHERE id = ?", seal[0])
            await raw(journal, "INSERT INTO chain_seals (id, seal, signer, signature) "
                      "VALUES (?, ?, ?, ?)", *seal)
        await raw(journal, "UPDATE chain_heads SET length = ?, hash = ?, seal_id = ?, proof = ?, "
                  "seal = ?, signer = ?, signature = ? WHERE delegation_id = ?", *earlier, a.id)
        journal._sealer.own.clear()  # as a process that did not seal it (another, or later)
        a_entries, b_head = (await read(count_of, a.id))[0], await read(head_of, b.id)

        def both(db: Any) -> None:
            ops.event(db, time.time(), "note", a.id, None)
            ops.event(db, time.time(), "note", b.id, None)

        await journal._write(both)
        assert refused and a.id in refused[0], "the batch never met the entries left behind"
        assert (await read(count_of, a.id))[0] == a_entries
        assert (await read(head_of, a.id)) == earlier
        assert (await read(head_of, b.id))[0] == b_head[0] + 1
        await journal.untampered([b.id], trusted, "chained beside the written-back head")
        with pytest.raises(Tampered):
            await journal.untampered([a.id], trusted, "its head was written back")


async def test_a_head_marked_legacy_by_hand_is_not_sealed_over_by_its_last_sealer(
        journal_url: str) -> None:
    """In an upgraded journal (root entry without ``chained``), an intruder marks the head
    this process sealed last as legacy and inserts a COMPLETED action by hand. The seal signs
    the legacy mark, so verify names the head; the process that sealed it must not take the
    head for its own (it knows it by length, hash and that mark), or its next write would
    seal the intruder's mark and the forged action would read as merely unchained."""
    await scene(journal_url)
    async with Journal(journal_url) as j:
        await before_the_chain(j, tether.KeyRing.load(j.keys_dir))
    gate, entered = asyncio.Event(), asyncio.Event()
    order = f"L-{uuid.uuid4().hex[:6]}"

    async def twice(ctx: tether.Context) -> str:
        await ctx.call(refund, order_id=order, cents=1)
        entered.set()
        await gate.wait()
        await ctx.call(refund, order_id=order, cents=2)
        return "ok"

    async with tether.Supervisor(journal_url, tools=[refund]) as sup:  # opening upgrades
        child = await sup.delegate(tether.Agent("twice", twice, (refund,)), tools=[refund])
        await entered.wait()
        await sup.journal.flush()
        async with Journal(journal_url) as intruder:
            await raw(intruder, "UPDATE chain_heads SET legacy = 1 WHERE delegation_id = ?",
                      child.id)
            await raw(intruder, "INSERT INTO actions (id, delegation_id, ordinal, tool, "
                      "effect, args, args_hash, idem_key, state, result, started_at) SELECT "
                      "'a_forged', delegation_id, 9, tool, effect, args, args_hash, "
                      "'k_forged', 'COMPLETED', result, started_at FROM actions WHERE "
                      "delegation_id = ?", child.id)
        code, data = await verify_json(journal_url)  # as written, the head fails its seal
        assert code == 1 and any(p["delegation"] == child.id and "legacy" in p["problem"]
                                 for p in data["problems"]), data
        gate.set()
        assert await child.result() == "ok"
    code, data = await verify_json(journal_url)
    assert code == 1, (data["problems"], data.get("unchained"))
    assert any(p["delegation"] == child.id for p in data["problems"]), data


class CommitFails:
    """A journal connection whose next COMMIT fails (a full disk): its batch never was."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.failed = False

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "COMMIT" and not self.failed:
            self.failed = True
            raise RuntimeError("disk full at COMMIT")
        return self._conn.execute(query, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def test_a_head_sealed_by_a_batch_that_never_committed_is_not_the_writers_own(
        journal_url: str) -> None:
    """A batch seals a delegation's head, then its COMMIT fails: that head never was. An
    intruder who writes it into the row (its length and hash, unsealed) must not have it
    taken for the head this process sealed last, extended unchecked and sealed over: the
    writer's next seal would make the intruder's head its own record."""
    from tether._journal import ops

    _, once = one_refund("UC")
    async with tether.Supervisor(journal_url, tools=[refund]) as sup:
        journal = sup.journal
        child = await sup.delegate(once)
        await child.result()
        await journal.flush()
        runner: Any = journal._runner
        real = runner._conn
        runner._conn = CommitFails(real)
        batches: list[Any] = []

        def note(db: Any) -> None:
            batches.append(db)
            ops.event(db, time.time(), "note", child.id, None)

        with pytest.raises(Exception, match="disk full"):
            await journal._write(note)
        runner._conn = real
        ((delegation, length, tip),) = batches[-1].sealed  # what it sealed, never committed
        assert delegation == child.id
        await raw(journal, "UPDATE chain_heads SET length = ?, hash = ?, seal_id = NULL, "
                  "proof = NULL WHERE delegation_id = ?", length, tip, child.id)
        await journal._write(lambda db: ops.event(db, time.time(), "note", child.id, None))
        head = await journal._read(lambda db: db.execute(
            "SELECT length, seal_id FROM chain_heads WHERE delegation_id = ?",
            (child.id,)).fetchone())
        assert (head[0], head[1]) == (length, None), "the intruder's head was sealed over"
        with pytest.raises(Tampered):
            await journal.untampered([child.id], sup.keys.trusted, "an unsealed head")
