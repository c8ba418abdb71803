"""MCP tasks as a probe: an upstream with the tasks extension (``io.modelcontextprotocol/tasks``,
SEP-2663, on the 2026-07-28 wire) may answer a ``tools/call`` with a task handle instead of the
result. ``tether mcp-proxy`` then journals the task id with the call (an ``mcp_task`` event on
the session's delegation, flushed before it waits), reads the outcome with ``tasks/get`` and
answers its client with the result as if the call had been ordinary.

The task id is what makes a cut call answerable: when the proxy's client cancels (the proxy
sends ``tasks/cancel``), the session is terminated, or the proxy dies and the next one on the
journal recovers the session, the tool's probe asks the upstream ``tasks/get`` for the task
the call became (its id from memory, else from the journal), and the journal settles on it:

- ``completed`` with a result: COMPLETED, with that result (what the client would have got).
- ``failed`` with an error by which the server refuses before running anything (invalid
  params, no such method): NOT_APPLIED, final (the task is over; nothing ran).
- ``failed`` otherwise, ``cancelled``, or ``completed`` with ``isError``: the task is over,
  so nothing more can apply, but it may have applied before it ended. The operator's probe
  for the tool, if there is one, says whether it did (its "not applied" is then final: the
  task can no longer apply); without one, UNKNOWN.
- ``working`` or ``input_required`` (after a short wait): UNKNOWN. Never "not applied": the
  task may still apply, whatever the tool's dispatch deadline says.
- No task known for the call (it never became one, or the proxy died before its id was
  journaled), or ``tasks/get`` failed: the operator's probe, as for any call; else UNKNOWN.

mcp 2.3 validates a ``tools/call`` result as a ``CallToolResult`` on a 2025-11-25 session, so
the in-core tasks of that revision cannot be read (``mcp/client/session.py``, ``send_request``;
the 2025-11-25 row of ``mcp_types/methods.py`` ``SERVER_RESULTS``), and the SDK's server sieves
them likewise. A task-augmented call needs the 2026-07-28 wire, where a result tagged with an
extension's ``resultType`` passes: an upstream configured with ``"tasks": true`` is connected
on it (``server/discover``; an older server is connected as before). That wire has no
server-to-client requests, so such an upstream's sampling, elicitation and roots are not
relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.shared.exceptions import MCPError

from tether._core.model import ProbeOutcome
from tether._integrations.mcp_gateway import REJECTED_BEFORE_RUNNING, McpToolError
from tether._integrations.mcp_relay import RawRequest, RawResult
from tether._runtime.gateway import ACTION
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import ProbeFn, ProbeResult

TASKS = "io.modelcontextprotocol/tasks"
EVENT = "mcp_task"  # the journal's record of the task a call became
TERMINAL = frozenset({"completed", "failed", "cancelled"})
PROBE_WAIT = 5.0  # seconds a probe waits for a running task to end (under the probe timeout)
POLL_MIN, POLL_MAX = 0.01, 1.0  # seconds between two tasks/get, whatever the server suggests


class TaskEnded(McpToolError):
    """A task ended without a result the client can be given (cancelled upstream, or a result
    that is not a tool's): in doubt, and probed."""


async def connect(session: ClientSession) -> None:
    """The 2026-07-28 wire when the server speaks it (the session declares the extension),
    else the handshake as before."""
    try:
        await session.discover()
    except MCPError:
        await session.initialize()


def offers_tasks(session: ClientSession) -> bool:
    caps = session.server_capabilities
    return bool(caps is not None and caps.extensions and TASKS in caps.extensions)


def is_task(result: dict[str, Any]) -> bool:
    return result.get("resultType") == "task" and isinstance(result.get("taskId"), str)


def _pause(task: dict[str, Any]) -> float:
    hint = task.get("pollIntervalMs")
    seconds = hint / 1000 if isinstance(hint, int | float) and hint > 0 else 0.1
    return min(POLL_MAX, max(POLL_MIN, seconds))


@dataclass(eq=False)
class TaskBook:
    """The task-augmented calls to one upstream: each call's task by its idempotency key, kept
    in memory and journaled, and the probe that reads a call's task."""

    upstream: str
    session: ClientSession
    sup: Supervisor | None = None  # set when the proxy's supervisor is up
    delegation_id: str | None = None  # the session's delegation, once it runs
    known: dict[str, str] = field(default_factory=dict)  # action id -> task id
    _cancels: set[asyncio.Task[Any]] = field(default_factory=set)

    async def record(self, key: str, task_id: str) -> None:
        """Journaled and flushed before the proxy waits on the task: a proxy that dies after
        this leaves the next one on the journal a task to ask about. Named by the action the
        call is (``ACTION``), not only its key: a key used again, after a call with it did not
        apply, must not be settled by the earlier call's task."""
        action = ACTION.get()
        if action is None:  # not a journaled call: there is nothing to settle by it
            return
        self.known[action] = task_id
        if self.sup is None:
            return
        self.sup.journal.event(self.sup.clock.wall(), EVENT, self.delegation_id, action,
                               key=key, task=task_id, upstream=self.upstream)
        await self.sup.journal.flush()

    async def lookup(self, key: str) -> str | None:
        """The task the call in doubt under ``key`` became: of that very action (in memory,
        else journaled with its id), or None (then the operator's probe, else UNKNOWN)."""
        if self.sup is None:
            return None
        journal = self.sup.journal
        actions = [a for a in await journal.unsettled() if a.idempotency_key == key]
        found = {self.known[a.id] for a in actions if a.id in self.known}
        if not found and actions:
            ids = {a.id for a in actions}
            for event in await journal.events(sorted({a.delegation_id for a in actions})):
                detail = event.detail
                if event.kind == EVENT and event.action_id in ids and \
                        detail.get("key") == key and detail.get("upstream") == self.upstream \
                        and isinstance(detail.get("task"), str):
                    found.add(detail["task"])
        # Two tasks for one call in doubt: which one answers for it cannot be told.
        return found.pop() if len(found) == 1 else None

    async def get(self, task_id: str) -> dict[str, Any]:
        answer = await self.session.send_request(
            RawRequest(method="tasks/get", params={"taskId": task_id}), RawResult)
        return answer.model_dump(mode="json", by_alias=True, exclude_none=True)

    async def wait(self, task: dict[str, Any], within: float | None = None) -> dict[str, Any]:
        """``tasks/get`` until the task ends (or ``within`` seconds pass): its last state."""
        loop = asyncio.get_running_loop()
        give_up = None if within is None else loop.time() + within
        while task.get("status") not in TERMINAL:
            pause = _pause(task)
            if give_up is not None and loop.time() + pause > give_up:
                break
            await asyncio.sleep(pause)
            task = await self.get(str(task["taskId"]))
        return task

    def cancel(self, task_id: str) -> None:
        """``tasks/cancel``, sent without waiting (the caller is being cancelled): the probe
        that follows reads what became of the task."""

        async def send() -> None:
            with contextlib.suppress(Exception):
                await self.session.send_request(
                    RawRequest(method="tasks/cancel", params={"taskId": task_id}), RawResult)

        job = asyncio.ensure_future(send())
        self._cancels.add(job)
        job.add_done_callback(self._cancels.discard)

    def probe(self, tool: str, fallback: ProbeFn | None) -> ProbeFn:
        """The probe of one of this upstream's tools: its task's state, else ``fallback``."""

        async def probe(idempotency_key: str, **arguments: Any) -> ProbeResult:
            async def ask(final: bool, seen: dict[str, Any]) -> ProbeResult:
                if fallback is None:
                    return ProbeResult(ProbeOutcome.UNKNOWN, {
                        **seen, "reason": f"{tool} has no probe to say more"})
                answer = await fallback(**arguments, idempotency_key=idempotency_key)
                if final and answer.outcome is ProbeOutcome.NOT_APPLIED:
                    # The task is over: nothing it did not apply can apply any more.
                    return ProbeResult(ProbeOutcome.NOT_APPLIED, {**seen, **answer.evidence},
                                       voided=True)
                return ProbeResult(answer.outcome, {**seen, **answer.evidence}, answer.result,
                                   answer.voided)

            task_id = await self.lookup(idempotency_key)
            if task_id is None:
                return await ask(False, {"task": "none journaled for this call"})
            try:
                task = await self.wait(await self.get(task_id), PROBE_WAIT)
            except MCPError as exc:
                return await ask(False, {"task": task_id,
                                         "tasks/get": exc.error.message})
            return await judge(task, ask)

        return probe


async def judge(task: dict[str, Any],
                ask: Callable[[bool, dict[str, Any]], Awaitable[ProbeResult]]) -> ProbeResult:
    """A probe's answer from the task's state as ``tasks/get`` gave it."""
    status = task.get("status")
    seen: dict[str, Any] = {"task": task.get("taskId"), "status": status}
    if status == "completed":
        result = task.get("result")
        if isinstance(result, dict) and not result.get("isError"):
            return ProbeResult(ProbeOutcome.COMPLETED, seen, result)
        seen["reason"] = "the task completed with an error result"
        return await ask(True, seen)
    if status == "failed":
        error = task.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        seen["error"] = error
        if code in REJECTED_BEFORE_RUNNING:
            return ProbeResult(ProbeOutcome.NOT_APPLIED, seen, voided=True)
        return await ask(True, seen)
    if status == "cancelled":
        return await ask(True, seen)
    seen["reason"] = "the task is still running: it may still apply"
    return ProbeResult(ProbeOutcome.UNKNOWN, seen)


def outcome(task: dict[str, Any]) -> dict[str, Any]:
    """An ended task's result for the client, or the error it ended with."""
    status = task.get("status")
    result = task.get("result")
    if status == "completed" and isinstance(result, dict):
        return result
    error = task.get("error")
    if status == "failed" and isinstance(error, dict):
        raise MCPError.from_error_data(mcp_types.ErrorData.model_validate(error))
    raise TaskEnded(f"the upstream's task {task.get('taskId')} ended {status}")
