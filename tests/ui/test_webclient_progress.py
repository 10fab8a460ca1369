"""The web client's progress lines: image events' eta_s ("about N s left") and the native SSE's
`event: queued` ("waiting: N ahead", while a request waits for a slot)."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from browser_fixtures import CHROME_ARGS, CHROMIUM

from repo_paths import ARTIFACTS
from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM}")]


def _shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))


def test_web_client_shows_the_image_events_eta() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    image = ScriptedImageModel(steps=30, size=64, delay_s=0.15)
    with make_server(ScriptedTextModel(), image) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        try:
            page = browser.new_page()
            page.goto(srv.url + "/")
            page.check("input[value=image]")
            page.fill("#steps", "30")
            page.evaluate("""() => { window.__statuses = []; new MutationObserver(() => window.__statuses.push(
                  document.querySelector('#status').innerText)).observe(document.querySelector('#status'),
                  {childList: true, subtree: true, characterData: true}); }""")
            page.click("#go")
            page.wait_for_function("() => / left$/.test(document.querySelector('#status').innerText)", timeout=30_000)
            _shot(page, "webclient_image_eta.png")
            page.wait_for_selector("#final", timeout=60_000)
            statuses = page.evaluate("window.__statuses")
            _shot(page, "webclient_image_eta_done.png")
            with_eta = [s for s in statuses if s.startswith("step ") and " left" in s]
            assert with_eta, statuses
            assert page.evaluate("window.__ms.serverEtas") >= 3  # the events' own eta_s, not the page's guess
        finally:
            browser.close()


def test_web_client_says_how_many_are_ahead_while_queued() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    # The two streams before the page's run until the page has shown its place (however long a
    # busy machine takes to start Chromium), then hang up: half a second later that frees the slot.
    text = ScriptedTextModel([f" w{i}" for i in range(400)], delay_s=0.05)
    with make_server(text, ScriptedImageModel(steps=2), text_concurrency=1, grace_period_s=0.5) as srv, \
            sync_api.sync_playwright() as pw:
        started = threading.Barrier(3)
        release = threading.Event()

        def occupy() -> None:
            with httpx.stream("POST", srv.url + "/v1/text", json={"prompt": "x", "max_new_tokens": 400},
                              timeout=120) as r:
                assert r.status_code == 200
                started.wait(30)
                for _ in r.iter_lines():
                    if release.is_set():
                        break

        threads = [threading.Thread(target=occupy, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait(30)  # one runs, one waits in the queue
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        try:
            page = browser.new_page()
            page.goto(srv.url + "/")
            page.fill("#max-tokens", "5")
            page.click("#go")
            page.wait_for_function("() => document.querySelector('#status').innerText.startsWith('waiting: 1 ahead')",
                                   timeout=30_000)
            assert page.evaluate("window.__ms.queued.position") == 2
            _shot(page, "webclient_queued.png")
            release.set()  # the two before it hang up, then it runs
            page.wait_for_selector("#final", timeout=60_000)
            assert page.inner_text("#status").startswith("done")
        finally:
            release.set()
            browser.close()
            for t in threads:
                t.join(30)
