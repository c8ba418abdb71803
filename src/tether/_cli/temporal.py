"""``tether recall`` and ``terminate`` of a delegation that is a Temporal workflow run: with
``--temporal ADDRESS`` the run is cancelled (or terminated) in Temporal too, once the journal's
report is in, and its child workflows running apart on other workers are stopped too, as
``tether.temporal.recall`` does; without it, the run is fenced in the journal and the command
says that Temporal was not told."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tether._core.errors import AlreadyFinished, UserError
from tether._core.model import ControlKind
from tether._integrations.temporal_task import genuine, run_of, workflow_of
from tether._journal.journal import Journal


async def target(journal: str, keys: Path | None, delegation_id: str, address: str,
                 namespace: str, wait: bool) -> Any:
    """The handle of the run the delegation hosts, or None when it is no Temporal run.
    Checked before anything is signed: a wrong address, namespace or run, ``--no-wait``, or a
    row whose records fail verification (its task or run edited by hand would have another
    workflow stopped), changes nothing."""
    from tether._runtime.keys import KeyRing

    async with Journal(journal, create=False) as j:
        row = await j.get(delegation_id)
        workflow = workflow_of(row.task_id)
        if workflow is None:
            return None
        ring = await asyncio.to_thread(KeyRing.load, keys or j.keys_dir)
        await genuine(j, ring.trusted, delegation_id,
                      f"stop the Temporal workflow {workflow} that {delegation_id} names")
    if not wait:
        raise UserError("--temporal stops the workflow in Temporal once the journal's report "
                        "is in (after the grace): it cannot be used with --no-wait")
    try:
        from tether._integrations.temporal_control import run_handle
    except ModuleNotFoundError:
        raise UserError("--temporal needs the Temporal SDK: pip install 'tether[temporal]'") \
            from None
    return await run_handle(address, namespace, workflow, run_of(row))


def not_told(answer: dict[str, Any]) -> str:
    """Without --temporal: what the operator must know of a run fenced in the journal only."""
    workflow = workflow_of(answer["task"])
    if workflow is None:
        return ""
    return (f"{answer['delegation']} is Temporal workflow {workflow}: it is fenced in the "
            "journal, but Temporal was not told; pass --temporal HOST:PORT (or set "
            "$TEMPORAL_ADDRESS) to stop the workflow there too")


async def run_goes_on(journal: str, delegation_id: str) -> str:
    """For an ended delegation that is a Temporal run: what a stop without --temporal leaves
    (a later activity of its run opens the next epoch, unless someone's intent stopped it)."""
    async with Journal(journal, create=False) as j:
        row = await j.get(delegation_id)
    workflow = workflow_of(row.task_id)
    if workflow is None:
        return ""
    return (f"; it is Temporal workflow {workflow}: if no one's intent ended it (its worker "
            "stopped or died), the run goes on at a new epoch; pass --temporal HOST:PORT (or "
            "set $TEMPORAL_ADDRESS) to stop it in Temporal, or use tether.temporal.recall")


async def fence_run(journal: str, keys: Path | None, handle: Any, kind: ControlKind,
                    grace: float | None, reason: str) -> dict[str, Any] | None:
    """A Temporal run whose delegation named has ended: the run's current epoch stopped, or
    its next one opened and fenced if no one's intent stopped the last (as
    ``tether.temporal.recall`` does, signed by this configuration's key), then Temporal
    told. The report, or None when someone's intent had stopped the run already."""
    from tether._integrations.temporal_control import stop
    from tether._runtime.keys import KeyRing
    from tether._runtime.supervisor import Supervisor

    async with Journal(journal, create=False) as j:
        directory = keys or j.keys_dir
    ring = await asyncio.to_thread(KeyRing.load, directory)
    async with Supervisor(journal, keys=ring, recover=False) as sup:
        try:
            report = await stop(handle, sup, kind, grace, reason)
        except AlreadyFinished:
            return None
    return report.to_json()


async def stop_children_apart(journal: str, keys: Path | None, handle: Any,
                              answer: dict[str, Any], kind: ControlKind, grace: float | None,
                              reason: str) -> None:
    """Once the named run's delegation is stopped: its child workflows apart (delegations of
    their own, on workers that do not host its tree) stopped too, at any depth, as
    ``tether.temporal.recall`` stops them, before Temporal is told. Their reports join the
    answer's report (or, while the run's is not settled, ``children_apart``)."""
    from tether._integrations.temporal_control import stop_apart
    from tether._runtime.keys import KeyRing
    from tether._runtime.supervisor import Supervisor

    async with Journal(journal, create=False) as j:
        directory = keys or j.keys_dir
    ring = await asyncio.to_thread(KeyRing.load, directory)
    async with Supervisor(journal, keys=ring, recover=False) as sup:
        row = await sup.journal.get(answer["delegation"])
        mine = await sup.report(row.id)
        both = await stop_apart(sup, handle, row, mine, kind, grace, reason)
    if both is mine:  # no child apart
        return
    if "report" in answer:
        answer["report"] = both.to_json()
    else:
        answer["children_apart"] = [c.to_json() for c in both.children[len(mine.children):]]
        answer["waiting"] += "; " + both.reason.removeprefix(mine.reason).removeprefix("; ")


async def stop_run(handle: Any, kind: ControlKind, reason: str) -> str:
    from tether._integrations.temporal_control import tell_temporal

    await tell_temporal(handle, kind, reason)
    return told(handle, kind)


def told(handle: Any, kind: ControlKind) -> str:
    """What the operator is told once the run was cancelled or terminated in Temporal."""
    done = "cancelled" if kind is ControlKind.RECALL else "terminated"
    return f"Temporal: workflow {handle.id} run {handle.run_id} {done}."
