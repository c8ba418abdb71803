"""The simulated gateway and attempts: ``Context.call``/``_run``, ``Supervisor.await_call``,
``_start_child``, ``_launch``, ``start_attempt``, ``_child_main``, ``_finish`` and the
attempts loop (``attempts.drive``/``fork``), as generators over the simulated journal.

Agents are here too: a root that starts children (or pays itself), and children that make a
sequence of payments, with a model stream that may be cut.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tether._core import redispatch
from tether._core.errors import (
    AlreadyFinished,
    ControlSignal,
    DelegationError,
    Fenced,
    InvalidTransition,
    KeyInUse,
    Recalled,
    TetherError,
    ToolRejected,
)
from tether._core.model import ActionState, DelegationState, Effect
from tether._core.outcome import PriorCall, final_at, holds_key
from tether._core.redispatch import CutReason, StreamCut
from tether._journal.rows import Begin
from tether._sim.journal import FenceRefused, NewAction
from tether._sim.runtime import RTT, CommitLost, Node, Spec, Supervisor, TaskRun
from tether._sim.sched import Cancelled, Step
from tether._sim.world import DEADLINE_MARGIN, Request

_A = ActionState
_S = DelegationState
SURFACE = ("pay", "lookup")
KNOWN = frozenset(SURFACE)
REFUSED = (Begin.FENCED, Begin.STALE_EPOCH, Begin.LEASE_EXPIRED)


class ToolError(Exception):
    """The tool could not tell whether its call applied (no reply in time)."""


# -- the gateway -------------------------------------------------------------------------

def call(sup: Supervisor, node: Node, tool: str, logical: str) -> Step:
    """``Context.call``: fence, key, write-ahead intent, shielded call, receipt."""
    if node.stop is not None:
        raise node.stop
    env = sup.env
    if tool == "lookup":  # READ_ONLY: recorded as an event, not journaled as an action
        env.journal.read_event(node.id)
        yield env.rng.uniform(0.001, 0.01)
        return None
    ordinal = node.ordinals.get(tool, 0)
    node.ordinals[tool] = ordinal + 1
    order = node.calls
    node.calls += 1
    key = f"{node.row.task_id}:{tool}:{ordinal}"
    yield RTT
    while True:
        now = sup.wall()
        new = NewAction(env.new_id("a"), node.id, node.row.epoch, order, tool, Effect.EXTERNAL,
                        logical, key, now, now + env.knobs.deadline, logical)
        status, action_id, result = yield from begin(sup, new)
        if status is not Begin.WAIT:
            break
        sup.sched.note(f"{key} waits for {action_id}")
        yield from await_call(sup, action_id, key)
    if status in REFUSED:
        sup.sched.note(f"{key} refused: {status.value}")
        raise node.stop or Fenced(node.id, f"journal refused {tool}: {status.value}")
    if status is Begin.REPLAY:
        sup.sched.note(f"{key} replayed {action_id}")
        return result
    node.effects += 1
    sup.sched.note(f"intent {action_id} {key}")
    proc = sup.spawn(f"call:{action_id}", run_call(sup, node, action_id, key, logical,
                                                   new.deadline_at), daemon=False)
    node.inflight[action_id] = proc
    sup.calls[action_id] = proc
    value = yield proc.done  # shielded: cancelling the child leaves the call running
    return value


def begin(sup: Supervisor, new: NewAction) -> Step:
    """``begin_action``; if its reply is lost, read back whether the intent is there."""
    while True:
        try:
            return sup.write(sup.journal.begin_action, new)
        except CommitLost:
            yield RTT
            if new.id in sup.journal.actions:
                return Begin.STARTED, new.id, None
            now = sup.wall()
            new = replace(new, now=now, deadline_at=now + sup.env.knobs.deadline)


def receipt(sup: Supervisor, action_id: str, state: ActionState, result: Any = None) -> Step:
    """``finish_action`` until its reply arrives (it is idempotent: a repeat is ignored)."""
    while True:
        try:
            sup.write(sup.journal.finish_action, action_id, state, sup.wall(), result)
            return
        except CommitLost:
            yield RTT


def run_call(sup: Supervisor, node: Node, action_id: str, key: str, logical: str,
             deadline_at: float) -> Step:
    """``Context._run``: the call itself, then its receipt."""
    env = sup.env
    knobs = env.knobs
    try:
        if sup.wall() >= deadline_at:  # paused between intent and send: never sent
            yield from receipt(sup, action_id, _A.FAILED)
            raise ToolRejected("dispatch deadline passed before the call was sent")
        req = Request(key, action_id, logical, deadline_at - DEADLINE_MARGIN)
        lo, hi = knobs.latency
        delay = env.rng.uniform(lo, hi)
        if knobs.late and env.rng.random() < knobs.late:  # held in the network
            delay = env.rng.uniform(0.2, 1.1) * max(0.0, req.expires_at - sup.wall())
        env.provider.send(req, delay, env.rng.uniform(lo, hi))
        replied = yield (req.reply, knobs.tool_timeout)
        if not replied:
            yield from receipt(sup, action_id, _A.IN_DOUBT)
            raise ToolError(f"no reply for {key} in {knobs.tool_timeout:g}s")
        if req.reply.value == "refused":
            yield from receipt(sup, action_id, _A.FAILED)
            raise ToolRejected(f"provider refused {key}")
        yield from receipt(sup, action_id, _A.COMPLETED, f"ref:{action_id}")
    except Cancelled:
        _forget(sup, node, action_id)
        raise
    except Exception:
        _forget(sup, node, action_id)
        raise
    _forget(sup, node, action_id)
    return f"ref:{action_id}"


def _forget(sup: Supervisor, node: Node, action_id: str) -> None:
    node.inflight.pop(action_id, None)
    sup.calls.pop(action_id, None)


def await_call(sup: Supervisor, action_id: str, key: str) -> Step:
    """``Supervisor.await_call``: until the earlier call's outcome lets a new one decide, at
    most until its dispatch deadline, after which a probe's answer is final."""
    journal = sup.journal
    tolerance = sup.policy.clock_tolerance
    while True:
        action = journal.actions[action_id]
        final = final_at(action.deadline_at, tolerance)
        now = sup.wall()
        if now >= final and sup.probe_again(action):
            # Past its deadline nothing can apply any more: the next probe is final (also for
            # an UNKNOWN whose probe failed while the call could still apply).
            yield from sup.probe_all([action])
            action = journal.actions[action_id]
        if not holds_key(PriorCall(action.id, action.tool, "", action.state,
                                   deadline_at=action.deadline_at), now, tolerance):
            return  # the journal decides again: replay, run, or an UNKNOWN's KeyInUse
        if now >= final:
            raise KeyInUse(key, action_id, action.state.value)
        # This process runs it (its receipt comes before it ends), else poll: either way at
        # most until the deadline.
        proc = sup.calls.get(action_id)
        wait = min(final - now, sup.policy.lease, sup.env.knobs.poll)
        yield (proc.done if proc is not None else sup.host.notify, wait)


