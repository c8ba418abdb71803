"""The console's server: each view's HTML rendered from the journal (the needs-attention queue,
a page per delegation, the lists), JSON reads, a stream of change notices (server-sent events)
whenever the journal changes, and the operator's actions (recall, terminate, resolve) through
the same signed paths as the CLI.

The page is static code and holds no data, at every view's address. Every other request
carries the access token
printed at start in the ``X-Tether-Token`` header (the page reads it once from the printed
link, then takes it out of the address bar and keeps it for the tab; the live stream is read
with fetch so that it can send the header too): never in a cookie, which every port of the
host would be sent, nor in a URL. A cross-site form cannot set the header. On loopback,
requests naming another host are refused (DNS rebinding). Every
response carries a Content-Security-Policy that allows the page's own script and style only,
and no referrer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether._console import delegation as delegation_view
from tether._console import lists, queue
from tether._console.html import problem
from tether._console.page import PAGE, POLICY
from tether._core.errors import TetherError
from tether._core.model import ControlKind, Policy, check_grace
from tether._journal import browse
from tether._journal.journal import Journal
from tether._journal.triage import ActionQuery, DelegationQuery
from tether._runtime.keys import KeyRing
from tether._runtime.logs import logger
from tether._runtime.resolve import operator_of

log = logger("console")
ATTENTION = browse.ATTENTION


@dataclass
class Console:
    journal_url: str
    keys: Path | None
    token: str
    poll: float = 0.25  # how often the stream looks for a change in the journal
    # Who the console signs as (``tether console --by``); None: $TETHER_OPERATOR, else the
    # login name. A request never names someone else: whoever holds the token acts as this.
    operator: str | None = None

    def authorized(self, request: Request) -> bool:
        """The token from the header: never from a cookie (every port of the host would be
        sent it) nor a URL (logs and history keep those)."""
        given = request.headers.get("x-tether-token", "")
        return secrets.compare_digest(given.encode(), self.token.encode())


async def snapshot(j: Journal) -> dict[str, Any]:
    """What the page shows live: the newest delegations and the needs-attention queue."""
    rows = await j.page(DelegationQuery(limit=200))
    held = await j.find_actions(ActionQuery(states=ATTENTION, limit=200))
    return {
        "now": time.time(),
        "delegations": [r.to_json() for r in rows],
        "attention": [{**a.to_json(), "agent": agent, "delegation_state": state}
                      for a, agent, state in held],
    }


def build(console: Console, *, loopback: bool = True, host: str | None = None) -> Starlette:
    """``host``: the loopback address the console listens on, when it is not one of the
    usual names (``--host 127.0.0.2``): the link printed at start names it."""
    journal = Journal(console.journal_url, create=False)
    # Who signs, settled once: a name from the environment that is no readable name is a
    # UserError here, at start, never a failed request later.
    signer = operator_of(console.operator)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await journal.open()
        try:
            yield
        finally:
            await journal.close()

    def guard(request: Request) -> Response | None:
        if not console.authorized(request):
            return JSONResponse({"error": "missing or wrong access token"}, status_code=401)
        return None

    async def page(request: Request) -> Response:
        # The page is code and holds no journal data: it is served to anyone (a reload, after
        # the token left the address bar, must still load); everything it shows comes from
        # the API, which needs the token in a header.
        return HTMLResponse(PAGE)

    async def delegations(request: Request) -> Response:
        return guard(request) or JSONResponse(await snapshot(journal))

    async def shown(delegation_id: str) -> dict[str, Any]:
        """What ``tether show`` reads, verified against the journal's key registry as this
        configuration roots it (a granted operator's key is not one of the pins)."""
        from tether._cli.render import collect

        ring = await asyncio.to_thread(_ring, journal, console.keys)
        return await collect(journal, delegation_id, ring.trusted if ring else None)

    async def delegation(request: Request) -> Response:
        denied = guard(request)
        if denied:
            return denied
        try:
            data = await shown(request.path_params["id"])
        except TetherError as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        return JSONResponse(data)

    async def view(request: Request) -> Response:
        """One view's HTML, for the page to put in place (never a whole document)."""
        denied = guard(request)
        if denied:
            return denied
        path = request.path_params.get("path", "")
        params = {k: v for k, v in request.query_params.items()}
        now = time.time()
        try:
            if path in ("", "/"):
                html = await queue.render(journal, params, now)
            elif path == "delegations":
                html = await lists.delegations(journal, params, now)
            elif path == "actions":
                html = await lists.actions(journal, params, now)
            elif path.startswith("d/"):
                me = path[2:]
                data = await shown(me)
                html = delegation_view.render(
                    data, me, await delegation_view.lineage(journal, me), now,
                    journal.clock_tolerance, await journal.get(me))
            else:
                return HTMLResponse(problem(f"no view at /{path}"), status_code=404)
        except TetherError as exc:
            return HTMLResponse("<h1>Not shown</h1>" + problem(str(exc)), status_code=404)
        return HTMLResponse(html)

    async def stream(request: Request) -> Response:
        denied = guard(request)
        if denied:
            return denied

        async def events() -> AsyncIterator[dict[str, Any]]:
            # A notice, not the data: the page re-reads the view it shows.
            seen: int | None = None
            while True:
                version = await journal.last_event_id()
                if version != seen:
                    seen = version
                    count = await journal.peek(browse.attention_count)
                    yield {"event": "change",
                           "data": _dumps({"version": version, "attention": count})}
                await asyncio.sleep(console.poll)

        return EventSourceResponse(events(), ping=15)

    async def control(request: Request) -> Response:
        from tether._runtime.control import ControlRequest, send_control

        denied = guard(request) or _actions_only(request)
        if denied:
            return denied
        body = await _json(request)
        kind = ControlKind.RECALL if request.path_params["verb"] == "recall" \
            else ControlKind.TERMINATE
        if "by" in body:
            return _not_by(signer)
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            # The intent carries the operator's words for whoever audits it, never a stock
            # phrase.
            return JSONResponse({"error": f"a {kind.value.lower()} needs a reason: say why"},
                                status_code=400)
        try:
            grace = None
            if kind is ControlKind.RECALL:
                given = body.get("grace", 30.0)
                try:
                    if isinstance(given, bool) or not isinstance(given, int | float):
                        raise TypeError
                    seconds = float(given)
                except (TypeError, OverflowError):  # OverflowError: an int past any float
                    return JSONResponse({"error": "grace takes a number of seconds"},
                                        status_code=400)
                grace = check_grace(seconds, Policy())
            answer = await send_control(ControlRequest(
                console.journal_url, console.keys, request.path_params["id"], kind, grace,
                reason.strip(), signer, via="console"))
        except (TetherError, ValueError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        log.info("%s accepted for %s from the console (%s)", kind.value, answer["delegation"],
                 answer["issuer"], extra={"delegation": answer["delegation"],
                                          "kind": kind.value, "issuer": answer["issuer"]})
        return JSONResponse(answer)

    async def resolve(request: Request) -> Response:
        from tether._runtime.resolve import resolve as record

        denied = guard(request) or _actions_only(request)
        if denied:
            return denied
        body = await _json(request)
        if "by" in body:
            return _not_by(signer)
        outcome, note = body.get("outcome", ""), body.get("note", "")
        for name, value in (("outcome", outcome), ("note", note)):
            if not isinstance(value, str):
                return JSONResponse({"error": f"{name} takes a string"}, status_code=400)
        try:
            ring = await asyncio.to_thread(KeyRing.load, console.keys or journal.keys_dir)
            action = await record(journal, ring, request.path_params["id"], outcome.upper(),
                                  note, signer, time.time())
        except TetherError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"action": action.to_json()})

    routes = [
        *(Route(path, page) for path in ("/", "/d/{id:path}", "/delegations", "/actions")),
        Route("/favicon.ico", lambda _: Response(status_code=204)),  # none, and no 404 logged
        Route("/api/view", view),
        Route("/api/view/{path:path}", view),
        Route("/api/delegations", delegations),
        Route("/api/delegations/{id}", delegation),
        Route("/api/stream", stream),
        Route("/api/delegations/{id}/{verb:str}", control, methods=["POST"]),
        Route("/api/actions/{id}/resolve", resolve, methods=["POST"]),
    ]
    # On loopback, a request naming any other host is a DNS-rebinding attempt: refused.
    hosts = ["127.0.0.1", "localhost", "[::1]", "::1"] if loopback else ["*"]
    if loopback and host:
        hosts.append(f"[{host.lower()}]" if ":" in host else host.lower())
    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts),
                                 Middleware(_Headers)])


def _not_by(who: str) -> Response:
    return JSONResponse({"error": f"the console signs as its operator ({who}); a request "
                         "cannot name another (start the console with --by NAME)"},
                        status_code=400)


HEADERS = [(b"content-security-policy", POLICY.encode()), (b"referrer-policy", b"no-referrer"),
           (b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-store")]


class _Headers:
    """Every response: the page's script and style only, no referrer (the first load's
    address holds the token), nothing cached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)


def _actions_only(request: Request) -> Response | None:
    """Actions need the header (a cross-site form can send a query string, not a header);
    the query string's token does not stand in for an empty one."""
    if not request.headers.get("x-tether-token"):
        return JSONResponse({"error": "actions need the X-Tether-Token header"}, status_code=401)
    if request.path_params.get("verb", "recall") not in ("recall", "terminate"):
        return JSONResponse({"error": "unknown action"}, status_code=404)
    return None


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return {}
    return body if isinstance(body, dict) else {}


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value, default=str)


def _ring(journal: Journal, keys: Path | None) -> KeyRing | None:
    directory = keys or journal.keys_dir
    return KeyRing.load(directory) if (directory / "signing.json").exists() else None
