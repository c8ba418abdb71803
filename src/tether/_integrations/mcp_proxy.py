"""``tether mcp-proxy``: an MCP server in front of one or more upstream MCP servers.

Any MCP client (any agent) talks to the proxy as to the upstream servers: the same tools,
resources, prompts and completions, the same results and errors, its sampling, elicitation and
roots asked of the real client (``mcp_relay``). Each client session is one tether delegation:
every ``tools/call`` is journaled with its key, fenced, and reconciled when in doubt; an
operator recalls or terminates the session with ``tether recall`` / ``tether terminate`` from
another shell, and the client then gets an error result for each new call instead of an action
nobody accounted for.

A client that cancels a call (``notifications/cancelled``, or a dropped HTTP stream) has the
cancellation sent on upstream; the action is then in doubt and probed, never taken as done.
A client may carry its own idempotency key in the request's ``_meta``
(``io.tether/idempotency-key``): a retry with the same key replays the journaled outcome.
Client keys live in a namespace of their own, ``client:<key>``: journaled, sent upstream and
given to the tool's probe so. No client can then name another session's automatic key
(``<task id>:<tool>:mcpN``), in the journal or at an upstream that dedupes on the key, and
make that session's genuine call replay; the client's own retries still agree everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from mcp import ClientSession
from mcp import types as mcp_types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.session import ServerSession
from mcp.shared.exceptions import MCPError

from tether._core.documents import ControlIntent
from tether._core.errors import (
    ControlSignal,
    KeyInUse,
    TetherError,
    ToolRejected,
    UserError,
)
from tether._core.model import ActionState, ControlKind
from tether._core.redispatch import UNRESTRICTED
from tether._integrations.mcp_config import ProxyConfig
from tether._integrations.mcp_gateway import (
    KEY_META,
    McpToolError,
    argument_error,
    wrap_tools,
)
from tether._integrations.mcp_policy import ServerPolicy
from tether._integrations.mcp_relay import (
    AsClient,
    ClientRelay,
    RawParams,
    forward,
    outgoing,
)
from tether._integrations.mcp_tasks import TASKS, TaskBook, offers_tasks
from tether._integrations.mcp_upstream import (
    CALL,
    Call,
    Upstream,
    UpstreamErrorResult,
    UpstreamFailed,
    UpstreamRejected,
    error_result,
    forwarder,
)
from tether._runtime.gateway import Context
from tether._runtime.reconcile import probe_all
from tether._runtime.supervisor import Supervisor
from tether._runtime.tools import Tool, ToolFn


def _line(text: str) -> str:
    """``text`` on one line, without control characters (a journal string told to an agent)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


MAX_KEY = 255  # characters in a client's idempotency key (Stripe's bound)
# Where client keys are journaled; automatic keys start with a task id ("t..."), never this.
CLIENT_KEYS = "client:"


