"""How a Temporal workflow run is named in the journal, without the Temporal SDK (the CLI
reads it for any delegation): every run of a workflow id is one task, ``temporal:<id>``, and a
run's delegation holds its run id as its body's second argument."""

from __future__ import annotations

from tether._core import chain
from tether._core.errors import Tampered
from tether._core.signing import TrustedKeys
from tether._journal.journal import Journal
from tether._journal.rows import DelegationRow

TASK_PREFIX = "temporal:"
# The event noted on a run's delegation before a child workflow's run opens a delegation of its
# own (on a worker that does not host the parent's tree): how a stop of the parent finds it.
CHILD_APART = "temporal_child_apart"


def task_of(workflow_id: str) -> str:
    """The tether task of every run of one workflow id."""
    return TASK_PREFIX + workflow_id


def workflow_of(task_id: str) -> str | None:
    """The workflow id of a task of Temporal runs; None for any other task."""
    return task_id[len(TASK_PREFIX):] if task_id.startswith(TASK_PREFIX) else None


def call_key(task_id: str, tool: str, activity_id: str, hop: int) -> str:
    """An activity's idempotency key: its place in its workflow, the same in every retry and
    every new start of the id; a run continued as new holds its place in its chain as a
    suffix (Temporal's activity ids are numbers: no first run's key ends so)."""
    return f"{task_id}:{tool}:{activity_id}{f'@{hop}' if hop else ''}"


def activity_of(key: str) -> str:
    """The activity id in a key ``call_key`` made."""
    return key.rsplit(":", 1)[-1].split("@", 1)[0]


def run_of(row: DelegationRow) -> str | None:
    """The workflow run a delegation hosts (its body's second argument)."""
    args = row.args.get("args") if isinstance(row.args, dict) else None
    return args[1] if isinstance(args, list) and len(args) == 2 else None


async def genuine(journal: Journal, pins: TrustedKeys, delegation_id: str, doing: str) -> None:
    """Tampered unless the delegation's row is as its writer sealed it: a task or run edited
    by hand would have a stop signed for another workflow's delegation, or Temporal told to
    stop another workflow. Other records of its chain altered keep no one from stopping the
    run (a stop that reads them says so in its report)."""
    (verdict,) = await journal.chain_verdicts([delegation_id], pins)
    own = ("chain", chain.record("delegations", delegation_id))
    bad = [p.record for p in verdict.problems if p.record in own]
    if bad:
        raise Tampered(f"refusing to {doing}: its delegation {delegation_id} fails "
                       f"verification against its signed chain ({', '.join(bad)}); run "
                       "'tether verify' to see it, and decide by hand", {delegation_id: bad})
