"""A beam search in the browser: the Gradio chat and the web client at ``/`` show committed text
plain and the provisional rest faded, mid-stream, and end with generate(num_beams=k)'s text.
Screenshots go to artifacts/beams_*.png."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from browser_fixtures import CHROME_ARGS, CHROMIUM

from gradio_fixtures import set_number
from repo_paths import ARTIFACTS
from server_fixtures import make_server

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from multistream.testing import ScriptedImageModel  # noqa: E402
from multistream.text._beams import BeamSearch  # noqa: E402
from multistream.ui.demo import create_demo  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.model]

QUESTION = "Give three tips for learning to cook."
PROVISIONAL = """(sel) => { const s = document.querySelectorAll(sel); if (!s.length) return null;
  const el = s[s.length - 1]; return {text: el.textContent, opacity: getComputedStyle(el).opacity,
  whole: el.parentElement.closest('div, pre, p').innerText}; }"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reference(llm: Any, prompt: Any, k: int, n: int) -> str:
    ids = llm.encode_prompt(prompt)
    with torch.no_grad():
        out = llm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 num_beams=k, do_sample=False, max_new_tokens=n)
    return llm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.fixture(scope="module")
def browser() -> Any:
    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium at /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


# The page is polled every 50 ms for a mid-stream state. A beam step of the default model takes
# 10-30 ms, so 48 of them could end between two polls on a busy machine (a full run once saw no
# provisional text at all). Each step is held this long after its scores are taken: the answer
# stays the same, and the page has a poll or two per step.
STEP_HOLD_S = 0.08


@pytest.fixture
def paced_beams(monkeypatch: pytest.MonkeyPatch) -> None:
    step = BeamSearch.step

    def held_step(self: BeamSearch, logits: torch.Tensor) -> list[int]:
        source = step(self, logits)
        time.sleep(STEP_HOLD_S)
        return source

    monkeypatch.setattr(BeamSearch, "step", held_step)


def _wait_mid_stream(pg: Any, selector: str, done: Any, shot: Path, timeout: float = 240.0) -> list[dict[str, str]]:
    """Poll until the run ends; screenshot once a provisional tail shows after some committed text."""
    seen: list[dict[str, str]] = []
    shot_taken = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = pg.evaluate(PROVISIONAL, selector)
        if state and state["text"].strip():
            if not shot_taken and len(state["whole"]) - len(state["text"]) > 60:
                pg.screenshot(path=str(shot))
                shot_taken = True
            seen.append(state)
        if done():
            assert shot_taken, f"no provisional text after committed text; seen {seen[-3:]}"
            return seen
        time.sleep(0.05)
    raise AssertionError("the run did not end in time")


def test_chat_shows_a_beam_answer_committed_plain_and_provisional_faded(text_model: Any, browser: Any,
                                                                       paced_beams: None) -> None:
    # compared with transformers' beam search on the same (default, int4) model: one arithmetic
    demo = create_demo(text_model, ScriptedImageModel(steps=2, size=32), prompt_style="shapes")
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        pg = browser.new_page(viewport={"width": 1280, "height": 860})
        pg.set_default_timeout(120_000)
        pg.goto(f"http://127.0.0.1:{port}/")
        pg.wait_for_selector("#ms-chat-input textarea")
        pg.get_by_text("Sampling").click()
        for elem_id, value in (("ms-chat-max-tokens", 48), ("ms-chat-beams", 4)):
            set_number(pg, elem_id, value)
        pg.fill("#ms-chat-input textarea", QUESTION)
        pg.click("#ms-chat-send")

        def finished() -> bool:
            return str(pg.inner_text("#ms-chat-stats")).startswith("done")

        seen = _wait_mid_stream(pg, "#ms-chatbot .ms-provisional", finished, ARTIFACTS / "beams_chat_streaming.png")
        pg.screenshot(path=str(ARTIFACTS / "beams_chat_done.png"))
        assert seen, "no provisional (faded) text was ever shown"
        assert float(seen[0]["opacity"]) < 0.6
        bot = pg.evaluate("""() => { const m = document.querySelectorAll('#ms-chatbot .bot, #ms-chatbot [data-testid="bot"]');
            return m.length ? m[m.length - 1].innerText : ''; }""")
        assert pg.evaluate(PROVISIONAL, "#ms-chatbot .ms-provisional") is None  # all committed at the end
        expected = _reference(text_model, [{"role": "user", "content": QUESTION}], 4, 48)
        # The chat renders markdown: compare the words, without list numbers and emphasis marks.
        plain = re.sub(r"(^|\n)\s*\d+\.\s", "\\1", expected).replace("**", "")
        assert " ".join(bot.split()) == " ".join(plain.split())
        pg.close()
    finally:
        demo.close()


def test_web_client_draws_provisional_text_faded(text_model: Any, browser: Any, paced_beams: None) -> None:
    # compared with transformers' beam search on the same (default, int4) model: one arithmetic
    with make_server(text_model) as srv:
        pg = browser.new_page()
        pg.goto(srv.url + "/")
        pg.fill("#prompt", QUESTION)
        pg.fill("#max-tokens", "48")
        pg.fill("#beams", "4")
        pg.click("#go")
        seen = _wait_mid_stream(pg, "#output .provisional", lambda: pg.evaluate("window.__ms.finalEvent !== null"),
                                ARTIFACTS / "beams_webclient_streaming.png")
        pg.screenshot(path=str(ARTIFACTS / "beams_webclient_done.png"))
        assert seen and float(seen[0]["opacity"]) < 0.6
        final = pg.evaluate("window.__ms.finalEvent")
        assert pg.evaluate("window.__ms.text") == final["text"] == pg.inner_text("#output")
        assert final["text"] == _reference(text_model, QUESTION, 4, 48)
        pg.close()
