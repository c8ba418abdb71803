"""The console in a real browser: the system's Chromium driven by Playwright, and a
``tether console`` started on a journal, as an operator starts it."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

ROOT = Path(__file__).resolve().parent.parent

CHROMIUM = os.environ.get("TETHER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FOUND = Path(CHROMIUM).exists()
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update",
         "--disable-default-apps", "--disable-sync", "--no-first-run", "--mute-audio"]
INJECTION = "<b>bold</b><img src=x onerror=\"window.pwned=1\"><script>window.pwned=2</script>"


@dataclass
class Served:
    url: str
    base: str
    proc: asyncio.subprocess.Process


@pytest.fixture(name="browser")
async def chromium() -> AsyncIterator[Browser]:
    assert CHROMIUM_FOUND, (
        f"no Chromium at {CHROMIUM}: scripts/test installs it (or set TETHER_CHROMIUM)")
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield b
        finally:
            await b.close()


async def serve(url: str) -> Served:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether", "console", "--port", "0", "--journal", url,
        cwd=ROOT, env={**os.environ, "TETHER_OPERATOR": "console operator"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
    assert line.startswith("tether console: http://127.0.0.1:"), line
    address = line.removeprefix("tether console: ")
    return Served(address, address.split("/?")[0], proc)


async def stop(served: Served) -> None:
    served.proc.terminate()
    await served.proc.wait()


async def open_page(browser: Browser, served: Served) -> Page:
    page = await browser.new_page(viewport={"width": 1280, "height": 800})
    refused: list[str] = []  # what the Content-Security-Policy blocked, if anything
    page.on("console", lambda m: refused.append(m.text)
            if "Content Security Policy" in m.text else None)
    await page.goto(served.url)
    await expect(page.locator("#status")).to_contain_text("live")
    # The token leaves the address bar (and the history) once the page has it.
    assert "token" not in page.url, page.url
    assert refused == [], refused
    return page