# -- delegations and attempts ------------------------------------------------------------

def start_child(sup: Supervisor, parent: Node, spec: Spec) -> Step:
    """``Supervisor._start_child``: the journal refuses it if the parent is fenced (I10)."""
    n = parent.ordinals.get("agent:child", 0)
    task_id = f"{parent.row.task_id}/child#{n}"
    did = sup.env.new_id("d")
    yield RTT
    while True:
        try:
            row = sup.write(sup.journal.create_child, did, task_id, "child", parent.id,
                            parent.row.epoch, sup.owner_id, sup.wall())
            break
        except FenceRefused:
            raise parent.stop or Recalled(parent.id, "parent is fenced") from None
        except CommitLost:
            yield RTT
            if did in sup.journal.rows:
                row = sup.journal.rows[did]
                break
    parent.ordinals["agent:child"] = n + 1
    node = Node(row, spec, parent=parent)
    parent.children.append(node)
    if parent.stop is not None:  # fenced while the insert was under way: never run it
        node.stop = parent.stop
    run = yield from launch(sup, node)
    return run


def launch(sup: Supervisor, node: Node) -> Step:
    run = TaskRun(node.row.task_id, node, [node])
    node.run = node.run or run
    if node.row.epoch or node.row.parent_id is not None:
        yield RTT
        node.generation = sup.journal.cancel_generation(node.row.task_id)
    start_attempt(sup, node, retry=False)
    sup.spawn(f"drive:{node.id}", drive(sup, run))
    return run


def start_attempt(sup: Supervisor, node: Node, *, retry: bool) -> bool:
    sup.runtimes[node.id] = node
    if retry and node.run is not None:
        moved = redispatch.cancelled(node.generation,
                                     sup.journal.cancel_generation(node.row.task_id),
                                     redispatch.Code.CANCELLED_DURING_FORK)
        if moved is not None:
            sup.sched.note(f"{node.id} {moved.code.value}")
            sup.journal.set_state(node.id, _S.CANCELLED, sup.wall())
            return False
        node.run.current = node
        node.run.attempts.append(node)
        sup.sched.note(f"re-dispatch {node.id} (attempt {node.row.attempt})")
    node.task = sup.spawn(f"agent:{node.id}", child_main(sup, node))
    return True


def child_main(sup: Supervisor, node: Node) -> Step:
    """``Supervisor._child_main``: run the agent, then record how it ended."""
    state = _S.SUCCEEDED
    try:
        if node.stop is not None:
            raise node.stop
        value = yield from agent(sup, node)
        out: tuple[bool, Any] = (True, value)
    except ControlSignal as signal:
        if node.stop is None and node.draining is None and not sup.abandoned:
            sup.adopt_latest(node)  # fenced before this process heard of the intent
        return False, signal
    except Cancelled:
        if node.stop is None:
            raise
        return False, node.stop
    except Exception as exc:  # a cut stream, a failed child, a tool error
        state, out = _S.FAILED, (False, exc)
    try:
        yield from finish(sup, node, state)
    except Cancelled:
        if node.stop is None:
            raise
        return False, node.stop
    return out


