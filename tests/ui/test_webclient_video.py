"""The web client's video view in headless Chromium: every frame's preview per step as an animated
WebP in an <img>, then the clip in a looping <video> the browser really decodes, with the status
line and "Use this" (finish early)."""

from __future__ import annotations

import os

import pytest
from browser_fixtures import BROWSER_FLAGS, CHROMIUM

from multistream.server import create_app
from multistream.testing import ScriptedTextModel, ScriptedVideoModel

from repo_paths import ARTIFACTS
from server_fixtures import live_server

CHROME_ARGS = [*BROWSER_FLAGS,
               "--autoplay-policy=no-user-gesture-required"]
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM}")]


def _shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name))


@pytest.fixture(scope="module")
def browser_page():  # type: ignore[no-untyped-def]
    sync_api = pytest.importorskip("playwright.sync_api")
    # Slow enough that the page shows previews while it runs (and "Use this" lands mid-run).
    video = ScriptedVideoModel(steps=40, num_frames=16, size=64, delay_s=0.08)
    app = create_app(ScriptedTextModel(["hi"]), video_model=video)
    with live_server(app) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        try:
            page = browser.new_page()
            page.goto(srv.url + "/")
            yield page
        finally:
            browser.close()


def test_the_video_view_shows_every_frames_preview_then_plays_the_clip(browser_page) -> None:  # type: ignore[no-untyped-def]
    page = browser_page
    page.check("input[value=video]")
    assert page.is_visible("#video-options") and not page.is_visible("#image-options")
    assert page.input_value("#prompt") == "a red circle moving right on a blue background"
    page.fill("#video-steps", "40")
    page.click("#go")
    page.wait_for_function("() => window.__ms.frames >= 3", timeout=60_000)
    preview = page.evaluate("""() => { const img = document.querySelector('#video-preview');
        return { src: img.src.slice(0, 22), shown: !img.hidden, w: img.naturalWidth, clip: !document.querySelector('#clip').hidden }; }""")
    assert preview == {"src": "data:image/webp;base64", "shown": True, "w": 64, "clip": False}
    assert page.evaluate("document.querySelector('#status').innerText").startswith("step ")
    assert " · 16 frames" in page.evaluate("document.querySelector('#status').innerText")
    _shot(page, "webclient_video_preview.png")
    # Halfway, the previews have converged towards the clip (an artifact to look at, no timing asserted).
    page.wait_for_function("() => window.__ms.finalEvent || (window.__ms.seqs.length && "
                           "/^step (2|3)\\d\\//.test(document.querySelector('#status').innerText))", timeout=60_000)
    _shot(page, "webclient_video_midrun.png")

    page.wait_for_selector("#final", timeout=60_000)
    # The browser decodes the clip: its metadata (size, length) is known and it plays.
    page.wait_for_function("() => document.querySelector('#clip').readyState >= 2", timeout=30_000)
    clip = page.evaluate("""() => { const v = document.querySelector('#clip');
        return { w: v.videoWidth, h: v.videoHeight, duration: v.duration, loop: v.loop, shown: !v.hidden,
                 preview: !document.querySelector('#video-preview').hidden,
                 save: document.querySelector('#save-clip').download }; }""")
    assert (clip["w"], clip["h"], clip["loop"], clip["shown"], clip["preview"]) == (64, 64, True, True, False)
    assert clip["duration"] == pytest.approx(2.0, abs=0.2)  # 16 frames at 8 fps
    assert clip["save"] == "clip.webm"
    status = page.evaluate("document.querySelector('#status').innerText")
    assert status.startswith("done · 40 steps") and "16 frames at 8 fps" in status and "WEBM" in status
    assert page.evaluate("window.__ms.finalEvent.mime") == "video/webm"
    _shot(page, "webclient_video_done.png")


def test_use_this_ends_the_clip_early(browser_page) -> None:  # type: ignore[no-untyped-def]
    page = browser_page
    page.check("input[value=video]")
    page.click("#go")
    page.wait_for_function("() => window.__ms.frames >= 2 && !document.querySelector('#finish').disabled",
                           timeout=60_000)
    page.click("#finish")
    page.wait_for_selector("#final", timeout=60_000)
    final = page.evaluate("window.__ms.finalEvent")
    assert final["finish_reason"] == "finished_early" and final["step"] < 40
    assert page.evaluate("document.querySelector('#status').innerText").startswith("stopped early · step ")
    page.wait_for_function("() => document.querySelector('#clip').readyState >= 2", timeout=30_000)
    _shot(page, "webclient_video_finished_early.png")
