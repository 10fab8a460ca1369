"""The static web client in headless Chromium: streamed text, changing previews, and recovery
from a connection the server cuts (through the test-only drop hook)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from browser_fixtures import CHROMIUM

from repo_paths import ARTIFACTS
from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM}"),
]
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
            page.fill("#max-tokens", "40")
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
            assert page.inner_text("#status").startswith("done")

            # Image: the preview changes with the steps.
            page.check("input[value=image]")
            page.fill("#steps", "12")
            assert page.locator("#output").inner_text() == ""  # the text answer went with its mode
            page.evaluate("""() => { window.__srcs = new Set();
                new MutationObserver(() => { const img = document.querySelector('#preview');
                                             if (img) window.__srcs.add(img.src); })
                  .observe(document.querySelector('#frame'), {attributes: true, childList: true, subtree: true}); }""")
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
            page.fill("#max-tokens", "30")
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
            assert not page.is_visible("#finish")  # "Use this" keeps a picture: not shown for text

            # Image: "Use this" stops now and keeps the picture (finish_reason finished_early).
            page.check("input[value=image]")
            page.fill("#steps", "40")
            page.click("#go")
            page.wait_for_function("() => window.__ms.frames >= 3", timeout=30_000)
            assert not page.is_disabled("#finish")
            page.click("#finish")
            page.wait_for_function("() => window.__ms.finalEvent !== null", timeout=30_000)
            final = page.evaluate("window.__ms.finalEvent")
            assert final["finish_reason"] == "finished_early" and final["step"] < 40
            page.wait_for_selector("#final", timeout=10_000)
            assert page.inner_text("#status").startswith("stopped early")
        finally:
            browser.close()


def _shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_web_client_keeps_text_image_and_speech_apart_and_says_what_happens() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    text = ScriptedTextModel(TOKENS, delay_s=0.08)
    image = ScriptedImageModel(steps=20, size=64, delay_s=0.12)
    with make_server(text, image) as srv, sync_api.sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 720})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(f"{m.text} {m.location}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(srv.url + "/")
            # Text mode: its own limit, no picture anywhere, no "Use this".
            assert page.locator("img").count() == 0
            assert page.is_visible("#max-tokens") and not page.is_visible("#steps")
            assert not page.is_visible("#finish")
            page.fill("#max-tokens", "25")
            page.click("#go")
            page.wait_for_function("() => window.__ms.textTokens >= 4 && !window.__ms.finalEvent", timeout=30_000)
            page.wait_for_function("() => document.querySelector('#status').innerText.includes('tokens/s')",
                                   timeout=30_000)
            live = page.inner_text("#status")
            assert live.startswith("writing") and "TTFT" in live and "tokens/s" in live, live
            page.wait_for_selector("#final", timeout=60_000)
            assert text.calls[-1]["max_new_tokens"] == 25
            status = page.inner_text("#status")
            # e.g. "done (reached the token limit) · 25 tokens in 2.1 s · 12.0 tokens/s · TTFT 80 ms"
            assert status.startswith("done (reached the token limit) · 25 tokens in ")
            assert "tokens/s · TTFT " in status and status.endswith(" ms"), status
            for jargon in ("seq", "is_final", "✓", "stream "):
                assert jargon not in status, status
            assert page.locator("img").count() == 0  # no broken picture under a text answer
            _shot(page, "webclient_text.png")

            # Image mode: the text goes, its own steps box, "Use this", a picture and the time left.
            page.check("input[value=image]")
            assert page.inner_text("#output") == "" and not page.is_visible("#output")
            assert page.inner_text("#status") == "idle"
            assert page.is_visible("#steps") and not page.is_visible("#max-tokens")
            assert page.is_visible("#finish")
            assert page.input_value("#max-tokens") == "25"  # the text limit is kept for when text comes back
            page.fill("#steps", "20")
            page.click("#go")
            page.wait_for_function("() => /^step \\d+\\/20 · about .* left$/.test("
                                   "document.querySelector('#status').innerText)", timeout=30_000)
            _shot(page, "webclient_image_running.png")
            page.wait_for_selector("#final", timeout=60_000)
            assert image.calls[-1]["steps"] == 20
            status = page.inner_text("#status")
            assert status.startswith("done · 20 steps in ") and status.endswith("64×64 PNG"), status
            assert page.evaluate("document.querySelector('#preview').naturalWidth") == 64
            _shot(page, "webclient_image.png")

            # Back to text: the picture goes with its mode.
            page.check("input[value=text]")
            assert page.locator("img").count() == 0 and page.inner_text("#output") == ""
            assert page.input_value("#prompt") == "Write a haiku about rivers"

            # Stop: the status says "cancelled", not a green tick.
            page.fill("#max-tokens", "40")
            page.click("#go")
            page.wait_for_function("() => window.__ms.textTokens >= 3", timeout=30_000)
            page.click("#stop")
            page.wait_for_selector("#final", timeout=30_000)
            assert page.evaluate("window.__ms.finalEvent.finish_reason") == "cancelled"
            assert page.inner_text("#status").startswith("cancelled · ")
            assert page.get_attribute("#final", "class") == "cancelled"
            colour = page.eval_on_selector("#final", "e => getComputedStyle(e).color")
            assert colour != "rgb(10, 122, 47)"  # not the green of "done"
            _shot(page, "webclient_cancelled.png")
            assert errors == []
        finally:
            browser.close()


def test_web_client_speaks_and_plays_the_audio() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    pytest.importorskip("piper")
    import multistream as ms
    from multistream.server import ServerSettings, create_app

    from server_fixtures import live_server

    tts = ms.load_speech_model()  # the embedded Piper voice, as `multistream serve` speaks by default
    app = create_app(ScriptedTextModel(TOKENS), None, ServerSettings(), speech_model=tts)
    with live_server(app) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--autoplay-policy=no-user-gesture-required"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 720})
            page.goto(srv.url + "/")
            # This server draws no pictures: its mode is greyed out, speech is there.
            page.wait_for_function("() => document.querySelector('input[value=image]').disabled", timeout=10_000)
            page.check("input[value=speech]")
            assert page.locator("audio, img").count() == 0 and page.inner_text("#output") == ""
            said = "Hello there. This is a test of the speech mode. It plays while it is made."
            page.fill("#prompt", said)
            page.fill("#speed", "1.25")
            page.click("#go")
            page.wait_for_selector("#final", timeout=60_000)
            final = page.evaluate("window.__ms.finalEvent")
            assert final["type"] == "audio" and final["finish_reason"] == "stop"
            status = page.inner_text("#status")
            assert status.startswith("done · ") and " of audio · first audio after " in status, status
            # It plays: the page's audio clock runs past the start of the first chunk.
            page.wait_for_function("() => { const a = window.__msAudio; return a.firstStart !== null && "
                                   "a.ctx.currentTime - a.firstStart > 0.3; }", timeout=30_000)
            assert page.evaluate("window.__ms.audioChunks") >= 2
            assert page.evaluate("window.__msAudio.ctx.state") == "running"
            assert page.inner_text("#spoken mark") == said  # all of it was made into audio
            assert page.get_attribute("#save", "href").startswith("blob:")
            assert not page.is_disabled("#replay")
            _shot(page, "webclient_speech.png")
        finally:
            browser.close()
            tts.close()


def test_favicon_is_an_empty_answer_not_a_404(tmp_path: Path) -> None:
    # Browsers ask for /favicon.ico on every page (/ and /demo); a 404 is a console error there.
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a name=alice\n", encoding="utf-8")
    with make_server(ScriptedTextModel(TOKENS), keys_file=str(keys)) as srv:
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401  # a keyed server
        r = httpx.get(srv.url + "/favicon.ico", timeout=10)  # no key needed, as for the page itself
        assert r.status_code == 204 and r.content == b""
