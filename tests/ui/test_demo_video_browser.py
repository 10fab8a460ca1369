"""The demo's Video tab in headless Chromium: the animated preview of every frame changes per step,
the clip plays in gr.Video, "Use this" keeps the clip early, "Write and film" fills the prompt.

Runs the embedded video model when it loads, else a scripted one with a delay. Screenshots go to
artifacts/demo_video_*.png.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from browser_fixtures import demo_in_chromium

from gradio_fixtures import set_number
from repo_paths import ARTIFACTS

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from multistream.testing import ScriptedImageModel, ScriptedTextModel, ScriptedVideoModel
from multistream.ui.demo import create_demo

pytestmark = [pytest.mark.browser]


# Records each different preview the box shows, as the page sees it (and whether it is animated WebP).
OBSERVE_PREVIEW = """(sel) => {
  window.__previews = [];
  const root = document.querySelector(sel);
  let last = null;
  const look = () => {
    const img = root.querySelector('img.ms-frame');
    const line = root.querySelector('.ms-step');
    if (img && img.src !== last) {
      last = img.src;
      window.__previews.push({webp: img.src.startsWith('data:image/webp'), line: line ? line.innerText : ''});
    }
  };
  if (window.__obs) window.__obs.disconnect();
  window.__obs = new MutationObserver(look);
  window.__obs.observe(root, {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
}"""
# The final clip as the browser plays it: decoded size and duration once its metadata is in.
CLIP_STATE = """() => { const v = document.querySelector('#ms-video-final video');
  return v && v.readyState >= 1 ? {w: v.videoWidth, h: v.videoHeight, d: v.duration, src: v.currentSrc} : null; }"""


def _until(condition: Any, timeout: float = 120.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.03)


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    llm = ScriptedTextModel(["a green ", "star moving", " up on a black", " background"], delay_s=0.05)
    vm = ScriptedVideoModel(steps=20, num_frames=16, size=64, delay_s=0.08)
    with demo_in_chromium(create_demo(llm, ScriptedImageModel(steps=2), video_model=vm, speech_model=False)) as pg:
        pg.get_by_role("tab", name="Video").click()
        pg.wait_for_selector("#ms-video-go")
        yield pg


def _line(pg: Any) -> str:
    return str(pg.inner_text("#ms-video-preview .ms-step"))


def test_video_previews_play_per_step_then_the_clip(page: Any) -> None:
    pg = page
    pg.evaluate(OBSERVE_PREVIEW, "#ms-video-preview")
    pg.click("#ms-video-go")
    shot = False

    def done() -> bool:
        nonlocal shot
        line = _line(pg)
        if not shot and line.startswith("step ") and "about" in line and "step 1/" not in line:
            pg.screenshot(path=str(ARTIFACTS / "demo_video_preview.png"))
            shot = True
        return line.startswith("done")

    _until(done, what="the clip")
    clip = _until(lambda: pg.evaluate(CLIP_STATE), what="the clip to load in the <video>")
    pg.screenshot(path=str(ARTIFACTS / "demo_video_final.png"))
    previews = pg.evaluate("window.__previews")
    assert len(previews) >= 3 and all(p["webp"] for p in previews), previews  # it changed step by step
    assert any("s left" in p["line"] for p in previews)  # the ETA line
    assert clip["w"] == 64 and clip["h"] == 64 and clip["d"] > 1.5, clip  # 16 frames at 8 fps, decoded by Chromium
    assert "done · 20/20 steps" in _line(pg) and "16 frames 64x64 at 8 fps · WEBM" in _line(pg)


def test_use_this_keeps_the_clip_as_it_is(page: Any) -> None:
    pg = page
    set_number(pg, "ms-video-steps", 100)
    pg.click("#ms-video-go")
    _until(lambda: _line(pg).startswith("step ") and "step 1/" not in _line(pg), what="step 2")
    pg.click("#ms-video-finish")
    _until(lambda: _line(pg).startswith("stopped early"), what="stopped early")
    _until(lambda: pg.evaluate(CLIP_STATE), what="the early clip")
    pg.screenshot(path=str(ARTIFACTS / "demo_video_finished_early.png"))
    steps = int(_line(pg).split("·")[1].split("/")[0])
    assert 1 <= steps < 100
    set_number(pg, "ms-video-steps", 20)


def test_write_and_film_fills_the_prompt_then_films_it(page: Any) -> None:
    pg = page
    pg.get_by_text("Let the LLM write the prompt").click()
    pg.click("#ms-video-write")
    _until(lambda: pg.input_value("#ms-video-prompt textarea") == "a green star moving up on a black background",
           what="the written prompt")
    _until(lambda: _line(pg).startswith("done"), what="the clip of the written prompt")
    pg.screenshot(path=str(ARTIFACTS / "demo_video_written.png"))
