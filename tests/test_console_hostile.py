"""The console's server against what an agent, a tool or a probe may put in the journal, on
SQLite and PostgreSQL: every view renders (never a 500) and shows journal strings as text;
and how the console is reached (a loopback address other than 127.0.0.1)."""

from __future__ import annotations

import json
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

import tether
from tether._console.server import Console, build
from tether._core.model import ActionState, Effect
from tether._journal.rows import NewAction, NewDelegation

from .console_helpers import INJECTION
from .test_operator_cli import invoke

TOKEN = "t" * 24
HEADERS = {"X-Tether-Token": TOKEN}


class _Tags(HTMLParser):
    """The elements and handlers a view's HTML would create if a journal string got through."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[object] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("img", "script", "iframe", "object", "embed", "style", "base", "meta"):
            self.bad.append(tag)
        for name, v in attrs:
            if name.startswith("on") or name in ("style", "srcdoc"):
                self.bad.append((tag, name))
            if name in ("href", "data-redirect", "data-post", "data-nav") and v \
                    and not v.startswith(("/", "#")):
                self.bad.append((tag, name, v))


async def _hostile(url: str) -> tuple[str, str]:
    """A delegation whose call was left UNKNOWN, its arguments, result and evidence holding
    HTML and numbers named like moments (``*_at``) that no calendar shows."""
    now = time.time()
    far = {"retry_at": 1e300, "not_before_at": -1e300, "expires_at": 10.0 ** 20, "note": INJECTION}
    async with tether.Journal(url) as j:
        ring = tether.KeyRing.load_or_init(j.keys_dir)
        await j.genesis(ring.signer, now)
        j.seal_with(ring.signer, ring.trusted)
        await j.create_delegation(NewDelegation(
            id="d_hostile", task_id="t_hostile", parent_id=None, attempt=1, agent=INJECTION,
            surface=("pay",), args=far, owner_id="o_hostile", now=now))
        await j.begin_action(NewAction(
            id="a_hostile", delegation_id="d_hostile", epoch=0, ordinal=0, tool="pay",
            effect=Effect.EXTERNAL, args_json=json.dumps(far), args_hash="h", idem_key=INJECTION,
            now=now, deadline_at=now + 30))
        await j.begin_action(NewAction(
            id="a_done", delegation_id="d_hostile", epoch=0, ordinal=1, tool="pay",
            effect=Effect.EXTERNAL, args_json="{}", args_hash="h2", idem_key="k2",
            now=now, deadline_at=now + 30))
        j.finish_action("a_done", ActionState.COMPLETED, now, far)
        await j.begin_action(NewAction(
            id="a_100%<b>", delegation_id="d_hostile", epoch=0, ordinal=2, tool="pay",
            effect=Effect.EXTERNAL, args_json="{}", args_hash="h3", idem_key="k3",
            now=now, deadline_at=now + 30))
        await j.flush()
        assert await j.settle_pending("a_hostile", now, "its owner went away")
        await j.settle_action("a_hostile", ActionState.UNKNOWN, now,
                              {**far, "reason": INJECTION, "probed_at": now})
        await j.flush()
    return "d_hostile", "a_hostile"


async def test_every_view_renders_what_an_agent_wrote(journal_url: str) -> None:
    """A number an agent passed as ``retry_at`` (1e300) once made the queue and the
    delegation's page a 500 (``time.gmtime`` overflowed): exactly the call a person must
    decide became the one nobody could see."""
    from httpx import ASGITransport, AsyncClient

    delegation, action = await _hostile(journal_url)
    app = build(Console(journal_url, None, TOKEN))
    views = ["/api/view/", "/api/view/delegations", "/api/view/actions",
             f"/api/view/d/{quote(delegation, safe='')}",
             "/api/view/actions?q=" + quote(INJECTION)]
    async with app.router.lifespan_context(app), AsyncClient(
            transport=ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        shown: dict[str, Any] = {}
        for path in views:
            r = await client.get(path, headers=HEADERS)
            assert r.status_code == 200, (path, r.text[:500])
            tags = _Tags()
            tags.feed(r.text)
            assert tags.bad == [], (path, tags.bad)
            shown[path] = r.text
    assert f'data-testid="item-{action}"' in shown["/api/view/"]
    page = shown[views[3]]
    assert "1e+300" in page and "&lt;script&gt;" in page
    # A link to a call on its delegation's page names it in the fragment percent-encoded
    # (the page decodes it; a bare "%" there once made decodeURIComponent throw).
    assert 'href="/d/d_hostile#a_100%25%3Cb%3E"' in shown["/api/view/actions"]


def test_the_console_on_another_loopback_address_serves_its_own_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host 127.0.0.2`` is loopback (no warning), and the link it prints names that
    address: the host check once refused every request to it (it knew 127.0.0.1 only)."""
    import asyncio

    import uvicorn
    from starlette.testclient import TestClient

    from .operator_world import stuck_payment

    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    apps: list[Any] = []

    def run(self: uvicorn.Server, sockets: Any = None) -> None:
        apps.append(self.config.app)
        for sock in sockets or []:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    code, out, err = invoke("console", "--host", "127.0.0.2", "--port", "0", "--token", TOKEN,
                            "--journal", url)
    assert code == 0 and "warning" not in err, (out, err)
    base = out.strip().removeprefix("tether console: ").split("/?")[0]
    assert base.startswith("http://127.0.0.2:"), out
    with TestClient(apps[0], base_url=base) as client:
        assert client.get("/api/view", headers=HEADERS).status_code == 200
        assert client.get("/api/view", headers={**HEADERS, "Host": "evil.example"}
                          ).status_code == 400


def test_the_queue_says_how_many_held_delegations_it_does_not_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue lists the first HELD delegations held for another reason; past that it once
    stopped without a word (its count said more): now it says how many more, and links them."""
    import asyncio
    import sqlite3

    from starlette.testclient import TestClient

    from tether._console import queue

    db = tmp_path / "j.db"
    url = f"sqlite:///{db}"

    async def world() -> None:
        async with tether.Journal(url) as j:
            ring = tether.KeyRing.load_or_init(j.keys_dir)
            await j.genesis(ring.signer, time.time())
            for i in range(3):
                await j.create_delegation(NewDelegation(
                    id=f"d_held{i}", task_id=f"t_held{i}", parent_id=None, attempt=1,
                    agent="a", surface=(), args={}, owner_id="o", now=100.0 + i))
            await j.flush()

    asyncio.run(world())
    with sqlite3.connect(db) as conn:  # as a receipt contradicting a decision leaves them
        conn.execute("UPDATE delegations SET state = 'NEEDS_ATTENTION'")
    monkeypatch.setattr(queue, "HELD", 2)
    with TestClient(build(Console(url, None, TOKEN)), base_url="http://127.0.0.1") as client:
        r = client.get("/api/view/", headers=HEADERS)
    assert r.status_code == 200, r.text
    assert 'data-testid="attention-count">3<' in r.text
    assert r.text.count('class="held"') == 2
    assert "and 1 more" in r.text and "/delegations?state=NEEDS_ATTENTION" in r.text
