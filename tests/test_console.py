"""The web console in a real browser (Playwright driving the system's Chromium): recall by
clicking on a delegation's page, the needs-attention queue resolved by clicking, each checked
in the journal; and the access token, host check and HTML injection (tests/test_console_triage.py
has the triage views). Without a browser (the server
in process, the command through the CLI): an action's token is taken from its header only,
signatures are verified as `tether show` and `tether export` verify them, a public address is
warned about, and an unusable host is one error line."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, expect

import tether
from tether._core.model import ActionState

from .console_helpers import INJECTION, open_page, serve, stop
from .console_helpers import chromium as chromium  # the browser fixture
from .operator_world import stuck_payment
from .test_operator_cli import invoke, raw_controls

A = ActionState


async def test_recall_by_clicking_reaches_the_journal(tmp_path: Path, browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    forever = asyncio.Event()

    async def waiter(ctx: tether.Context) -> None:
        await forever.wait()

    async with tether.Supervisor(url) as sup:
        handle = await sup.delegate(tether.Agent("waiter", waiter, ()))
        served = await serve(url)
        try:
            page = await open_page(browser, served)
            await page.get_by_role("link", name="Delegations").click()
            await page.get_by_role("link", name=handle.id).click()
            await expect(page).to_have_url(f"{served.base}/d/{handle.id}")
            view = page.get_by_test_id("delegation")
            await expect(view.locator("h1")).to_contain_text("RUNNING")
            await page.get_by_test_id(f"reason-{handle.id}").fill("order withdrawn")
            await page.get_by_test_id(f"grace-{handle.id}").fill("5")
            await page.get_by_test_id(f"recall-{handle.id}").click()
            await expect(page.locator("#message")).to_contain_text("RECALL accepted")
            await handle.wait()
            report = await handle.report()
            # Pushed to the page, no reload: the delegation shows it settled.
            await expect(view.locator("h1")).to_contain_text("RECALLED")
        finally:
            await stop(served)
        controls = await sup.journal.controls(handle.id)
    assert report.outcome is tether.DelegationState.RECALLED
    assert [(c.kind.value, c.seq) for c in controls] == [("RECALL", 1)]
    # Signed as the CLI signs, naming the console's operator.
    assert controls[0].issuer == "console:console operator"
    assert controls[0].signed.key_id == tether.KeyRing.load(tmp_path / "keys").signer.key_id


async def test_the_needs_attention_queue_resolved_by_clicking(tmp_path: Path,
                                                              browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = await stuck_payment(url, agent=INJECTION)
    served = await serve(url)
    try:
        page = await open_page(browser, served)
        queue = page.get_by_test_id("queue")
        await expect(queue).to_contain_text(stuck.action)
        await expect(queue).to_contain_text(stuck.key)
        # Journal strings are text, never markup: shown as typed, nothing runs.
        await expect(queue).to_contain_text(INJECTION)
        assert await page.evaluate("window.pwned") is None
        await page.get_by_test_id(f"outcome-{stuck.action}-COMPLETED").check()
        await page.get_by_test_id(f"note-{stuck.action}").fill("provider shows ch_77")
        await page.get_by_test_id(f"resolve-{stuck.action}").click()
        await expect(page.locator("#message")).to_contain_text("recorded")
        await expect(page.get_by_test_id("attention-count")).to_have_text("0")
        await page.get_by_role("link", name="Delegations").click()
        await page.get_by_role("link", name=stuck.delegation).click()
        view = page.get_by_test_id("delegation")
        await expect(view).to_contain_text("console operator")
        await expect(view).to_contain_text("provider shows ch_77")
        await expect(view).to_contain_text(INJECTION)  # its page too: text, never markup
        await page.get_by_role("link", name="Delegations").click()
        await expect(page.get_by_test_id("delegations")).to_contain_text(INJECTION)
        assert await page.evaluate("window.pwned") is None
    finally:
        await stop(served)
    async with tether.Journal(url, create=False) as j:
        action = await j.action(stuck.action)
        row = await j.get(stuck.delegation)
    assert action.state is tether.ActionState.COMPLETED
    assert action.evidence is not None
    assert action.evidence["resolution"]["operator"] == "console operator"
    assert row.state is tether.DelegationState.RECONCILED


async def test_the_token_and_the_host_are_checked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = await stuck_payment(url)
    served = await serve(url)

    def fetch(path: str, headers: dict[str, str] | None = None,
              data: bytes | None = None) -> int:
        request = urllib.request.Request(served.base + path, data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    token = served.url.split("token=")[1]
    try:
        assert await asyncio.to_thread(fetch, "/api/delegations") == 401
        assert await asyncio.to_thread(fetch, "/api/delegations",
                                       {"X-Tether-Token": "wrong"}) == 401
        assert await asyncio.to_thread(fetch, "/api/delegations",
                                       {"X-Tether-Token": token}) == 200
        assert await asyncio.to_thread(fetch, f"/api/delegations?token={token}") == 401
        assert await asyncio.to_thread(fetch, f"/?token={token}",
                                       {"Host": "attacker.example"}) == 400
        # An action with the token in the query string only (what a cross-site form could
        # send) is refused, and changes nothing.
        assert await asyncio.to_thread(
            fetch, f"/api/actions/{stuck.action}/resolve?token={token}",
            {"Content-Type": "application/json"},
            b'{"outcome": "COMPLETED", "note": "forged"}') == 401
    finally:
        await stop(served)
    async with tether.Journal(url, create=False) as j:
        assert (await j.action(stuck.action)).state is tether.ActionState.UNKNOWN


async def test_the_operators_story_in_the_browser(tmp_path: Path, browser: Browser) -> None:
    """500 live delegations, one payment out: recall it by clicking, find it in the queue
    UNKNOWN, resolve it by clicking, read the trail; the journal agrees."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    quiet, charging = asyncio.Event(), asyncio.Event()

    @tether.tool(dispatch_deadline=10.0)  # no probe: the provider cannot be asked
    async def charge(order_id: str, *, idempotency_key: str) -> str:
        charging.set()
        await asyncio.Event().wait()
        return "never"

    @tether.agent(tools=[charge])
    async def billing(ctx: tether.Context, order_id: str) -> None:
        if order_id == "PAY":
            await ctx.call(charge, order_id=order_id)
        await quiet.wait()

    async with tether.Supervisor(url, tools=[charge]) as sup:
        for i in range(499):
            await sup.delegate(billing, f"O-{i}")
        payer = await sup.delegate(billing, "PAY")
        await charging.wait()
        served = await serve(url)
        try:
            page = await open_page(browser, served)
            await page.get_by_test_id("search").fill(payer.id)
            await page.get_by_test_id("search").press("Enter")
            await expect(page).to_have_url(f"{served.base}/d/{payer.id}")
            await page.get_by_test_id(f"reason-{payer.id}").fill("order PAY withdrawn")
            await page.get_by_test_id(f"grace-{payer.id}").fill("0.5")
            await page.get_by_test_id(f"recall-{payer.id}").click()
            await payer.wait()
            (action,) = (await payer.report()).actions
            await page.get_by_role("link", name="Needs attention").click()
            queue = page.get_by_test_id("queue")
            await expect(queue).to_contain_text(action.id)
            await expect(page.get_by_test_id("attention-count")).to_have_text("1")
            await page.get_by_test_id(f"outcome-{action.id}-COMPLETED").check()
            await page.get_by_test_id(f"note-{action.id}").fill("bank statement: ch_5 paid")
            await page.get_by_test_id(f"resolve-{action.id}").click()
            await expect(page.get_by_test_id("attention-count")).to_have_text("0")
            await page.get_by_test_id("search").fill(action.idempotency_key)
            await page.get_by_test_id("search").press("Enter")
            detail = page.get_by_test_id("delegation")
            for text in ("RECALL", "order PAY withdrawn", "verified", "UNKNOWN → COMPLETED",
                         "console operator", "bank statement: ch_5 paid",
                         action.idempotency_key):
                await expect(detail).to_contain_text(text)
        finally:
            await stop(served)
        row = await sup.journal.get(payer.id)
        live = await sup.journal.delegations(live_only=True)
        quiet.set()
    assert row.state is tether.DelegationState.RECONCILED
    assert len(live) == 499