def finish(sup: Supervisor, node: Node, state: DelegationState) -> Step:
    """``Supervisor._finish``: a child ended on its own; a control intent that got there
    first decides instead."""
    if node.stop is not None:
        return
    yield RTT
    try:
        doubtful = sup.journal.end_delegation(node.id, state, sup.wall())
    except AlreadyFinished:
        return
    except InvalidTransition:
        sup.adopt_latest(node)
        return
    if doubtful:
        yield from sup.probe_all(doubtful)
        sup.journal.settle_subtree(node.id, state, sup.wall())


def _ended(value: object) -> redispatch.Ending:
    return redispatch.Ending.STREAM_CUT if isinstance(value, StreamCut) \
        else redispatch.Ending.ERROR


def drive(sup: Supervisor, run: TaskRun) -> Step:
    """``attempts.drive``: own a task until its last attempt ends; re-dispatch a cut one only
    when ``decide_redispatch`` allows it and the cancel generation has not moved."""
    journal, policy = sup.journal, sup.env.redispatch
    rt = run.current
    ok, value = False, None
    while True:
        assert rt.task is not None
        try:
            ok, value = yield rt.task.done
        except (Exception, Cancelled, ControlSignal) as exc:
            ok, value = False, exc
        if rt.draining is not None:
            yield (rt.draining.done, 1e9)
        if rt.stop is not None or ok:
            break
        yield RTT
        surface = SURFACE if not rt.spec.kids else ("agent:child",)
        facts = redispatch.AttemptFacts(
            ending=_ended(value), partial_usable=False, attempt=rt.row.attempt,
            side_effects_started=journal.facts(rt.id).side_effecting,
            tools_ran=journal.tools_ran(rt.id), surface=surface, agents={"child": SURFACE},
            known_tools=KNOWN, generation_at_start=rt.generation,
            generation_now=journal.cancel_generation(run.task_id))
        decision = redispatch.decide_redispatch(facts, policy)
        if _ended(value) is redispatch.Ending.STREAM_CUT:
            sup.sched.note(f"{rt.id} cut: {decision.code.value}")
        if not decision.redispatch:
            break
        yield (run.cut_short, policy.settle_delay)
        yield RTT
        moved = redispatch.cancelled(rt.generation, journal.cancel_generation(run.task_id),
                                     redispatch.Code.CANCELLED_DURING_DELAY)
        if moved is not None:
            sup.sched.note(f"{rt.id} {moved.code.value}")
            break
        try:
            fresh = yield from fork(sup, run, rt)
        except TetherError as exc:
            ok, value = False, exc
            break
        if fresh is None:
            ok, value = False, None
            break
        rt = fresh
    run.done.resolve(sup.sched, (ok, value))


def fork(sup: Supervisor, run: TaskRun, failed: Node) -> Step:
    did = sup.env.new_id("d")
    while True:
        try:
            row = sup.write(sup.journal.create_attempt, did, failed.id, sup.owner_id,
                            sup.wall())
            break
        except CommitLost:
            yield RTT
            if did in sup.journal.rows:
                row = sup.journal.rows[did]
                break
    node = Node(row, failed.spec, parent=failed.parent, run=run, generation=failed.generation)
    if failed.parent is not None:
        failed.parent.children.append(node)
    return node if start_attempt(sup, node, retry=True) else None


# -- agents ------------------------------------------------------------------------------

def agent(sup: Supervisor, node: Node) -> Step:
    spec = node.spec
    if not spec.kids:
        value = yield from pay_loop(sup, node)
        return value
    runs = []
    for kid in spec.kids:
        run = yield from start_child(sup, node, kid)
        runs.append(run)
    failed = 0
    for run in runs:
        ok, _ = yield run.done
        failed += not ok
    if failed:
        raise DelegationError(node.id, node.row.task_id, node.row.attempt,
                              f"{failed} child(ren) failed")
    return "done"


def pay_loop(sup: Supervisor, node: Node) -> Step:
    spec = node.spec
    cut = spec.cut if node.row.attempt == 1 else None
    if cut == -1:
        raise StreamCut(CutReason.STREAM_INCOMPLETE)
    if spec.reads:
        yield from call(sup, node, "lookup", "")
    for j in range(spec.pays):
        if cut == j:
            raise StreamCut(CutReason.STREAM_INCOMPLETE)
        yield sup.env.rng.uniform(0.0, 0.05)  # the model thinks
        yield from call(sup, node, "pay", f"{node.row.task_id}#{j}")
    if cut == spec.pays:
        raise StreamCut(CutReason.STREAM_INCOMPLETE)
    return "paid"


__all__ = ["ToolError", "agent", "call", "launch", "start_attempt"]
