"""The drain protocol of a recall or terminate, as pure decisions a driver executes.

A driver (the asyncio supervisor, the simulator) feeds what it observed and carries out what
comes back; it decides nothing itself. The sequence:

1. ``start``: every node of the subtree is stopped (no new work); a TERMINATE also cuts the
   in-flight calls at once.
2. ``grace_step`` (RECALL only), repeatedly: keep waiting while calls are in flight and grace is
   left, or end the window with a verdict.
3. ``ending``: whether the subtree is terminated, whether in-flight calls are cut, what the
   unfinished calls become, where the nodes end.
4. ``recheck_at``: after probing, when the owner must look again at calls that may still apply.

And for an issuer in another process: how long it waits for the owner's report
(``report_budget``), and how long a settled delegation's verdict is waited for
(``verdict_overdue``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from tether._core.model import ControlKind, DelegationState, Policy
from tether._core.outcome import final_at
from tether._core.verdict import RecallDecision, Verdict


class Stop(StrEnum):
    """The signal every node of a draining subtree raises at its next gateway call or check."""

    RECALLED = "RECALLED"
    TERMINATED = "TERMINATED"


def start(kind: ControlKind) -> tuple[Stop, bool]:
    """The signal for the subtree, and whether in-flight calls are cut at once."""
    if kind is ControlKind.TERMINATE:
        return Stop.TERMINATED, True
    return Stop.RECALLED, False


@dataclass(frozen=True)
class GraceStep:
    wait: float | None  # seconds to wait for a call to finish, or None: the window is over
    verdict: Verdict = Verdict.WAIT_IN_FLIGHT
    reason: str = ""


def grace_step(decision: RecallDecision, *, terminated: bool, live: int,
               guests: bool = False) -> GraceStep:
    """One look at a recall's grace window.

    ``decision`` is ``evaluate_recall`` on facts read *after* ``live`` was counted: ``live`` is
    how many in-flight calls had a running task just before the journal was read. A call whose
    task ended before that count posted its receipt before ending, so the read includes it; a
    pending intent with no task counted before the read really has no executor here. Unless
    ``guests``: the subtree's calls may run in other processes (a Temporal run's activities on
    other workers of its queue), so such an intent may well have a live executor, whose
    receipt the journal will show: it is waited for within the grace like any other."""
    if terminated:
        return GraceStep(None, Verdict.TERMINATE, "terminated during the grace window")
    if decision.verdict not in (Verdict.WAIT_IN_FLIGHT, Verdict.AWAIT_ACK):
        return GraceStep(None, decision.verdict, decision.reason)
    if decision.verdict is Verdict.WAIT_IN_FLIGHT and live == 0 and not guests:
        return GraceStep(None, Verdict.GRACE_EXPIRED, "in-flight action has no live task")
    return GraceStep(decision.wait, decision.verdict, decision.reason)


@dataclass(frozen=True)
class DrainPlan:
    terminate: bool  # stop waiting for the subtree's code: cancel every child task
    cut_calls: bool  # also cancel the in-flight calls (a terminate); a recall leaves them be
    mark_in_doubt: bool  # every call still PENDING becomes IN_DOUBT and is probed
    fallback: DelegationState  # where a node ends when nothing had to be probed


def ending(verdict: Verdict, *, killed: bool) -> DrainPlan:
    """How the drain ends. ``killed``: a TERMINATE reached the subtree (the intent itself, or
    one that cut a recall's window short). When a recall's grace ends, calls still in flight
    are left to finish on their own, so that a completion after the window is still recorded
    (a late receipt) instead of lost with its task; they are in doubt until then."""
    terminate = killed or verdict.must_terminate or verdict is Verdict.REJECTED
    return DrainPlan(
        terminate=terminate,
        cut_calls=killed,
        mark_in_doubt=terminate,
        fallback=DelegationState.TERMINATED if terminate else DelegationState.RECALLED,
    )


def recheck_at(deadlines: Iterable[float], now: float, tolerance: float) -> float | None:
    """When to probe calls left in doubt again: when the first of them can no longer apply,
    its dispatch deadline plus the clock tolerance (a live call's own receipt may settle it
    sooner), never earlier: a probe before it could only say "not yet" again. ``now`` if one
    is already past it: its next probe is final. None when there is nothing left to probe."""
    times = [final_at(t, tolerance) for t in deadlines]
    if not times:
        return None
    return max(now, min(times))


def report_budget(kind: ControlKind, grace: float | None, policy: Policy) -> float:
    """How long an issuer in another process waits for the owner's report before it
    reconciles the delegation itself: the grace window, the acknowledgement, and the owner's
    probes. One round of them for a recall; two for a terminate, since one that lands as a
    recall's drain ends is answered after that drain (its probes, then the terminate's own)."""
    probes = 2 if kind is ControlKind.TERMINATE else 1
    return (grace or 0.0) + policy.ack_timeout + probes * policy.probe_timeout


def verdict_overdue(settled_at: float, now: float, policy: Policy) -> bool:
    """Settled, and no verdict yet: a probe's answer can settle a delegation before its
    owner's drain records the verdict (with the drain's own settle), so it is waited for a
    bounded while; an intent that came once the drain had ended gets none, and its report
    is the settled delegation's as it stands."""
    return now - settled_at >= policy.ack_timeout


__all__ = ["DrainPlan", "GraceStep", "Stop", "ending", "grace_step", "recheck_at",
           "report_budget", "start", "verdict_overdue"]