# -- without a browser: the server's own checks, and the command ----------------------------------

def _client(url: str, keys: Path | None = None) -> Any:
    from starlette.testclient import TestClient

    from tether._console.server import Console, build

    app_ = build(Console(url, keys, "t" * 24))
    return TestClient(app_, base_url="http://127.0.0.1")


def test_console_actions_take_the_token_from_the_header_only(tmp_path: Path) -> None:
    """Actions need the token in X-Tether-Token; an empty header with the token in the query
    string (what a page that learnt the URL could send) must not pass for it."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    with _client(url) as client:
        r = client.post(f"/api/actions/{stuck.action}/resolve?token={'t' * 24}",
                        headers={"X-Tether-Token": ""},
                        json={"outcome": "COMPLETED", "note": "forged", "by": "Mallory"})
        assert r.status_code == 401, r.text
        r = client.post(f"/api/delegations/{stuck.delegation}/terminate?token={'t' * 24}",
                        headers={"X-Tether-Token": ""}, json={"reason": "forged"})
        assert r.status_code == 401, r.text

    async def state() -> ActionState:
        async with tether.Journal(url, create=False) as j:
            return (await j.action(stuck.action)).state

    assert asyncio.run(state()) is A.UNKNOWN


def test_console_and_export_verify_signatures_as_tether_show_does(tmp_path: Path) -> None:
    """A decision signed by an operator the registry trusts (granted by the root) is
    'verified' in ``tether show``; the console must not call it REFUSED because the key is
    not one of its configuration's pinned roots."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    root = tether.KeyRing.load(tmp_path / "keys")
    ada = tmp_path / "ada"
    assert invoke("keys", "init", "--keys", str(ada), "--journal", url)[0] == 0
    public = json.loads(invoke("keys", "show", "--keys", str(ada), "--journal", url,
                               "--json")[1])["public"]
    assert invoke("keys", "trust", public, "--journal", url)[0] == 0
    assert invoke("keys", "pin", root.signer.public_b64(), "--keys", str(ada),
                  "--journal", url)[0] == 0
    code, out, err = invoke("resolve", stuck.action, "--as", "COMPLETED", "--note", "paid",
                            "--by", "Ada", "--keys", str(ada), "--journal", url)
    assert code == 0, (out, err)
    shown = json.loads(invoke("show", stuck.delegation, "--journal", url, "--json")[1])
    with _client(url) as client:
        r = client.get(f"/api/delegations/{stuck.delegation}",
                       headers={"X-Tether-Token": "t" * 24})
        assert r.status_code == 200, r.text
        served = r.json()
    verdicts = [(i["kind"], i["verified"]) for i in shown["intents"]]
    assert ("RESOLUTION", "ok") in verdicts
    assert [(i["kind"], i["verified"]) for i in served["intents"]] == verdicts
    # And so does tether export (the archive prune writes is the same).
    code, out, _ = invoke("export", "--journal", url)
    assert code == 0
    signed = [r for r in map(json.loads, out.splitlines()) if "signature" in r]
    assert len(signed) == len(verdicts) and all(r["verified"] == "ok" for r in signed), signed


