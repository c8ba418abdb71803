"""State machines and policy bounds (I3, I4), and a model-based test of the journal's rules.

The stateful test drives the journal's operations (the same functions every backend runs, each
in one transaction) with Hypothesis, and after every step compares the journal with a small
reference model of what I2, I3, I4, I7 and I10 allow.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tether
from tests.journal_helpers import pay_action, root_delegation
from tether._core.model import (
    ACTION_FINAL,
    DELEGATION_TERMINAL,
    ActionState,
    CallEnd,
    DelegationState,
    action_may_move,
    check_delegation_move,
    check_grace,
    code_ended,
    executor_gone,
    fenced_below,
    receipt_of,
)
from tether._core.outcome import ActionFacts, settle
from tether._journal import ops
from tether._journal.rows import Begin, NewAction, NewDelegation
from tether._journal.sqlite import SqliteDb, connect
from tether.errors import (
    AlreadyFinished,
    IdempotencyConflict,
    InvalidTransition,
    KeyInUse,
    StaleEpoch,
    StaleSequence,
    UnknownKey,
)
from tether.protocol import ControlIntent, ControlKind, SigningKey, TrustedKeys

S = tether.DelegationState
A = tether.ActionState


def test_terminal_delegations_only_move_to_reconciliation() -> None:
    for state in S:
        if state.terminal and state not in (S.RECONCILED, S.NEEDS_ATTENTION, S.CANCELLED):
            with pytest.raises(AlreadyFinished):
                check_delegation_move("d", state, S.RECALLING)
            check_delegation_move("d", state, S.RECONCILED)


def test_a_cancelled_attempt_never_moves_again() -> None:
    # It was torn down before its code ran: nothing of it can need reconciling.
    for state in S:
        with pytest.raises(InvalidTransition):
            check_delegation_move("d", S.CANCELLED, state)


def test_recall_twice_is_an_invalid_transition_but_terminate_escalates() -> None:
    with pytest.raises(InvalidTransition):
        check_delegation_move("d", S.RECALLING, S.RECALLING)
    check_delegation_move("d", S.RECALLING, S.TERMINATING)
    with pytest.raises(InvalidTransition):
        check_delegation_move("d", S.TERMINATING, S.RECALLING)


def test_every_action_path_ends_in_a_final_state() -> None:
    # From PENDING, every state reachable leads to a final one (I3: nothing dropped).
    seen, frontier = set(), [A.PENDING]
    while frontier:
        state = frontier.pop()
        seen.add(state)
        nexts = [n for n in A if action_may_move(state, n)]
        assert nexts or state in ACTION_FINAL
        frontier += [n for n in nexts if n not in seen]
    assert A.IN_DOUBT in seen and A.UNKNOWN in seen


@pytest.mark.parametrize("kind", list(ControlKind))
def test_under_a_fenced_root_live_descendants_follow_it_and_ended_ones_stay(
        kind: ControlKind) -> None:
    """I10, decided in the core: a RUNNING or RECALLING descendant moves with the root (a
    TERMINATE escalates a recall under way), by a move the state machine allows; any other keeps
    its state."""
    for state in S:
        new = fenced_below(state, kind)
        if state in (S.RUNNING, S.RECALLING):
            assert new is kind.target
            if new is not state:
                check_delegation_move("d", state, new)
        else:
            assert new is state


def test_where_a_childs_own_code_leaves_it() -> None:
    """Decided in the core, each a move a RUNNING delegation may make."""
    assert code_ended(returned=True) is S.SUCCEEDED
    assert code_ended(returned=True, waiting=True) is S.INTERRUPTED
    assert code_ended(returned=False, salvaged=True) is S.SUCCEEDED_PARTIAL
    assert code_ended(returned=False) is S.FAILED
    for returned in (True, False):
        for flag in (True, False):
            check_delegation_move("d", S.RUNNING, code_ended(returned=returned, waiting=flag))
            check_delegation_move("d", S.RUNNING, code_ended(returned=returned, salvaged=flag))


def test_only_a_call_with_no_outcome_yet_is_put_in_doubt_by_its_executor_going() -> None:
    assert executor_gone(A.PENDING) is A.IN_DOUBT
    assert action_may_move(A.PENDING, A.IN_DOUBT)
    for state in set(A) - {A.PENDING}:
        assert executor_gone(state) is state


def test_a_contradicting_fact_holds_a_settled_node_for_a_person() -> None:
    """``attention``: whatever the node would settle to, a person must look; a node that is
    not settled yet, or a cancelled attempt, keeps what it is."""
    probed = [ActionFacts(A.COMPLETED, True)]
    assert settle(S.RECALLED, probed, S.RECALLED) is S.RECONCILED
    assert settle(S.RECALLED, probed, S.RECALLED, attention=True) is S.NEEDS_ATTENTION
    assert settle(S.RECONCILED, probed, S.RECONCILED, attention=True) is S.NEEDS_ATTENTION
    assert settle(S.RECALLING, [ActionFacts(A.IN_DOUBT, False)], S.RECALLED,
                  attention=True) is S.RECALLING
    assert settle(S.CANCELLED, [], S.CANCELLED, attention=True) is S.CANCELLED


def test_completed_is_never_undone() -> None:
    assert not any(action_may_move(A.COMPLETED, n) for n in A)


@pytest.mark.parametrize("grace", [0, -1, math.nan, math.inf, "5", None, True, 301])
def test_bad_grace_is_refused(grace: object) -> None:
    with pytest.raises(tether.errors.UserError):
        check_grace(grace, tether.Policy())


def test_grace_at_the_maximum_is_accepted() -> None:
    assert check_grace(300, tether.Policy()) == 300.0


def test_bad_policy_is_refused() -> None:
    with pytest.raises(tether.errors.UserError):
        tether.Policy(max_grace=math.nan)
    with pytest.raises(tether.errors.UserError):
        tether.Policy(lease=0)


# -- model-based ---------------------------------------------------------------------------

KEY = SigningKey.generate()
TRUSTED = TrustedKeys([KEY.public])


@dataclass
class MDelegation:
    task: str
    parent: str | None
    epoch: int
    fenced: bool = False
    seq: int = 0
    state: S = S.RUNNING


@dataclass
class Model:
    delegations: dict[str, MDelegation] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    actions: dict[str, tuple[str, str, str, A]] = field(default_factory=dict)  # id -> d, key, h
    probed: set[str] = field(default_factory=set)  # actions carrying a probe's evidence

    def subtree(self, root: str) -> list[str]:
        out = [root]
        for did, d in self.delegations.items():
            if d.parent in out and did not in out:
                out += self.subtree(did)
        return out

    def live(self, did: str) -> bool:
        d = self.delegations[did]
        return not d.fenced and d.epoch == self.epochs[d.task]


class JournalRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.db = connect(Path(self.tmp.name) / "j.db", create=True, synchronous="OFF",
                          busy_timeout=1.0)
        self.model = Model()
        self.n = 0

    def teardown(self) -> None:
        self.db.close()
        self.tmp.cleanup()

    def tx(self, fn: Callable[[SqliteDb], Any]) -> Any:
        """One operation, one transaction, as the backends run them."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            value = fn(SqliteDb(self.db))
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")
        return value

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    # -- rules --------------------------------------------------------------------------
    @rule()
    def delegate(self) -> None:
        did, task = self.fresh("d"), self.fresh("t")
        self.tx(lambda db: ops.create_delegation(db, NewDelegation(
            did, task, None, 1, "a", (), {}, "o", 1.0)))
        self.model.delegations[did] = MDelegation(task, None, 0)
        self.model.epochs[task] = 0

    @precondition(lambda self: self.model.delegations)
    @rule(data=st.data())
    def delegate_child(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model.delegations)))
        did, task = self.fresh("d"), self.fresh("t")
        p = self.model.delegations[parent]
        new = NewDelegation(did, task, parent, 1, "a", (), {}, "o", 1.0, parent_epoch=p.epoch)
        if self.model.live(parent) and not p.state.terminal:
            self.tx(lambda db: ops.create_delegation(db, new))
            self.model.delegations[did] = MDelegation(task, parent, 0)
            self.model.epochs[task] = 0
        else:  # I10: a fenced or stale parent cannot start a child
            with pytest.raises(ops.FenceRefused):
                self.tx(lambda db: ops.create_delegation(db, new))

    @precondition(lambda self: self.model.delegations)
    @rule(data=st.data(), key=st.sampled_from(["k1", "k2", "k3"]), arg=st.integers(0, 1))
    def begin(self, data: st.DataObject, key: str, arg: int) -> None:
        did = data.draw(st.sampled_from(sorted(self.model.delegations)))
        d = self.model.delegations[did]
        args = f'{{"x":{arg}}}'
        digest = hashlib.sha256(args.encode()).hexdigest()
        aid = self.fresh("a")
        new = NewAction(aid, did, d.epoch, 0, "pay", tether.Effect.EXTERNAL, args, digest, key,
                        2.0, 32.0)
        prior = [(a, v) for a, v in self.model.actions.items() if v[1] == key]
        try:
            result = self.tx(lambda db: ops.begin_action(db, new, 5.0))
        except IdempotencyConflict:
            assert self.model.live(did)
            assert any(v[2] != digest for _, v in prior)
            return
        except KeyInUse:  # an outcome nobody knows, past its deadline: a person decides
            raise AssertionError("every call here is within its deadline") from None
        if not self.model.live(did):  # I2: the fence answers first, and nothing is written
            assert result.status in (Begin.FENCED, Begin.STALE_EPOCH)
            return
        assert all(v[2] == digest for _, v in prior)  # I7: never a conflict let through
        if result.status is Begin.REPLAY:
            assert any(v[3] is A.COMPLETED for _, v in prior)
            return
        if result.status is Begin.WAIT:  # a call that may still apply holds the key
            assert any(v[3] in (A.PENDING, A.IN_DOUBT, A.UNKNOWN) and a == result.action_id
                       for a, v in prior)
            return
        assert result.status is Begin.STARTED
        assert all(v[3] in (A.FAILED, A.NOT_APPLIED) for _, v in prior)
        self.model.actions[aid] = (did, key, digest, A.PENDING)

    @precondition(lambda self: any(v[3] in (A.PENDING, A.IN_DOUBT, A.UNKNOWN, A.NOT_APPLIED)
                                   for v in self.model.actions.values()))
    @rule(data=st.data(), outcome=st.sampled_from([A.COMPLETED, A.FAILED, A.IN_DOUBT,
                                                    A.NOT_APPLIED, A.UNKNOWN]),
          probe=st.booleans())
    def finish(self, data: st.DataObject, outcome: A, probe: bool) -> None:
        aid = data.draw(st.sampled_from(sorted(self.model.actions)))
        did, key, digest, old = self.model.actions[aid]
        evidence = {"probe": outcome.value} if probe else None
        got = self.tx(lambda db: ops.finish_action(db, aid, outcome, 3.0, None, None, evidence))
        moved = outcome is not old and action_may_move(old, outcome)
        expected = outcome if moved else old
        # A probe's "not yet" keeps an in-doubt action in doubt, with its evidence.
        recorded = moved or (probe and old is A.IN_DOUBT and outcome is A.IN_DOUBT)
        assert got is expected
        self.model.actions[aid] = (did, key, digest, expected)
        if recorded and probe:
            self.model.probed.add(aid)
        if recorded and (probe or old is not A.PENDING):  # a new fact re-opens the accounting
            self.resettle(did)

    def resettle(self, did: str) -> None:
        """The outcome model's settling rule, stated independently of the code under test."""
        d = self.model.delegations[did]
        mine = [(a, v[3]) for a, v in self.model.actions.items() if v[0] == did]
        children = [c for c in self.model.delegations.values() if c.parent == did]
        if d.state in (S.RUNNING, S.RECONCILED, S.CANCELLED):
            return
        if any(not c.state.terminal for c in children):  # a parent settles after its subtree
            return
        if any(st in (A.PENDING, A.IN_DOUBT) for _, st in mine):
            return
        if any(st is A.UNKNOWN for _, st in mine):
            new = S.NEEDS_ATTENTION
        elif any(a in self.model.probed for a, _ in mine) or d.state is S.NEEDS_ATTENTION:
            new = S.RECONCILED
        elif d.state.terminal:
            return
        else:
            new = {S.RECALLING: S.RECALLED, S.TERMINATING: S.TERMINATED}.get(d.state, d.state)
        if new is not d.state:
            d.state = new
            d.fenced = d.fenced or new.terminal
        if d.state.terminal and d.parent is not None:
            self.resettle(d.parent)

    @precondition(lambda self: self.model.delegations)
    @rule(data=st.data(), kind=st.sampled_from(list(ControlKind)),
          offset=st.sampled_from([0, 1, 1, 1, 2]), forged=st.booleans())
    def control(self, data: st.DataObject, kind: ControlKind, offset: int,
                forged: bool) -> None:
        did = data.draw(st.sampled_from(sorted(self.model.delegations)))
        d = self.model.delegations[did]
        grace = 1.0 if kind is ControlKind.RECALL else None
        intent = ControlIntent(kind, did, d.epoch, d.seq + offset, grace, "r", 4.0)
        signer = SigningKey.generate() if forged else KEY
        signed = signer.sign(intent) if intent.seq >= 1 else None
        if signed is None:
            return
        if forged:  # I5: refused before any write
            with pytest.raises(UnknownKey):
                TRUSTED.verify(signed, ControlIntent)
            return
        checked = TRUSTED.verify(signed, ControlIntent)
        try:
            self.tx(lambda db: ops.accept_control(db, signed, checked, "me", 4.0))
        except StaleSequence as exc:
            current = exc.current
            assert offset != 1 and current == d.seq
            return
        except InvalidTransition:
            assert offset == 1
            assert d.state.terminal or kind.target not in (S.RECALLING, S.TERMINATING) \
                or d.state in (S.RECALLING, S.TERMINATING)
            return
        assert offset == 1
        d.seq += 1
        d.state = kind.target
        for sub in self.model.subtree(did):  # I10: the whole subtree, in the same step
            node = self.model.delegations[sub]
            node.fenced = True
            if sub != did and node.state in (S.RUNNING, S.RECALLING):
                node.state = kind.target

    @precondition(lambda self: any(d.parent is None for d in self.model.delegations.values()))
    @rule(data=st.data())
    def redelegate(self, data: st.DataObject) -> None:
        roots = sorted(k for k, d in self.model.delegations.items() if d.parent is None)
        did = data.draw(st.sampled_from(roots))
        d = self.model.delegations[did]
        new_id = self.fresh("d")
        new = NewDelegation(new_id, d.task, None, 1, "a", (), {}, "o", 5.0,
                            redelegate_from_epoch=d.epoch)
        if d.epoch != self.model.epochs[d.task]:
            with pytest.raises(StaleEpoch):  # I4: only one caller moves an epoch
                self.tx(lambda db: ops.create_delegation(db, new))
            return
        self.tx(lambda db: ops.create_delegation(db, new))
        self.model.epochs[d.task] += 1
        self.model.delegations[new_id] = MDelegation(d.task, None, d.epoch + 1)

    @precondition(lambda self: self.model.delegations)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """Grace ended or the owner died: PENDING actions of a subtree become IN_DOUBT."""
        did = data.draw(st.sampled_from(sorted(self.model.delegations)))
        marked = set(self.tx(lambda db: ops.mark_in_doubt(db, did, 6.0)))
        sub = set(self.model.subtree(did))
        expect = {a for a, v in self.model.actions.items() if v[0] in sub and v[3] is A.PENDING}
        assert marked == expect  # I3: nothing in flight is dropped
        for a in marked:
            d, k, h, _ = self.model.actions[a]
            self.model.actions[a] = (d, k, h, A.IN_DOUBT)

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def journal_matches_model(self) -> None:
        for did, d in self.model.delegations.items():
            row = ops.get_delegation(self.db, did)
            assert (row.fenced, row.control_seq, row.state, row.epoch) == (
                d.fenced, d.seq, d.state, d.epoch), did
        actions = ops.actions(self.db, list(self.model.delegations))
        assert {a.id: a.state for a in actions} == {k: v[3] for k, v in
                                                     self.model.actions.items()}

    @invariant()
    def one_live_action_per_key(self) -> None:  # I7, read from the journal itself
        live: dict[str, int] = {}
        for action in ops.actions(self.db, list(self.model.delegations)):
            if action.state not in (A.FAILED, A.NOT_APPLIED):
                live[action.idempotency_key] = live.get(action.idempotency_key, 0) + 1
        assert all(n <= 1 for n in live.values()), live

    @invariant()
    def sequences_are_contiguous(self) -> None:  # I4
        for did in self.model.delegations:
            seqs = [c.seq for c in ops.controls(self.db, did)]
            assert seqs == list(range(1, len(seqs) + 1))


