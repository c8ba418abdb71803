"""A trial's observed schedule: what every process saw and did, on one time line.

Merged from the trial's trace notes (signals, controls, probe answers, helper exits), the
provider's ledger (each application, each request in the network) and the journal (each
delegation, intent, settlement and fence). Kept with a failing trial's record so that
``tether chaos --replay SEED`` can print it beside the rerun, and find where they part.

Times are seconds from the trial's start. Process ids and journal ids differ from run to run;
the comparison uses the role, the event and the key (idempotency keys and task ids follow
from the seed), never the times.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tether._chaos.ledger import Ledger
from tether._core.report import ActionRecord
from tether._journal.rows import ControlRow, DelegationRow, EventRow

Event = dict[str, Any]


def role(who: str) -> str:
    return who.split(":", 1)[0]


# The journal's own events worth seeing beside the others (not its reads and state moves).
JOURNAL_EVENTS = frozenset({
    "cancel_requested", "control", "in_doubt", "late_receipt", "lease_refused",
    "outcome_ignored", "redispatch", "redispatch_decision", "replay", "supervisor_error",
    "worker_error", "hook_error", "verdict"})


# Worth keeping in every trial's schedule, failing or not.
HARNESS_NOTES = frozenset({"reconcile_failed", "reconcile_again", "helper_hung", "hung",
                           "leftover", "refused"})
RESERVED = frozenset({"at", "who", "what", "key"})


class Journaled(Protocol):
    rows: list[DelegationRow]
    actions: list[ActionRecord]
    controls: list[ControlRow]
    events: list[EventRow]


def collect(ledger: Ledger, journal: Journaled | None, start: float) -> list[Event]:
    events: list[tuple[float, Event]] = []

    def add(at: float, who: str, what: str, key: str = "", **detail: Any) -> None:
        events.append((at, {"t": round(at - start, 4), "who": who, "what": what, "key": key,
                            **({"detail": detail} if detail else {})}))

    for at, who, what, key, detail in ledger.notes():
        add(at, who, what, key, **{f"_{k}" if k in RESERVED else k: v
                                   for k, v in detail.items()})
    for key, at, by in ledger.applications():
        add(at, by or "provider", "applied", key)
    for key, sent, due, state, by in ledger.requests():
        add(sent, by, "sent", key, due_in=round(due - sent, 4))
        if state == "dropped":
            add(due, "network", "dropped", key)
    if journal is not None:
        _journaled(journal, add)
    events.sort(key=lambda e: e[0])
    return [e for _, e in events]


def _journaled(journal: Journaled, add: Callable[..., None]) -> None:
    rows, actions, controls = journal.rows, journal.actions, journal.controls
    tasks = {r.id: r for r in rows}
    keys = {a.id: a.idempotency_key for a in actions}
    for r in rows:
        add(r.created_at, "journal", "delegation", f"{r.task_id}#{r.attempt}", epoch=r.epoch,
            final=r.state.value)
    for a in actions:
        add(a.started_at, "journal", "intent", a.idempotency_key, final=a.state.value)
        ev = a.evidence or {}
        if "probed_at" in ev:
            add(float(ev["probed_at"]), "journal", "settled", a.idempotency_key,
                state=a.state.value, probe=ev.get("probe"), late=a.late)
        elif a.ended_at is not None:
            add(a.ended_at, "journal", "outcome", a.idempotency_key, state=a.state.value,
                late=a.late)
    for c in controls:
        row = tasks.get(c.delegation_id)
        add(c.accepted_at, "journal", "fence",
            f"{row.task_id}#{row.attempt}" if row else c.delegation_id, kind=c.kind.value)
    for note in journal.events:
        if note.kind not in JOURNAL_EVENTS:
            continue
        row = tasks.get(note.delegation_id or "")
        key = keys.get(note.action_id or "") or (f"{row.task_id}#{row.attempt}" if row else "")
        detail = {k: v for k, v in note.detail.items() if isinstance(v, str | int | float | bool)}
        add(note.at, "journal", note.kind, key, **{f"_{k}" if k in RESERVED else k: v
                                                    for k, v in detail.items()})


def signature(event: Event) -> tuple[str, str, str]:
    return role(str(event["who"])), str(event["what"]), str(event["key"])


def divergence(recorded: list[Event], replayed: list[Event]) -> dict[str, Any] | None:
    """The first event where the two runs part (by role, event and key), or None."""
    a = [signature(e) for e in recorded]
    b = [signature(e) for e in replayed]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return {"index": i, "recorded": recorded[i], "replayed": replayed[i]}
    if len(a) != len(b):
        i = min(len(a), len(b))
        return {"index": i, "recorded": recorded[i] if i < len(a) else None,
                "replayed": replayed[i] if i < len(b) else None}
    return None


def schedule(trace: list[Event]) -> dict[str, Any]:
    """The compact schedule kept for every trial: what the provider applied in which order,
    the probes' answers, the signals and cross-process controls actually used."""
    out: dict[str, Any] = {"applications": [], "probes": [], "signals": [], "controls": []}
    for e in trace:
        what, detail = e["what"], e.get("detail", {})
        if what == "applied":
            out["applications"].append([e["t"], e["key"], role(e["who"])])
        elif what == "probe":
            out["probes"].append([e["t"], role(e["who"]), e["key"], detail.get("answer")])
        elif what == "signal":
            out["signals"].append([e["t"], e["key"], detail.get("sig")])
        elif what in ("control_sent", "control_returned"):
            out["controls"].append([e["t"], what, e["key"], detail.get("how")])
        elif what in HARNESS_NOTES:
            out.setdefault("notes", []).append([e["t"], what, e["key"], detail])
    out["counts"] = dict(Counter(f"{role(e['who'])}:{e['what']}" for e in trace))
    return out


def line(event: Event | None) -> str:
    if event is None:
        return ""
    detail = event.get("detail")
    extra = " " + json.dumps(detail, separators=(",", ":"), default=str) if detail else ""
    return f"{event['t']:+8.3f} {event['who']} {event['what']} {event['key']}{extra}"


def record_path(directory: Path, seed: int) -> Path:
    return directory / f"trial-{seed}.json"


def save(directory: Path, record: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = record_path(directory, int(record["trial_seed"]))
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def load(directory: Path, seed: int) -> dict[str, Any] | None:
    path = record_path(directory, seed)
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data