def test_console_on_a_public_address_warns(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host 0.0.0.0`` serves the journal and its buttons to the network over plain HTTP,
    the token in the URL: said on stderr at start, not only in --help."""
    import uvicorn

    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    ran: list[Any] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.append(sockets))
    code, out, err = invoke("console", "--host", "0.0.0.0", "--port", "0", "--journal", url)
    assert code == 0 and ran, (out, err)
    for socks in ran:
        for sock in socks:
            sock.close()
    assert "warning:" in err and "0.0.0.0" in err, err
    code, out, err = invoke("console", "--host", "127.0.0.1", "--port", "0", "--journal", url)
    for socks in ran[1:]:
        for sock in socks:
            sock.close()
    assert code == 0 and "warning" not in err, err


@pytest.mark.parametrize("host", ["bad\x00host", "\u202ehost[/bold]"])
def test_console_with_an_unusable_host_is_one_error_line(tmp_path: Path, host: str) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(stuck_payment(url))
    code, out, err = invoke("console", "--host", host, "--port", "0", "--journal", url)
    assert code == 2 and out == "" and err.startswith("error:"), (code, out, err)
    assert len(err.strip().splitlines()) == 1 and raw_controls(err) == []


def test_the_token_rides_only_a_header_and_every_response_is_locked_down(
        tmp_path: Path) -> None:
    """No cookie (every port of the host would be sent it) and no URL carries the token past
    the printed link: reads and the stream take it from the header alone; every response
    allows only the page's own script and style and sends no referrer."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    stuck = asyncio.run(stuck_payment(url))
    token = "t" * 24
    with _client(url) as client:
        first = client.get("/", params={"token": token})
        assert first.status_code == 200 and "set-cookie" not in first.headers
        policy = first.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
        assert "'unsafe-inline'" not in policy and "script-src 'sha256-" in policy
        assert first.headers["referrer-policy"] == "no-referrer"
        for path in ("/api/delegations", "/api/stream", "/api/view", "/api/view/delegations",
                     "/api/view/actions", f"/api/view/d/{stuck.delegation}"):
            assert client.get(path, params={"token": token}).status_code == 401
            assert client.get(path).status_code == 401
        reads = client.get("/api/delegations", headers={"X-Tether-Token": token})
        assert reads.status_code == 200, reads.text
        assert reads.headers["referrer-policy"] == "no-referrer"