# CI runs a bounded number; TETHER_MODEL_EXAMPLES=600 explores further.
EXAMPLES = int(os.environ.get("TETHER_MODEL_EXAMPLES", "60"))
JournalRules.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30,
                                          deadline=None)
test_journal_rules = JournalRules.TestCase


def _tx(db: sqlite3.Connection, fn: Callable[[SqliteDb], Any]) -> Any:
    db.execute("BEGIN IMMEDIATE")
    try:
        value = fn(SqliteDb(db))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return value


def test_a_recall_fences_a_descendant_whose_state_was_edited_into_nonsense(
        tmp_path: Path) -> None:
    """I10 whatever a hand edit left: a descendant whose state does not decode is fenced with
    the rest and keeps what it holds (``tether verify`` names it); the recall is not refused,
    which would leave the whole subtree open. Its live sibling follows the root."""
    db = connect(tmp_path / "j.db", create=True, synchronous="OFF", busy_timeout=1.0)
    try:
        _tx(db, lambda c: ops.create_delegation(c, NewDelegation(
            "root", "t0", None, 1, "a", (), {}, "o", 1.0)))
        for kid in ("odd", "kid"):
            child = NewDelegation(kid, f"t-{kid}", "root", 1, "a", (), {}, "o", 1.0,
                                  parent_epoch=0)
            _tx(db, functools.partial(ops.create_delegation, new=child))
        db.execute("UPDATE delegations SET state = 'BOGUS' WHERE id = 'odd'")
        intent = ControlIntent(ControlKind.RECALL, "root", 0, 1, 1.0, "r", 4.0)
        signed = KEY.sign(intent)
        _tx(db, lambda c: ops.accept_control(c, signed, TRUSTED.verify(signed, ControlIntent),
                                             "me", 4.0))
        rows = dict(db.execute("SELECT id, state || '/' || fenced FROM delegations"))
        assert rows == {"root": "RECALLING/1", "kid": "RECALLING/1", "odd": "BOGUS/1"}
    finally:
        db.close()


