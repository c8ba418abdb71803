"""tether on Temporal (``pip install 'tether[temporal]'``): a workflow run is a delegation.

Worker: ``Worker(client, task_queue=..., workflows=[...], plugins=[Plugin(sup, tools=[refund])])``
runs every activity through tether's gateway (intent journaled first, fenced, keyed by the
workflow id and the activity's place, receipt recorded); each tool is registered as an activity
of its name. Orchestrator: ``await recall(handle, supervisor=sup, grace=5.0, reason=...)`` or
``terminate(handle, ...)`` returns the same ``tether.Report`` as a local recall.
"""

from __future__ import annotations

try:
    from tether._integrations.temporal_activities import ActivityProbe, idempotency_key
    from tether._integrations.temporal_control import recall, terminate
    from tether._integrations.temporal_task import task_of
    from tether._integrations.temporal_worker import Plugin
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without the extra
    if exc.name is None or not exc.name.startswith("temporalio"):
        raise
    raise ModuleNotFoundError(
        "tether.temporal needs the Temporal SDK: pip install 'tether[temporal]'",
        name=exc.name) from None

__all__ = ["ActivityProbe", "Plugin", "idempotency_key", "recall", "task_of", "terminate"]
