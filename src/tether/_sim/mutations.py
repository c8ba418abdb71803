"""The catalogue of defects fixed in tether's runtime and journal, as edits of the code that
ships (``mutate.Edit``), each with the run in which ``tether sim`` must find it.

``tether sim --mutate NAME`` runs trials with one defect back in; ``tether sim --mutations``
runs the whole catalogue and says, for each, in which trial of its stated run the simulator
found it (docs/simulator.md lists the figures). ``UNCAUGHT`` holds the fixed defects that its
faults have not found yet, each still an edit that applies, so that the gap stays in view.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether._sim.mutate import Edit


@dataclass(frozen=True)
class Mutation:
    name: str
    defect: str  # what the code did before the fix
    edits: tuple[Edit, ...]
    faults: tuple[str, ...]  # the faults its run draws from
    seed: int  # its run's seed (``tether sim --seed``)
    within: int  # it must be found within this many trials of that run
    found_in: int | None  # the trial of that run that finds it today (None: none of them)


def _m(name: str, defect: str, module: str, old: str, new: str, faults: str, seed: int,
       within: int, found_in: int | None = None) -> Mutation:
    return Mutation(name, defect, (Edit(f"tether.{module}", old, new),),
                    tuple(faults.split(",")), seed, within, found_in)


CATALOGUE: tuple[Mutation, ...] = (
    _m("intent_fence",
       "a new intent is journaled for a delegation already fenced by a recall or terminate",
       "_journal.actions",
       "    if gate is not Gate.OPEN:\n        if gate is Gate.LEASE_EXPIRED:",
       "    if gate is not Gate.OPEN and gate is not Gate.FENCED:\n"
       "        if gate is Gate.LEASE_EXPIRED:",
       "race", 1, 200, 14),
    _m("probe_final",
       "a probe's \"not applied\" is taken as final whatever the dispatch deadline says: the "
       "call may still land after the provider looked",
       "_core.outcome",
       "    if voided or not may_still_apply(deadline_at=deadline_at, now=now, "
       "tolerance=tolerance):\n        return _A.NOT_APPLIED",
       "    if True:\n        return _A.NOT_APPLIED",
       "late_apply,reply_lost,race", 99, 60, 7),
    _m("deadline_recheck",
       "a delegation ended with calls that may still apply is never checked again at their "
       "dispatch deadline",
       "_runtime.accounting",
       "        await settle_subtree(sup.journal, root_id, sup.clock, fallback, verdict, reason,"
       " seq)\n        await self._recheck_later(root_id, fallback)",
       "        await settle_subtree(sup.journal, root_id, sup.clock, fallback, verdict, reason,"
       " seq)",
       "late_apply,reply_lost,race", 1, 30, 2),
    _m("queued_fenced",
       "a fenced delegation no worker claimed stays queued: nobody settles it",
       "_runtime.remote",
       "    if not await sup.journal.unclaim(delegation_id, sup.owner_id, sup.clock.wall()):\n"
       "        return None",
       "    if True:\n        return None",
       "crash,race", 1, 30, 5),
    # The core's moves that SQL once chose (``CASE WHEN state IN ...``, ``SET state =
    # 'IN_DOUBT'``): a wrong decision in the core must be found as surely.
    _m("fenced_below",
       "a recall's descendants are fenced but keep their RUNNING state: nothing drains them",
       "_core.model",
       "    if state in (_S.RUNNING, _S.RECALLING):\n        return kind.target",
       "    if False:\n        return kind.target",
       "crash,race,stream_cut", 1, 30, 6),
    _m("executor_gone",
       "a call whose executor goes away (terminated, owner dead) stays PENDING, never probed",
       "_core.model",
       "    return ActionState.IN_DOUBT if state is ActionState.PENDING else state",
       "    return state",
       "crash,reply_lost,race", 1, 30, 6),
    # The core's decisions, each broken as the simulator's former model of the runtime broke
    # them (its mutation tests): found now in the code that ships.
    _m("clock_tolerance",
       "a dispatch deadline is judged without the clock tolerance: a probe's \"not yet\" on a "
       "clock running ahead is final while the request can still land",
       "_core.outcome",
       "    return now < final_at(deadline_at, tolerance)",
       "    return now < deadline_at",
       "clock,late_apply", 2, 300, 76),
    _m("gate_fence",
       "the one gate for actions, children and attempts lets a fenced delegation through",
       "_core.outcome",
       "    if fenced:\n        return Gate.FENCED",
       "    if False:\n        return Gate.FENCED",
       "race,notify_lost,pause", 1, 150, 86),
    _m("settle_in_flight",
       "a delegation settles while one of its calls may still apply",
       "_core.outcome",
       "    if any(a.state in UNSETTLED for a in facts):\n        return state",
       "    if False:\n        return state",
       "late_apply,reply_lost,race", 1, 30, 6),
    _m("owner_alive",
       "every owner on record is presumed alive: what a dead process held is never recovered",
       "_core.outcome",
       "    if owner is None:\n        return False",
       "    if True:\n        return owner is not None",
       "crash", 1, 200, 13),
    _m("redispatch_cancel",
       "a re-dispatch does not see a cancel, recall or terminate that came while it prepared",
       "_core.redispatch",
       "    if now != at_start:",
       "    if False:",
       "stream_cut,race", 1, 250, 123),
    # The key's rule has a second guard in the schema: the live-key index refuses a second
    # live intent with one key, whatever ``decide_key`` said. The call then fails on the
    # constraint instead of paying twice, which the judge counts as an error.
    _m("key_in_flight",
       "a key still in flight or in doubt is free for a new call",
       "_core.outcome",
       "        if holds_key(call, now, tolerance):\n            waiting = call",
       "        if False:\n            waiting = call",
       "late_apply,reply_lost,race", 1, 100, 20),
    _m("key_replay",
       "a key whose call COMPLETED is not replayed: the call runs again",
       "_core.outcome",
       "        if call.state is _A.COMPLETED:\n            return KeyDecision(KeyVerdict.REPLAY, "
       "call)",
       "        if False:\n            return KeyDecision(KeyVerdict.REPLAY, call)",
       "race,reply_lost", 1, 30, 1),
    Mutation(
        "attempt_fence",
        "a re-dispatched attempt is forked under a parent fenced meanwhile: the attempt's gate "
        "skips the parent's fence, and a recall bumps the cancel generation of its own task "
        "only, not of the tasks below it (either rule alone stops it)",
        (Edit("tether._journal.ops",
              "        if parent is None or parent[0]:\n"
              "            raise FenceRefused(Begin.FENCED)",
              "        if parent is None:\n            raise FenceRefused(Begin.FENCED)"),
         Edit("tether._journal.ops",
              '"WHERE id IN (SELECT d.task_id FROM delegations d JOIN sub ON sub.id = d.id)",',
              '"WHERE id IN (SELECT d.task_id FROM delegations d JOIN sub ON sub.id = d.id '
              'AND sub.depth = 0)",')),
        ("stream_cut", "race"), 1, 250, 60),
    _m("send_after_deadline",
       "a call paused between its intent and its send is sent after its dispatch deadline",
       "_runtime.gateway",
       "        if clock.wall() >= deadline_at:\n            # Paused between",
       "        if False:\n            # Paused between",
       "pause,race", 1, 200, 25),
    _m("probe_time",
       "a probe's answer is judged at the time it came back, not when it was sent: a probe "
       "sent before the dispatch deadline and answered after it is a final NOT_APPLIED",
       "_runtime.reconcile",
       "deadline_at=deadline,\n                            now=sent,",
       "deadline_at=deadline,\n                            now=now,",
       "late_apply,probe_hang,pause,race", 1, 200, 85),
    _m("end_children",
       "a delegation whose code raised ends while a child it started still runs; a "
       "terminate of the task finds its root ended and the child goes on paying",
       "_runtime.attempts",
       "    for child in list(rt.children):\n        run = child.run",
       "    for child in ():\n        run = child.run",
       "crash,probe_raise,commit_lost,race", 1, 600, 351),
    _m("reprobe_unknown",
       "a call a probe could not tell about (it failed or timed out) while the call could "
       "still apply is never probed again at its deadline: it stays UNKNOWN for a person",
       "_core.outcome",
       "    return state is _A.UNKNOWN and can_probe and (asked_at is None or may_still_apply(",
       "    return False and (asked_at is None or may_still_apply(",
       "probe_raise,probe_hang,late_apply,reply_lost", 1, 60, 1),
    _m("reprobe_asked_at",
       "whether to probe again is judged on when the last probe answered, not when it was "
       "asked",
       "_runtime.accounting",
       'asked_at = evidence.get("asked_at", evidence.get("probed_at"))',
       'asked_at = evidence.get("probed_at")',
       "late_apply,probe_hang,pause,race", 2, 250, 146),
    _m("seal_unguarded",
       "a commit deletes the seals its moved heads named without asking whether another head "
       "still names one (a writer's memory of its own seals, wrong after a commit lost with "
       "the server, decided it): those heads read as tampered",
       "_journal.chainops",
       "        steps.append((_UNNAMED_SEALS.format(marks(few)), tuple(few), False))",
       '        steps.append((f"DELETE FROM chain_seals WHERE id IN ({marks(few)})", '
       "tuple(few), False))",
       "crash,race", 1, 10, 1),
    _m("relaxed_synced",
       "a head sealed by a commit that did not wait for the disk (a relaxed post, the MCP "
       "proxy's) is remembered as durable at once: a server crash loses it, and the process "
       "then reads its own journal as rolled back",
       "_journal.chainops",
       "    for delegation_id, length, tip, legacy in moved:\n"
       "        sealer.sealed(delegation_id, length, tip, legacy, relaxed)",
       "    for delegation_id, length, tip, legacy in moved:\n"
       "        sealer.sealed(delegation_id, length, tip, legacy, False)",
       "server_lost", 1, 100, 80),
    _m("read_accepted",
       "a head a read accepted is remembered at once, though its commit (another process's "
       "relaxed receipt) may not be on disk: a server crash loses it and the reader takes the "
       "journal for rolled back",
       "_journal.chainops",
       "            witness.accept(d, head.length, head.hash, token)",
       "            witness.note(d, head.length, head.hash)",
       "verify,server_lost", 1, 500, 16),
)


# Defects fixed in code the simulator runs, that its faults have not found yet in the runs below
# (docs/simulator.md says what each would need; ``terminate_in_doubt`` changes no state the
# code reaches today); each edit is kept applicable all the same.
UNCAUGHT: tuple[Mutation, ...] = (
    _m("terminate_in_doubt",
       "a terminate of a delegation whose code had ended leaves its running calls PENDING "
       "instead of in doubt",
       "_runtime.accounting",
       "            root_id, kind.settled, in_doubt=terminate,",
       "            root_id, kind.settled, in_doubt=False,",
       "crash,reply_lost,race", 1, 200),
    _m("freed_key_reuse",
       "a receipt for a call judged NOT_APPLIED, whose key was used again since, re-opens it "
       "as applied: two calls applied under one key",
       "_journal.actions",
       "        if old in KEY_FREE and outcome not in KEY_FREE and db.execute(",
       "        if False and db.execute(",
       "late_apply,reply_lost,race", 1, 200),
)

BY_NAME = {m.name: m for m in (*CATALOGUE, *UNCAUGHT)}


@dataclass(frozen=True)
class Found:
    mutation: str
    trials: int  # trials run until it was found (``within`` and not found: None below)
    trial_seed: int | None  # the trial that found it
    classes: tuple[str, ...]  # what the judge called it

    @property
    def found(self) -> bool:
        return self.trial_seed is not None


def hunt(m: Mutation, within: int | None = None) -> Found:
    """Run ``m``'s trials with its defect in the code until one is judged a violation."""
    from tether._sim.plan import trial_seed
    from tether._sim.runs import results

    budget = m.within if within is None else within
    trials = results([trial_seed(m.seed, i) for i in range(budget)], m.faults, edits=m.edits)
    for i, result in enumerate(trials):  # one at a time, in this process: stops at the first
        if result.violations:
            trials.close()  # the edits are undone before this returns
            kinds = tuple(sorted({v.kind for v in result.violations}))
            return Found(m.name, i + 1, result.seed, kinds)
    return Found(m.name, budget, None, ())


__all__ = ["BY_NAME", "CATALOGUE", "UNCAUGHT", "Found", "Mutation", "hunt"]
