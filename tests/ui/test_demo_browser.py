"""The demo in headless Chromium: the answer grows, previews change, Stop ends a run early.

Runs the real default text model, and the real default image model when it loads (else a
scripted one with a delay). Screenshots go to artifacts/demo_*.png.
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

import multistream as ms
from multistream._shapes import COLORS, SHAPES, parse_prompt
from multistream.testing import ScriptedImageModel
from multistream.ui.demo import DEFAULT_IDEA, create_demo

pytestmark = [pytest.mark.browser, pytest.mark.model]


# Counts each different frame the preview <img> shows, as the page sees it.
OBSERVE_PREVIEW = """(sel) => {
  window.__frames = [];
  const root = document.querySelector(sel);
  let last = null;
  const look = () => {
    const img = root.querySelector('img.ms-frame');
    if (img && img.src !== last) { last = img.src; window.__frames.push({t: performance.now(), len: img.src.length, png: img.src.startsWith('data:image/png')}); }
  };
  if (window.__obs) window.__obs.disconnect();
  window.__obs = new MutationObserver(look);
  window.__obs.observe(root, {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
}"""
BOT_TEXT = """() => { const m = document.querySelectorAll('#ms-chatbot .bot, #ms-chatbot [data-testid="bot"]');
  return m.length ? m[m.length - 1].innerText : ''; }"""


def _image_model() -> Any:
    try:
        return ms.load_image_model()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not trained/landed yet: a scripted model with a delay stands in
        return ScriptedImageModel(steps=20, size=64, delay_s=0.08)


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    demo = create_demo(ms.load_text_model(), _image_model(), prompt_style="shapes")
    with demo_in_chromium(demo, height=860) as pg:
        pg.wait_for_selector("#ms-chat-input textarea")
        yield pg


def _poll_states(pg: Any, js: str, until: Any, timeout: float = 180.0) -> list[str]:
    states: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pg.evaluate(js)
        if value and (not states or value != states[-1]):
            states.append(value)
        if until():
            value = pg.evaluate(js)
            if value and value != states[-1]:
                states.append(value)
            return states
        time.sleep(0.05)
    raise AssertionError(f"timed out; states so far: {states[-3:]}")


def _stats(pg: Any) -> str:
    return str(pg.inner_text("#ms-chat-stats"))


def test_chat_answer_grows_live(page: Any) -> None:
    pg = page
    pg.click("#ms-chat-stop")  # no run yet: harmless
    pg.get_by_text("Sampling").click()
    set_number(pg, "ms-chat-max-tokens", 40)
    set_number(pg, "ms-chat-temperature", 0)
    # A long answer: the default model streams a short one ("The capital of France is Paris.") in
    # under 200 ms, faster than the page can be sampled growing.
    pg.fill("#ms-chat-input textarea", "Write a short story about a lighthouse keeper and the sea.")
    pg.click("#ms-chat-send")
    shot = {"done": False}

    def finished() -> bool:
        s = _stats(pg)
        if not shot["done"] and "streaming" in s:
            pg.screenshot(path=str(ARTIFACTS / "demo_chat_streaming.png"))
            shot["done"] = True
        return s.startswith("done")  # "done", or "done (reached the token limit)"

    states = _poll_states(pg, BOT_TEXT, finished)
    pg.screenshot(path=str(ARTIFACTS / "demo_chat_done.png"))
    assert len(states) >= 3, states  # several growing states, not one final blob
    assert states[-1] and len(states[-1]) > len(states[0])
    assert "TTFT" in _stats(pg) and "tokens/s" in _stats(pg)


def test_chat_stop_ends_the_answer_early(page: Any) -> None:
    pg = page
    if not pg.locator("#ms-chat-max-tokens input[type=number]").is_visible():
        pg.get_by_text("Sampling").click()  # closed when this test runs alone (the one above opens it)
    set_number(pg, "ms-chat-max-tokens", 400)
    pg.fill("#ms-chat-input textarea", "Write a very long story about a dragon who learns to paint.")
    pg.click("#ms-chat-send")
    deadline = time.monotonic() + 120
    while "streaming" not in _stats(pg) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Stop mid-answer: once some words are on the page (a condition, not a fixed wait).
    while len(pg.evaluate(BOT_TEXT)) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    pg.click("#ms-chat-stop")
    deadline = time.monotonic() + 60
    while not _stats(pg).startswith("cancelled") and time.monotonic() < deadline:
        time.sleep(0.05)
    pg.screenshot(path=str(ARTIFACTS / "demo_chat_stopped.png"))
    assert _stats(pg).startswith("cancelled"), _stats(pg)
    tokens = int(_stats(pg).split("·")[3].split()[0])
    assert tokens < 400


def test_image_previews_change_then_final(page: Any) -> None:
    pg = page
    pg.get_by_role("tab", name="Image").click()
    pg.wait_for_selector("#ms-image-go")
    pg.evaluate(OBSERVE_PREVIEW, "#ms-image-preview")
    pg.click("#ms-image-go")
    mid = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        step = pg.inner_text("#ms-image-preview .ms-step")
        if not mid and step.startswith("step ") and "step 1/" not in step:
            pg.screenshot(path=str(ARTIFACTS / "demo_image_preview.png"))
            mid = True
        if step.startswith("done"):
            break
        time.sleep(0.03)
    pg.wait_for_timeout(300)
    pg.screenshot(path=str(ARTIFACTS / "demo_image_final.png"))
    frames = pg.evaluate("window.__frames")
    previews = [f for f in frames if not f["png"]]
    assert len(previews) >= 3, frames  # the preview changed several times before the final
    assert frames[-1]["png"]  # and ended on the full-quality PNG
    assert pg.locator("#ms-image-final img").count() == 1


def test_image_stop_ends_the_run(page: Any) -> None:
    pg = page
    set_number(pg, "ms-image-steps", 100)
    pg.click("#ms-image-go")
    deadline = time.monotonic() + 60
    while not pg.inner_text("#ms-image-preview .ms-step").startswith("step ") and time.monotonic() < deadline:
        time.sleep(0.02)
    pg.click("#ms-image-stop")
    deadline = time.monotonic() + 60
    while "cancelled" not in pg.inner_text("#ms-image-preview .ms-step") and time.monotonic() < deadline:
        time.sleep(0.05)
    pg.screenshot(path=str(ARTIFACTS / "demo_image_stopped.png"))
    line = pg.inner_text("#ms-image-preview .ms-step")
    assert line.startswith("cancelled"), line
    set_number(pg, "ms-image-steps", 20)


def test_prompt_to_picture(page: Any) -> None:
    pg = page
    pg.get_by_role("tab", name="Prompt to picture").click()
    pg.wait_for_selector("#ms-picture-go")
    pg.evaluate(OBSERVE_PREVIEW, "#ms-picture-preview")
    # The default idea, as a newcomer first runs it.
    assert pg.input_value("#ms-picture-idea textarea") == DEFAULT_IDEA
    pg.click("#ms-picture-go")
    written: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        w = pg.input_value("#ms-picture-written textarea")
        if w and (not written or w != written[-1]):
            written.append(w)
        if pg.inner_text("#ms-picture-preview .ms-step").startswith("done"):
            break
        time.sleep(0.03)
    pg.wait_for_timeout(300)
    pg.screenshot(path=str(ARTIFACTS / "demo_prompt_to_picture.png"))
    used = pg.input_value("#ms-picture-used textarea")
    shape, color, background = parse_prompt(used)
    assert shape in SHAPES and color in COLORS and background in COLORS, used
    assert used == "a red circle on a blue background"  # what the idea means, not just any shape
    assert written, "the LLM's text never showed"
    frames = pg.evaluate("window.__frames")
    assert len([f for f in frames if not f["png"]]) >= 2 and frames[-1]["png"]
