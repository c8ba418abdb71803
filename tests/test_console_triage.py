"""The console as a triage tool, in Chromium at 1280 px on a journal of 500 delegations: the
queue finds the calls nobody could settle, oldest first, each with its arguments, result, key
and evidence, and records a person's decision only with an outcome chosen and a note; a
recall or terminate asks for the operator's reason; the lists filter by state, agent, tool,
time and id, and page through everything. Each decision is checked in the journal."""

from __future__ import annotations

import asyncio
import calendar
import time
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, expect

import tether
from tether._console.server import Console, build

from .console_helpers import Served, open_page, serve, stop
from .console_helpers import chromium as chromium  # the browser fixture
from .console_world import busy_journal

TOKEN = "t" * 24


async def go(page: Page, served: Served, path: str) -> None:
    """Follow a link the operator could have bookmarked, in the same tab."""
    await page.evaluate("p => { history.pushState(null, '', p); "
                        "dispatchEvent(new PopStateEvent('popstate')); }", path)
    await expect(page.locator("body")).to_have_attribute("data-shown", path)


async def test_an_unknown_call_among_500_delegations_is_found_seen_and_resolved(
        tmp_path: Path, browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    busy = await busy_journal(url)
    served = await serve(url)
    try:
        page = await open_page(browser, served)
        await expect(page.get_by_test_id("attention-count")).to_have_text("2")
        items = page.locator("article.item")
        await expect(items).to_have_count(2)
        # Oldest first: the refund left in doubt before the charge.
        await expect(items.nth(0)).to_have_attribute("data-testid", f"item-{busy.old.action}")
        item = page.get_by_test_id(f"item-{busy.old.action}")
        for text in ("refund", "UNKNOWN", busy.old.delegation, "refunder", "order_id", "O-OLD",
                     "cents", "1250", "no result recorded", busy.old.key, "has no probe",
                     "Why a person"):
            await expect(item).to_contain_text(text)
        # The dispatch-deadline rule, where it applies: this call may still land.
        await expect(page.get_by_test_id(f"rule-{busy.old.action}")).to_contain_text(
            "NOT_APPLIED can be recorded only after")
        # Nothing is pre-selected, and a decision needs an outcome and a note.
        for outcome in ("COMPLETED", "NOT_APPLIED"):
            await expect(page.get_by_test_id(f"outcome-{busy.old.action}-{outcome}")
                         ).not_to_be_checked()
        await page.get_by_test_id(f"resolve-{busy.old.action}").click()
        await expect(page.locator("#message")).to_contain_text("choose what happened")
        await page.get_by_test_id(f"outcome-{busy.old.action}-COMPLETED").check()
        await page.get_by_test_id(f"resolve-{busy.old.action}").click()
        await expect(page.locator("#message")).to_contain_text("needs a note")
        async with tether.Journal(url, create=False) as j:
            assert (await j.action(busy.old.action)).state is tether.ActionState.UNKNOWN
        await page.get_by_test_id(f"note-{busy.old.action}").fill("refund rf_9 in the ledger")
        await page.get_by_test_id(f"resolve-{busy.old.action}").click()
        await expect(page.locator("#message")).to_contain_text(
            f"{busy.old.action} is COMPLETED")
        await expect(page.get_by_test_id("attention-count")).to_have_text("1")  # pushed
        await expect(items).to_have_count(1)
        # Found again by its key, from anywhere: its delegation's page shows the decision.
        await page.get_by_test_id("search").fill(busy.old.key)
        await page.get_by_test_id("search").press("Enter")
        await expect(page).to_have_url(f"{served.base}/d/{busy.old.delegation}")
        view = page.get_by_test_id("delegation")
        for text in ("RECONCILED", "refund rf_9 in the ledger", "console operator",
                     "chain verified", "O-OLD"):
            await expect(view).to_contain_text(text)
    finally:
        await stop(served)
    async with tether.Journal(url, create=False) as j:
        action = await j.action(busy.old.action)
        other = await j.action(busy.new.action)
    assert action.state is tether.ActionState.COMPLETED
    assert action.evidence is not None
    assert action.evidence["resolution"]["note"] == "refund rf_9 in the ledger"
    assert other.state is tether.ActionState.UNKNOWN


async def test_recall_and_terminate_ask_for_a_reason(tmp_path: Path, browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    forever = asyncio.Event()

    async def waiter(ctx: tether.Context) -> None:
        await forever.wait()

    async with tether.Supervisor(url) as sup:
        first = await sup.delegate(tether.Agent("waiter", waiter, ()))
        second = await sup.delegate(tether.Agent("waiter", waiter, ()))
        served = await serve(url)
        try:
            page = await open_page(browser, served)
            await go(page, served, f"/d/{first.id}")
            await page.get_by_test_id(f"recall-{first.id}").click()
            await expect(page.locator("#message")).to_contain_text("a recall needs a reason")
            await expect(page.get_by_test_id(f"reason-{first.id}")).to_have_attribute(
                "aria-invalid", "true")
            assert await sup.journal.controls(first.id) == []
            await page.get_by_test_id(f"reason-{first.id}").fill("customer cancelled O-1")
            await page.get_by_test_id(f"recall-{first.id}").click()
            await expect(page.locator("#message")).to_contain_text("RECALL accepted")
            await first.wait()
            # Terminate too: no reason, nothing sent; with one, it is the intent's.
            await go(page, served, f"/d/{second.id}")
            page.on("dialog", lambda d: asyncio.ensure_future(d.accept()))
            await page.get_by_test_id(f"terminate-{second.id}").click()
            await expect(page.locator("#message")).to_contain_text("a terminate needs a reason")
            assert await sup.journal.controls(second.id) == []
            await page.get_by_test_id(f"reason-{second.id}").fill("runaway loop")
            await page.get_by_test_id(f"terminate-{second.id}").click()
            await expect(page.locator("#message")).to_contain_text("TERMINATE accepted")
            await second.wait()
        finally:
            await stop(served)
        recalls = await sup.journal.controls(first.id)
        terminates = await sup.journal.controls(second.id)
    assert [c.kind.value for c in recalls] == ["RECALL"]
    assert b'"reason":"customer cancelled O-1"' in recalls[0].signed.body
    assert [c.kind.value for c in terminates] == ["TERMINATE"]
    assert b'"reason":"runaway loop"' in terminates[0].signed.body
    # Who asked: the console's operator ($TETHER_OPERATOR of the served console), signed in.
    for c in (recalls[0], terminates[0]):
        assert c.issuer == "console:console operator"
        assert b'"by":"console operator"' in c.signed.body


def test_the_server_refuses_a_stop_without_a_reason(tmp_path: Path) -> None:
    """Whatever sends it: an empty or missing reason is refused, and nothing is recorded."""
    from starlette.testclient import TestClient

    url = f"sqlite:///{tmp_path / 'j.db'}"
    busy = asyncio.run(busy_journal(url, n=12))
    running = busy.ids[5]  # every 11th, from the 5th, is still running
    with TestClient(build(Console(url, None, TOKEN)), base_url="http://127.0.0.1") as client:
        for verb, body in (("recall", {}), ("recall", {"reason": "  "}),
                           ("terminate", {"reason": ""}), ("terminate", {"reason": 7})):
            r = client.post(f"/api/delegations/{running}/{verb}", json=body,
                            headers={"X-Tether-Token": TOKEN})
            assert r.status_code == 400 and "needs a reason" in r.json()["error"], r.text
        # Whoever holds the token acts as the console's operator, never as someone they name.
        named: tuple[tuple[str, dict[str, object]], ...] = (
            (f"delegations/{running}/recall", {"reason": "r", "by": "CEO"}),
            (f"delegations/{running}/terminate", {"reason": "r", "by": 7}),
            (f"actions/{busy.ids[0]}/resolve", {"outcome": "COMPLETED", "note": "n", "by": "CEO"}))
        for path, payload in named:
            r = client.post(f"/api/{path}", json=payload, headers={"X-Tether-Token": TOKEN})
            assert r.status_code == 400 and "signs as its operator" in r.json()["error"], r.text

    async def controls() -> list[object]:
        async with tether.Journal(url, create=False) as j:
            return list(await j.controls(running))

    assert asyncio.run(controls()) == []


def test_the_server_refuses_a_grace_outcome_or_note_of_the_wrong_type(tmp_path: Path) -> None:
    """A grace that is no number (true counts as none), an outcome or a note that is no string
    (null is not the note "None"): refused with the field's name, and nothing is recorded."""
    from starlette.testclient import TestClient

    url = f"sqlite:///{tmp_path / 'j.db'}"
    busy = asyncio.run(busy_journal(url, n=12))
    running = busy.ids[5]
    headers = {"X-Tether-Token": TOKEN}
    with TestClient(build(Console(url, None, TOKEN, operator="ada")),
                    base_url="http://127.0.0.1") as client:
        for grace in (True, [5], "30", {"s": 1}, None, int("9" * 400)):
            r = client.post(f"/api/delegations/{running}/recall",
                            json={"reason": "r", "grace": grace}, headers=headers)
            assert r.status_code == 400, r.text
            assert r.json()["error"] == "grace takes a number of seconds", r.text
        for body in ({"outcome": "COMPLETED", "note": None}, {"outcome": "COMPLETED", "note": 7},
                     {"outcome": None, "note": "n"}, {"outcome": ["COMPLETED"], "note": "n"}):
            r = client.post(f"/api/actions/{busy.old.action}/resolve", json=body,
                            headers=headers)
            assert r.status_code == 400 and "takes a string" in r.json()["error"], r.text
        # JSON nested past the parser's depth is no body at all, not a server error.
        deep = "[" * 100_000 + "]" * 100_000
        r = client.post(f"/api/delegations/{running}/recall", content=deep,
                        headers={**headers, "content-type": "application/json"})
        assert r.status_code == 400 and "needs a reason" in r.json()["error"], r.text

    async def recorded() -> tuple[list[object], str]:
        async with tether.Journal(url, create=False) as j:
            action = await j.action(busy.old.action)
            assert action is not None
            return list(await j.controls(running)), action.state.value

    assert asyncio.run(recorded()) == ([], "UNKNOWN")


async def test_filters_and_paging_reach_every_delegation(tmp_path: Path,
                                                         browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    busy = await busy_journal(url)
    async with tether.Journal(url, create=False) as j:
        every = {d.id: d for d in await j.delegations()}
        calls = await j.actions(list(every))
    served = await serve(url)
    try:
        page = await open_page(browser, served)
        await page.get_by_role("link", name="Delegations").click()
        pager = page.get_by_test_id("pager")
        await expect(pager).to_contain_text(f"50 shown of {len(every)}")
        # Walk every page: each delegation once, newest first.
        seen: list[str] = []
        while True:
            rows = page.get_by_test_id("delegations").locator("tbody tr td:first-child")
            seen.extend(await rows.all_inner_texts())
            following = page.get_by_test_id("page-next")
            if not await following.count():
                break
            target = await following.get_attribute("href")
            await following.click()
            await expect(page.locator("body")).to_have_attribute("data-shown", str(target))
        assert sorted(seen) == sorted(every) and len(seen) == len(set(seen))
        newest = sorted(every.values(), key=lambda d: (d.created_at, d.id), reverse=True)
        assert seen == [d.id for d in newest]
        # And back: the previous page is the one before it.
        await page.get_by_test_id("page-prev").click()
        first_row = page.get_by_test_id("delegations").locator("tbody tr td:first-child")
        await expect(first_row.first).to_have_text(seen[(len(seen) - 1) // 50 * 50 - 50])

        # State and agent, through the filter form: the address keeps them.
        await page.get_by_test_id("filter-state").select_option("FAILED")
        await page.get_by_test_id("filter-agent").fill("billing")
        await page.get_by_test_id("filter-apply").click()
        await expect(page).to_have_url(f"{served.base}/delegations?state=FAILED&agent=billing")
        failed = [d for d in every.values()
                  if d.state.value == "FAILED" and d.agent == "billing"]
        await expect(pager).to_contain_text(f"{len(failed)} shown of {len(failed)}")
        cells = page.get_by_test_id("delegations").locator("tbody tr td:first-child")
        assert sorted(await cells.all_inner_texts()) == sorted(d.id for d in failed)

        # Time: created in the last hour of the bulk's day (a UTC time, as typed).
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(busy.base - 3600 + 30))
        cutoff = calendar.timegm(time.strptime(since, "%Y-%m-%d %H:%M:%S"))
        await go(page, served, "/delegations")
        await page.get_by_test_id("filter-since").fill(since)
        await page.get_by_test_id("filter-apply").click()
        recent = [d for d in every.values() if d.created_at >= cutoff]
        await expect(pager).to_contain_text(f"{min(50, len(recent))} shown of {len(recent)}")
        await page.get_by_test_id("filter-since").fill("yesterday-ish")
        await page.get_by_test_id("filter-apply").click()
        await expect(page.get_by_test_id("view")).to_contain_text("neither an age")

        # Actions by tool, and one action found by its id.
        await go(page, served, "/actions?tool=lookup&state=FAILED")
        lookups = [a for a in calls if a.tool == "lookup" and a.state.value == "FAILED"]
        await expect(pager).to_contain_text(f"of {len(lookups)}")
        await expect(page.get_by_test_id("actions")).to_contain_text("card declined")
        one = lookups[0]
        await go(page, served, f"/actions?q={one.id}")
        await expect(pager).to_contain_text("1 shown of 1")
        await expect(page.get_by_test_id("actions")).to_contain_text(one.idempotency_key)

        # The tree: a parent links to its children, a child to its parent.
        await go(page, served, f"/d/{busy.children[0]}")
        tree = page.get_by_test_id("tree")
        await tree.get_by_role("link", name=busy.parent).click()
        await expect(page).to_have_url(f"{served.base}/d/{busy.parent}")
        for kid in busy.children:
            await expect(page.get_by_test_id("tree")).to_contain_text(kid)
    finally:
        await stop(served)


async def test_what_the_operator_types_survives_a_live_refresh(tmp_path: Path,
                                                              browser: Browser) -> None:
    """The journal changes while a decision is half typed, and the view is fetched again: the
    outcome chosen and the note typed while that fetch was on its way are still there."""
    from playwright.async_api import Route

    url = f"sqlite:///{tmp_path / 'j.db'}"
    busy = await busy_journal(url, n=12)
    served = await serve(url)
    held, release = asyncio.Event(), asyncio.Event()

    async def hold(route: Route) -> None:
        held.set()
        await release.wait()
        await route.continue_()

    try:
        page = await open_page(browser, served)
        note = page.get_by_test_id(f"note-{busy.new.action}")
        await note.fill("half")
        await page.route("**/api/view**", hold)
        async with tether.Journal(url, create=False) as j:
            j.event(time.time(), "unrelated", busy.ids[0])
            await j.flush()
        await held.wait()  # the page is fetching its view again
        await page.get_by_test_id(f"outcome-{busy.new.action}-COMPLETED").check()
        await note.fill("half typed while the view was on its way")
        renders = await page.locator("body").get_attribute("data-renders")
        release.set()
        await expect(page.locator("body")).not_to_have_attribute("data-renders", str(renders))
        await expect(note).to_have_value("half typed while the view was on its way")
        await expect(page.get_by_test_id(f"outcome-{busy.new.action}-COMPLETED")
                     ).to_be_checked()
    finally:
        await stop(served)



def test_the_page_names_who_signed_not_the_issuer_column(tmp_path: Path) -> None:
    """Someone with write access to the journal rewrites a recall's issuer column (which no
    signature covers): the delegation's page still names who signed the recall."""
    import sqlite3

    from starlette.testclient import TestClient

    from .operator_world import orphan

    url = f"sqlite:///{tmp_path / 'j.db'}"
    delegation = asyncio.run(orphan(url))
    headers = {"X-Tether-Token": TOKEN}
    with TestClient(build(Console(url, None, TOKEN, operator="Ada Lovelace")),
                    base_url="http://127.0.0.1") as client:
        r = client.post(f"/api/delegations/{delegation}/recall",
                        json={"reason": "refund"}, headers=headers)
        assert r.status_code == 200, r.text
        with sqlite3.connect(tmp_path / "j.db") as db:
            db.execute("UPDATE controls SET issuer = 'cli:Mallory'")
        html = client.get(f"/api/view/d/{delegation}", headers=headers).text
    intents = html[html.index('data-testid="intents"'):]
    intents = intents[:intents.index("</table>")]
    assert "Ada Lovelace" in intents and "Mallory" not in intents, intents


def table_of(html: str, testid: str) -> str:
    part = html[html.index(f'data-testid="{testid}"'):]
    return part[:part.index("</table>")]


def test_a_rewritten_decision_or_intent_is_not_shown_as_signed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With write access to the journal: a decision's event rewritten to name someone else,
    and a recall's body rewritten (its signature no longer verifies). The page and
    ``tether show`` flag the decision UNSIGNED and the name as a claim nobody signed."""
    import sqlite3

    from starlette.testclient import TestClient
    from typer.testing import CliRunner

    from tether._cli.app import app

    from .operator_world import orphan

    url = f"sqlite:///{tmp_path / 'j.db'}"
    busy = asyncio.run(busy_journal(url, n=2))
    running = asyncio.run(orphan(url))
    headers = {"X-Tether-Token": TOKEN}
    with TestClient(build(Console(url, None, TOKEN, operator="Ada Lovelace")),
                    base_url="http://127.0.0.1") as client:
        r = client.post(f"/api/actions/{busy.old.action}/resolve",
                        json={"outcome": "COMPLETED", "note": "bank says paid"},
                        headers=headers)
        assert r.status_code == 200, r.text
        r = client.post(f"/api/delegations/{running}/recall", json={"reason": "r"},
                        headers=headers)
        assert r.status_code == 200, r.text
        page = f"/api/view/d/{busy.old.delegation}"
        before = table_of(client.get(page, headers=headers).text, "decisions")
        assert "Ada Lovelace" in before and "UNSIGNED" not in before, before
        with sqlite3.connect(tmp_path / "j.db") as db:
            db.execute("UPDATE events SET detail = replace(detail, 'Ada Lovelace', "
                       "'Mallory') WHERE kind = 'resolved'")
            db.execute("UPDATE controls SET body = CAST(replace(CAST(body AS TEXT), "
                       "'Ada Lovelace', 'Mallory') AS BLOB)")
        decisions = table_of(client.get(page, headers=headers).text, "decisions")
        assert "Mallory" in decisions and "UNSIGNED" in decisions, decisions
        intents = table_of(client.get(f"/api/view/d/{running}", headers=headers).text,
                           "intents")
        assert "claims Mallory (signature refused)" in intents, intents
    from tether._cli.common import out

    monkeypatch.setattr(out, "width", 250)  # each row of the tables on one line
    shown = CliRunner().invoke(app, ["show", busy.old.delegation, "--journal", url])
    assert "UNSIGNED" in shown.stdout and "Mallory" in shown.stdout, shown.stdout
    shown = CliRunner().invoke(app, ["show", running, "--journal", url])
    assert "claimed by Mallory (unsigned)" in shown.stdout, shown.stdout


def test_a_console_whose_operator_name_is_unreadable_does_not_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Console(operator=None) signs as $TETHER_OPERATOR or the login name: checked when it is
    built, never in the middle of a request."""
    url = f"sqlite:///{tmp_path / 'j.db'}"
    asyncio.run(busy_journal(url, n=2))
    monkeypatch.setenv("TETHER_OPERATOR", "eve\x1b[2J")
    with pytest.raises(tether.errors.UserError, match="TETHER_OPERATOR"):
        build(Console(url, None, TOKEN))