def test_a_receipt_that_puts_a_call_in_doubt_is_journaled_as_a_move(tmp_path: Path) -> None:
    """A tool that raised leaves its call IN_DOUBT: the move is in the event log, as every
    receipt's is (the final receipts' one-statement path is for COMPLETED and FAILED only)."""
    db = connect(tmp_path / "j.db", create=True, synchronous="OFF", busy_timeout=1.0)
    try:
        _tx(db, lambda c: ops.create_delegation(c, root_delegation("d1", "t1")))
        _tx(db, lambda c: ops.begin_action(c, pay_action("a1", "d1", 2.0), 0.5))
        _tx(db, lambda c: ops.finish_action(c, "a1", A.IN_DOUBT, 3.0, None, "boom"))
        _tx(db, lambda c: ops.finish_action(c, "a1", A.COMPLETED, 4.0, "paid"))
        moves = [(k, json.loads(d)) for k, d in db.execute(
            "SELECT kind, detail FROM events WHERE action_id = 'a1' ORDER BY id")]
        assert moves == [("outcome", {"old": "PENDING", "new": "IN_DOUBT"}),
                         ("late_receipt", {"old": "IN_DOUBT", "new": "COMPLETED"})]
    finally:
        db.close()


def test_a_calls_receipt_and_a_stops_end_are_the_cores() -> None:
    """What the gateway records when a call's code ends, and where a recall or terminate
    leaves a delegation once drained: named once, in the core."""
    assert receipt_of(CallEnd.RETURNED) is ActionState.COMPLETED
    assert receipt_of(CallEnd.REJECTED) is ActionState.FAILED  # the tool is certain: no apply
    assert receipt_of(CallEnd.PAST_DEADLINE) is ActionState.FAILED  # never sent
    assert receipt_of(CallEnd.RAISED) is ActionState.IN_DOUBT  # it may have applied
    assert receipt_of(CallEnd.CUT) is ActionState.IN_DOUBT
    for end in CallEnd:  # a receipt is a move the journal allows from PENDING
        assert action_may_move(ActionState.PENDING, receipt_of(end))
    assert ControlKind.RECALL.settled is DelegationState.RECALLED
    assert ControlKind.TERMINATE.settled is DelegationState.TERMINATED
    for kind in ControlKind:
        assert kind.settled in DELEGATION_TERMINAL
