"""The static web client in headless Chromium: streamed text, changing previews, and recovery
from a connection the server cuts (through the test-only drop hook)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM}"),
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
TOKENS = [f" word{i}" for i in range(40)]


def test_web_client_streams_text_and_previews_and_recovers() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    text = ScriptedTextModel(TOKENS, delay_s=0.08)
    image = ScriptedImageModel(steps=12, size=64, delay_s=0.15)
    with make_server(text, image, enable_test_hooks=True, grace_period_s=30) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 720})
            page.goto(srv.url + "/")
            page.fill("#amount", "40")
            page.click("#go")
            # Text streams in: some words are on the page before the end.
            page.wait_for_function("() => window.__ms.text.length > 0 && !window.__ms.finalEvent", timeout=30_000)
            shown = page.inner_text("#output")
            page.wait_for_function("() => document.querySelector('#output').textContent.length > 0", timeout=30_000)
            assert len(shown) < len("".join(TOKENS))
            # Cut every live connection; the client must resume with its last event id.
            page.wait_for_function("() => window.__ms.lastSeq >= 3", timeout=30_000)
            assert httpx.post(srv.url + "/v1/_test/drop", timeout=10).json()["dropped_streams"] == 1
            page.wait_for_function("() => window.__ms.finalEvent !== null", timeout=60_000)
            state = page.evaluate("window.__ms")
            assert state["reconnects"] >= 1
            assert state["seqs"] == list(range(len(state["seqs"])))  # no gap, no duplicate
            assert state["text"] == "".join(TOKENS) == state["finalEvent"]["text"]
            page.wait_for_selector("#final", timeout=10_000)
            assert page.inner_text("#output") == "".join(TOKENS)
            assert "is_final" in page.inner_text("#status")

            # Image: the preview changes with the steps.
            page.check("input[value=image]")
            page.fill("#amount", "12")
            page.evaluate("""() => { window.__srcs = new Set();
                new MutationObserver(() => window.__srcs.add(document.querySelector('#preview').src))
                  .observe(document.querySelector('#preview'), {attributes: true}); }""")
            page.click("#go")
            page.wait_for_function("() => window.__ms.finalEvent !== null && window.__ms.finalEvent.type === 'image'",
                                   timeout=60_000)
            page.wait_for_selector("#final", timeout=10_000)
            distinct = page.evaluate("window.__srcs.size")
            assert distinct >= 3, distinct
            assert page.evaluate("document.querySelector('#preview').naturalWidth") == 64
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "webclient.png"), full_page=True)
        finally:
            browser.close()


ASTRAL = ["a😀", " b𝄞", " ç", " d😀😀", " e", " f", " g", " h"] * 4


def _launch(pw):  # type: ignore[no-untyped-def]
    return pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"])


def test_web_client_applies_rewinds_by_code_point_and_finishes_images() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    text = ScriptedTextModel(ASTRAL, delay_s=0.08)
    image = ScriptedImageModel(steps=40, size=64, delay_s=0.1)
    with make_server(text, image) as srv, sync_api.sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 720})
            page.goto(srv.url + "/")
            page.fill("#amount", "30")
            page.click("#go")
            page.wait_for_function("() => window.__ms.lastSeq >= 5", timeout=30_000)
            sid, token = page.evaluate("[window.__ms.streamId, window.__ms.token]")
            # Offset 5 in code points is just after "a😀 b𝄞" (UTF-16 would put it inside the clef).
            resp = httpx.post(f"{srv.url}/v1/streams/{sid}/rewind", json={"offset": 5},
                              headers={"X-Resume-Token": token}, timeout=10)
            assert resp.status_code == 200, resp.text
            page.wait_for_function("() => window.__ms.finalEvent !== null", timeout=60_000)
            state = page.evaluate("window.__ms")
            final = state["finalEvent"]
            assert final["revisions"][0]["offset"] == 5 and final["text"].startswith("a😀 b𝄞")
            assert state["text"] == final["text"] and state["revision"] == 1
            page.wait_for_selector("#final", timeout=10_000)
            assert page.inner_text("#output") == final["text"]
            assert "revision 1" in page.inner_text("#status")
            assert page.is_disabled("#finish")

            # Image: "Use this" stops now and keeps the picture (finish_reason finished_early).
            page.check("input[value=image]")
            page.fill("#amount", "40")
            page.click("#go")
            page.wait_for_function("() => window.__ms.frames >= 3", timeout=30_000)
            assert not page.is_disabled("#finish")
            page.click("#finish")
            page.wait_for_function("() => window.__ms.finalEvent !== null", timeout=30_000)
            final = page.evaluate("window.__ms.finalEvent")
            assert final["finish_reason"] == "finished_early" and final["step"] < 40
            page.wait_for_selector("#final", timeout=10_000)
            assert "finished_early" in page.inner_text("#status")
        finally:
            browser.close()