class Proxy:
    """One client session: its upstream sessions, the tools they offer, and the delegation that
    journals the calls."""

    def __init__(self, config: ProxyConfig) -> None:
        self.specs = dict(config.upstreams)
        self.policies = {n: config.policies.get(n, ServerPolicy(n)) for n in self.specs}
        self.name = config.session
        self.upstreams: list[Upstream] = []
        self.exposed: dict[str, tuple[Tool, mcp_types.Tool, Upstream]] = {}
        self.ctx: Context | None = None
        self.sup: Supervisor | None = None
        self.closed = asyncio.Event()  # the client ended its session
        self.ready = asyncio.Event()  # the delegation's body runs: calls may pass
        self.relay = ClientRelay(self._client, self._refresh_tools)
        self.client: ServerSession | None = None  # the client's session, once it is known
        # Sessionless (2026-07-28) HTTP clients share this proxy: what an upstream asks or
        # says goes only to the one client request that is waiting on that upstream.
        self.shared = False
        self._in_flight: dict[int, ServerRequestContext[Any]] = {}
        self._waiting: dict[ClientSession, dict[int, ServerRequestContext[Any]]] = {}
        self._ordinals: Counter[str] = Counter()
        self._background: set[asyncio.Task[Any]] = set()

    # -- upstreams ------------------------------------------------------------------------------
    def session_for(self, read: Any, write: Any, tasks: bool = False,
                    declared: mcp_types.ClientCapabilities | None = None) -> ClientSession:
        """An upstream session declaring what the client ``declared`` it can do."""
        relay = self.relay
        handler, known_as = relay.notifications()
        session = AsClient(read, write, sampling_callback=relay.sampling,
                           elicitation_callback=relay.elicitation,
                           list_roots_callback=relay.roots, message_handler=handler,
                           extensions={TASKS: {}} if tasks else None, declared=declared)
        known_as(session)
        return session

    async def add_upstream(self, name: str, session: ClientSession) -> None:
        spec = self.specs[name]
        up = Upstream(name, session, self.policies[name], spec.prefix)
        if spec.tasks and offers_tasks(session):
            up.book = TaskBook(name, session, self.sup)
        self.upstreams.append(up)
        if up.capabilities.tools is not None:
            await self._load_tools(up)

    def attach(self, sup: Supervisor) -> None:
        """The supervisor that journals this session's calls (and reads their tasks)."""
        self.sup = sup
        # A receipt posted alone would otherwise take a durable commit of its own just before
        # the relaxed flush that answering waits for (``call_tool``).
        sup.journal.relaxed_posts = True
        for up in self.upstreams:
            if up.book is not None:
                up.book.sup = sup

    def journaled_tools(self) -> list[Tool]:
        return [t for t, _, _ in self.exposed.values()]

    async def _load_tools(self, up: Upstream) -> None:
        book = up.book

        def make(session: ClientSession, spec: mcp_types.Tool) -> ToolFn:
            return forwarder(session, spec, book)

        found = await wrap_tools(up.session, up.policy, make=make)
        if book is not None:  # each call's task, if it became one, is its probe's answer
            found = [(dataclasses.replace(t, probe=book.probe(t.name, t.probe)), s)
                     for t, s in found]
        fresh: dict[str, tuple[Tool, mcp_types.Tool]] = {}
        for tool, spec in found:
            shown = spec.model_copy(update={"name": up.prefix + spec.name})
            known = up.tools.get(shown.name)
            if known is not None and known[0].effect is tool.effect:
                tool = known[0]  # the delegation's surface granted this very object
            other = self.exposed.get(shown.name)
            if other is not None and other[2] is not up:
                raise UserError(
                    f"upstreams {other[2].name} and {up.name} both offer a tool named "
                    f"{shown.name!r}: give one of them a tool-name prefix in the policy")
            fresh[shown.name] = (tool, shown)
        for old in up.tools:
            self.exposed.pop(old, None)
        up.tools = fresh
        self.exposed.update({n: (t, s, up) for n, (t, s) in fresh.items()})

    async def _refresh_tools(self) -> None:
        for up in self.upstreams:
            if up.capabilities.tools is not None:
                with contextlib.suppress(TetherError, MCPError):
                    await self._load_tools(up)

    def tools(self) -> tuple[Tool | str, ...]:
        # Tools an upstream adds later (list_changed) are declared too: grant them as well.
        return (*(t for t, _, _ in self.exposed.values()), UNRESTRICTED)

    # -- the client -----------------------------------------------------------------------------
    def _client(self, origin: ClientSession | None = None) -> tuple[ServerSession, Any] | None:
        """Where to send what an upstream asks: the latest client request in flight (its
        stream), else the client's session. Shared by sessionless clients, the one client
        request waiting on that upstream, or nobody: a request of another client may be the
        latest, and which of two waiting requests an upstream's message belongs to cannot be
        told (stdio carries no link between them), so it is refused rather than guessed."""
        if self.shared:
            waiting = list(self._waiting.get(origin, {}).values()) if origin else []
            if len(waiting) != 1:
                return None
            return waiting[0].session, waiting[0].request_id
        if self._in_flight:
            request = list(self._in_flight.values())[-1]
            return request.session, request.request_id
        if self.client is not None:
            return self.client, None
        return None

    async def track(self, ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        """Middleware: remembers the client's session and its requests in flight."""
        self.client = ctx.session
        if ctx.request_id is None or ctx.method == "initialize":
            return await call_next(ctx)
        self.relay.ready.set()  # a request after initialize: past the handshake (or sessionless)
        await self.relay.early_roots()
        self._in_flight[id(ctx)] = ctx
        try:
            return await call_next(ctx)
        finally:
            self._in_flight.pop(id(ctx), None)

    # -- everything but tools/call: passed through -----------------------------------------------
    def _route(self, method: str, params: Mapping[str, Any]) -> list[Upstream]:
        """The upstreams that may serve a request, in the order to try them."""
        area = method.split("/")[0]
        capability = {"completion": "completions"}.get(area, area)
        serving = [up for up in self.upstreams
                   if getattr(up.capabilities, capability, None) is not None]
        if method == "prompts/get":
            name = str(params.get("name", ""))
            named = [up for up in serving if up.prefix and name.startswith(up.prefix)]
            return named or serving
        return serving

    async def pass_through(self, ctx: ServerRequestContext[Any], _: RawParams) -> dict[str, Any]:
        params = dict(ctx.params or {})
        serving = self._route(ctx.method, params)
        if not serving:
            raise MCPError(code=mcp_types.METHOD_NOT_FOUND, message="Method not found",
                           data=ctx.method)
        signal = self._stop() if self.ctx is not None else None
        if signal is not None and not ctx.method.endswith("/list") and \
                any(not up.policy.trusted for up in serving):
            # Fenced: an untrusted server's reads are its code too (its tools are EXTERNAL,
            # fail closed), so none of its requests pass any more; listings still do.
            raise MCPError(code=mcp_types.INVALID_REQUEST,
                           message=await self._stopped(signal, "the request was not made"))
        if len(serving) == 1 or (ctx.method.endswith("/list") and "cursor" in params):
            with self.waiting_on(serving[0], ctx):
                return await forward(serving[0].session, ctx, ctx.method, params)
        if ctx.method.endswith("/list"):  # several upstreams: one page holding all of them
            return await self._merge(ctx, serving, params)
        if ctx.method == "logging/setLevel":
            for up in serving:
                await forward(up.session, ctx, ctx.method, params)
            return {}
        failure: MCPError | None = None
        for up in serving:  # the first upstream that knows the resource, prompt or reference
            try:
                with self.waiting_on(up, ctx):
                    return await forward(up.session, ctx, ctx.method, params)
            except MCPError as exc:
                failure = exc
        assert failure is not None
        raise failure

    @contextlib.contextmanager
    def waiting_on(self, up: Upstream, ctx: ServerRequestContext[Any]) -> Iterator[None]:
        """``ctx`` waits on a request to ``up``: what ``up`` asks meanwhile may be its."""
        waiting = self._waiting.setdefault(up.session, {})
        waiting[id(ctx)] = ctx
        try:
            yield
        finally:
            waiting.pop(id(ctx), None)

    async def _merge(self, ctx: ServerRequestContext[Any], serving: list[Upstream],
                     params: dict[str, Any]) -> dict[str, Any]:
        merged: dict[str, list[Any]] = {}
        for up in serving:
            cursor: str | None = None
            while True:
                page = await forward(up.session, ctx, ctx.method,
                                     {**params, "cursor": cursor} if cursor else params)
                for key, value in page.items():
                    if isinstance(value, list):
                        merged.setdefault(key, []).extend(value)
                cursor = page.get("nextCursor")
                if not cursor:
                    break
        return dict(merged)

    async def roots_changed(self, _: ServerRequestContext[Any],
                            __: mcp_types.NotificationParams) -> None:
        for up in self.upstreams:
            await up.session.send_notification(mcp_types.RootsListChangedNotification())

    async def client_initialized(self, ctx: ServerRequestContext[Any],
                                 params: mcp_types.NotificationParams) -> None:
        """The client's handshake is done: what the upstreams asked or said meanwhile goes."""
        self.client = ctx.session
        self.relay.ready.set()

    def server_info(self) -> mcp_types.Implementation:
        """The ``serverInfo`` the client sees: with one upstream, the upstream's own; with
        several, no one server's: ``tether-mcp-proxy (a, b)`` and tether's version."""
        if len(self.upstreams) == 1 and (info := self.upstreams[0].session.server_info):
            return info
        from tether import __version__

        return mcp_types.Implementation(
            name=f"tether-mcp-proxy ({', '.join(up.name for up in self.upstreams)})",
            version=__version__)

    # -- tools ----------------------------------------------------------------------------------
    async def session_agent(self, ctx: Context) -> None:
        """The delegation's body: it lives as long as the client session."""
        self.ctx = ctx
        for up in self.upstreams:
            if up.book is not None:
                up.book.delegation_id = ctx.delegation_id
        self.ready.set()
        await self.closed.wait()

    async def list_tools(self, _: ServerRequestContext[Any], __: RawParams) -> dict[str, Any]:
        return mcp_types.ListToolsResult(
            tools=[spec for _, spec, _ in self.exposed.values()]).model_dump(
                mode="json", by_alias=True, exclude_none=True)

    async def call_tool(self, ctx: ServerRequestContext[Any], _: RawParams) -> dict[str, Any]:
        answer = await self._call(ctx)
        # The client acts on what it is told, so the journal holds the call's outcome before
        # the client hears it: a proxy that dies after answering leaves what its client saw
        # paid recorded, never for a probe to find. (A read-only call has no outcome to hold.)
        # Committed, not yet synced to disk: a crash of this process cannot lose it, and the
        # next durable commit (the next intent) syncs it. Only a machine that loses power in
        # between can lose it; the durable intent then leaves the call in doubt and probed,
        # as for any receipt never written: never a false outcome (docs/performance.md).
        name = (ctx.params or {}).get("name")
        found = self.exposed.get(name) if isinstance(name, str) else None
        if found is None or found[0].effect.journaled:
            assert self.sup is not None
            await self.sup.journal.flush(durable=False)
        return answer

    async def _call(self, request: ServerRequestContext[Any]) -> dict[str, Any]:
        params = dict(request.params or {})
        name = params.get("name")
        arguments = params.get("arguments") or {}
        found = self.exposed.get(name) if isinstance(name, str) else None
        if found is None:
            return error_result(f"Unknown tool: {name}")
        if not isinstance(arguments, dict) or "idempotency_key" in arguments:
            raise MCPError(code=mcp_types.INVALID_PARAMS,
                           message="tether mcp-proxy: arguments must be an object, and "
                           "'idempotency_key' is reserved (send it in _meta as "
                           f"{KEY_META!r})")
        if (wrong := argument_error(found[1], arguments)) is not None:  # never journaled
            raise MCPError(code=mcp_types.INVALID_PARAMS, message=f"tether mcp-proxy: {wrong}")
        tool = found[0]
        await self.ready.wait()
        out, wants = outgoing(params)
        meta = dict((out or {}).get("_meta") or {})
        key = meta.pop(KEY_META, None)
        if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY):
            # Ignored, it would leave the retries the client meant to make safe unsafe.
            raise MCPError(code=mcp_types.INVALID_PARAMS,
                           message=f"tether mcp-proxy: {KEY_META!r} in _meta must be a string "
                           f"of 1 to {MAX_KEY} characters")
        key = self._next_key(tool) if key is None else CLIENT_KEYS + key
        assert self.ctx is not None and self.sup is not None
        # The proxy does not offer tasks: a task-augmented request runs as an ordinary call.
        forwarded = {k: v for k, v in (out or {}).items() if k not in ("task", "_meta")}
        call = Call(request, forwarded, meta, wants)
        CALL.set(call)  # copied into the action's task with this context
        try:
            with self.waiting_on(found[2], request):
                result = await self.ctx.call(tool, idempotency_key=key, **arguments)
        except ControlSignal as signal:  # recalled or terminated: no new work
            return error_result(await self._stopped(signal, "the call was not made"))
        except asyncio.CancelledError:
            if self._stop() is not None:  # a terminate cut the call
                return error_result(await self._stopped(
                    self._stop(), "the call's outcome is in doubt and is being reconciled"))
            # The client cancelled: cancel the call upstream too, and reconcile it. Nothing
            # may be awaited here (the client's cancellation is pending on this task).
            call.cancelled = True
            self._spawn(self._reconcile_cancelled(call, tool, key))
            raise
        except UpstreamErrorResult as exc:  # in doubt, and the client sees what it said
            return exc.result
        except (UpstreamRejected, UpstreamFailed) as exc:
            raise exc.error from None
        except (McpToolError, UserError, ToolRejected, KeyInUse) as exc:
            # KeyInUse: a retry whose key belongs to a call in doubt past its deadline, which a
            # person must reconcile; said like every other refusal, not as a JSON-RPC error.
            return error_result(str(exc))
        if isinstance(result, dict):  # the upstream's own result, as journaled
            return result
        return error_result("tether: this call replayed a result it cannot return")

    def _next_key(self, tool: Tool) -> str:
        assert self.ctx is not None
        n = self._ordinals[tool.name]
        self._ordinals[tool.name] += 1
        return f"{self.ctx.task_id}:{tool.name}:mcp{n}"

    def _stop(self) -> ControlSignal | None:
        assert self.ctx is not None
        try:
            self.ctx.check()
        except ControlSignal as signal:
            return signal
        return None

    async def _stopped(self, signal: ControlSignal | None, then: str) -> str:
        """Who stopped this session and why, from the journal's record of the intent."""
        assert self.sup is not None and self.ctx is not None
        controls = await self.sup.journal.controls(self.ctx.delegation_id)
        if not controls:
            return f"tether: this session was stopped ({signal}); {then}"
        last = controls[-1]  # the stop in effect: a terminate after a recall ends it
        try:
            intent = self.sup.keys.trusted.verify(last.signed, ControlIntent)
            if (intent.delegation_id, intent.seq, intent.kind) != (
                    self.ctx.delegation_id, last.seq, last.kind):
                raise TetherError("signed for another delegation or place: a copy")
            reason, who = intent.reason, intent.issued_by or last.issuer
        except TetherError:  # unverified, or a copy: say nothing it claims
            reason, who = "", "an unverified intent"
        verb = "recalled" if last.kind is ControlKind.RECALL else "terminated"
        # One line for the agent to read: what a journal string holds cannot break out of it.
        return (f"tether: this session was {verb} by {_line(who)}: "
                f"{_line(reason) or 'no reason given'}; {then}")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile_cancelled(self, call: Call, tool: Tool, key: str) -> None:
        """A call its client cancelled: cancel it upstream (the SDK sends
        ``notifications/cancelled``), then declare it in doubt and ask its probe."""
        assert self.sup is not None and self.ctx is not None
        sup = self.sup
        await asyncio.sleep(0)  # an action task created just before the cancel starts now
        if call.task is not None and not call.task.done():
            call.task.cancel()
            await asyncio.wait({call.task}, timeout=sup.policy.ack_timeout)
        await sup.journal.flush()
        mine = [a for a in await sup.journal.actions([self.ctx.delegation_id])
                if a.idempotency_key == key]
        for action in mine:
            if action.state is ActionState.PENDING:  # cut before it reached the tool
                await sup.journal.settle_pending(action.id, sup.clock.wall(),
                                                 "its client cancelled the call")
        doubtful = [a for a in await sup.journal.unsettled(self.ctx.delegation_id)
                    if a.idempotency_key == key]
        if doubtful:
            await probe_all(sup.journal, doubtful, {tool.name: tool}, sup.clock,
                            sup.policy.probe_timeout, tolerance=sup.policy.clock_tolerance)
        await sup.journal.flush()

    async def settle_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
