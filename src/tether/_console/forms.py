"""The operator's forms: a decision on an action nobody could settle, and a recall or
terminate with a reason. The page's script posts them (with the token header) and checks
that a note or reason was typed; the server checks again."""

from __future__ import annotations

from urllib.parse import quote

from tether._console.html import e, utc
from tether._core.outcome import DEFAULT_DISPATCH_DEADLINE, final_at
from tether._core.report import ActionRecord
from tether._journal.browse import ATTENTION
from tether._journal.rows import DelegationRow

DECIDABLE = ATTENTION  # a person decides what no probe could settle (``_core.resolution``)


def deadline_rule(a: ActionRecord, now: float, tolerance: float) -> str:
    """When "not applied" may be recorded: only once the call can no longer land."""
    deadline = a.deadline_at if a.deadline_at is not None else \
        a.started_at + DEFAULT_DISPATCH_DEADLINE
    final = final_at(deadline, tolerance)
    if now < final:
        return (f'<p class="rule warn" data-testid="rule-{e(a.id)}" data-until="{final:.3f}">'
                "This call may still apply "
                f"until {e(utc(final))} (its dispatch deadline, {e(utc(deadline))}, plus "
                f"{tolerance:g} s of clock tolerance), {int(final - now) + 1} s from now. "
                "NOT_APPLIED can be recorded only after that (this form updates when it "
                "passes); COMPLETED can be recorded now.</p>")
    return (f'<p class="rule" data-testid="rule-{e(a.id)}">Its dispatch deadline passed at '
            f"{e(utc(deadline))}: the call can no longer apply. If the provider has no record "
            "of its idempotency key, NOT_APPLIED is final.</p>")


def resolve_form(a: ActionRecord, now: float, tolerance: float) -> str:
    aid = e(a.id)
    choices = "".join(
        f'<label class="choice"><input type="radio" name="outcome" value="{o}" '
        f'data-testid="outcome-{aid}-{o}"> <b>{o}</b>: {why}</label>'
        for o, why in (("COMPLETED", "the call applied (the provider has it)"),
                       ("NOT_APPLIED", "it did not, and never will")))
    return (
        f'<form class="decide" novalidate data-post="/api/actions/{e(quote(a.id, safe=""))}'
        f'/resolve" data-what="decision" data-testid="decide-{aid}">'
        "<fieldset><legend>Record what happened</legend>"
        f'<div class="choices">{choices}</div>{deadline_rule(a, now, tolerance)}'
        f'<label class="wide">Note: what you checked, and what it showed '
        f'<input type="text" name="note" maxlength="2000" autocomplete="off" '
        f'placeholder="e.g. provider dashboard shows charge ch_77 for this key" '
        f'data-testid="note-{aid}"></label>'
        f'<button type="submit" data-testid="resolve-{aid}">Record decision</button>'
        "</fieldset></form>")


def stop_form(d: DelegationRow) -> str:
    """Recall or terminate a live delegation, with the reason the operator types."""
    did = e(d.id)
    return (
        f'<form class="stop" novalidate data-post="/api/delegations/{e(quote(d.id, safe=""))}/"'
        f' data-what="stop" data-testid="stop-{did}">'
        "<fieldset><legend>Stop this delegation and its subtree</legend>"
        '<label class="wide">Reason (signed into the intent, read by whoever audits it) '
        f'<input type="text" name="reason" maxlength="2000" autocomplete="off" '
        f'placeholder="e.g. customer cancelled order O-1" data-testid="reason-{did}"></label>'
        '<label>Grace for calls in flight (s) <input type="number" name="grace" value="30" '
        f'min="0" step="any" class="grace" data-testid="grace-{did}"></label>'
        f'<button type="submit" name="verb" value="recall" data-testid="recall-{did}">'
        "Recall</button>"
        f'<button type="submit" name="verb" value="terminate" class="danger" '
        f'data-confirm="Terminate {did} now? Its calls in flight are cut off and probed." '
        f'data-testid="terminate-{did}">Terminate</button>'
        '<p class="help">Recall stops new work at once and lets calls in flight finish within '
        "the grace; those still running then are probed. Terminate cancels at once: calls in "
        "flight are probed, and any the probe cannot settle come to the needs-attention "
        "queue.</p></fieldset></form>")
