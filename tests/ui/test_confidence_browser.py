"""'Show confidence' in headless Chromium, in the web client at / and in the demo's Chat tab: tokens
coloured by probability while the answer streams, alternatives on hover, and a click on one
branches the answer from that token. Scripted models (their logprobs are made up, their branch
continues the script from the chosen token), so the pages are checked, not the numbers.
Screenshots: artifacts/confidence_*.png."""

from __future__ import annotations

import os
import socket

import pytest
from browser_fixtures import CHROME_ARGS, CHROMIUM

from repo_paths import ARTIFACTS
from server_fixtures import ScriptedImageModel, ScriptedTextModel, make_server

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

TOKENS = [f" word{i}" for i in range(30)]
# The last answer bubble in the demo's chat, and the coloured tokens in it.
BUBBLE = "#ms-chatbot .bot-row"
BUBBLE_TOKENS = f"{BUBBLE} .ms-tok"
BOT_TEXT = """() => { const m = document.querySelectorAll('#ms-chatbot .bot, #ms-chatbot [data-testid="bot"]');
  return m.length ? m[m.length - 1].innerText : ''; }"""
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"Chromium is not installed at {CHROMIUM}")]


def test_web_client_colours_tokens_and_branches_from_an_alternative() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    text = ScriptedTextModel(TOKENS, delay_s=0.2)  # 6 s of answer: time to hover and click on a loaded machine
    ARTIFACTS.mkdir(exist_ok=True)
    with make_server(text, ScriptedImageModel(steps=2)) as srv, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 600})
            page.goto(srv.url + "/")
            page.check("#confidence")
            page.fill("#max-tokens", "30")
            page.click("#go")
            page.wait_for_function("() => document.querySelectorAll('#output .ms-tok').length >= 6", timeout=30_000)
            assert text.calls[-1]["top_logprobs"] == 5
            colours = page.eval_on_selector_all("#output .ms-tok", "els => els.map(e => e.style.background)")
            assert len(set(colours)) > 1  # coloured by probability
            page.hover("#output .ms-tok:nth-of-type(3)")
            page.wait_for_selector("#output .ms-tok:nth-of-type(3) .ms-tip", state="visible")
            page.screenshot(path=str(ARTIFACTS / "confidence_webclient_streaming.png"))
            assert not page.evaluate("window.__ms.finalEvent")  # mid-stream
            # Branch: the third token's third alternative (script token 4, so the answer continues " word4 ...").
            alt = page.locator("#output .ms-tok:nth-of-type(3) .ms-alt").nth(2)
            assert alt.get_attribute("data-token") == "4"
            # New tokens are appended without redrawing the ones on screen, so the box under the
            # mouse stays put while the answer streams: one hover and one click, as a person would.
            page.eval_on_selector("#output .ms-tok:nth-of-type(3)", "el => { el.dataset.seen = '1'; }")
            page.wait_for_function("() => document.querySelectorAll('#output .ms-tok').length >= 9", timeout=30_000)
            assert page.get_attribute("#output .ms-tok:nth-of-type(3)", "data-seen") == "1"  # kept, not redrawn
            page.hover("#output .ms-tok:nth-of-type(3)")
            alt.click(timeout=10_000)
            page.wait_for_function("() => window.__ms.finalEvent !== null", timeout=60_000)
            state = page.evaluate("window.__ms")
            assert state["branches"] == 1 and state["revision"] >= 1
            assert state["finalEvent"]["text"].startswith(" word0 word1 word4 word5")
            assert state["text"] == state["finalEvent"]["text"]
            assert page.inner_text("#output").startswith(" word0 word1 word4")
            page.hover("#output .ms-tok:nth-of-type(3)")
            page.screenshot(path=str(ARTIFACTS / "confidence_webclient_branched.png"))
        finally:
            browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demo_chat_shows_confidence_and_branches_from_an_alternative() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    from multistream.ui.demo import create_demo

    text = ScriptedTextModel(TOKENS, delay_s=0.12)
    demo = create_demo(text, ScriptedImageModel(steps=2))
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(60_000)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#ms-chat-input textarea")
            page.check("#ms-chat-confidence-on input")
            page.fill("#ms-chat-input textarea", "hello")
            page.click("#ms-chat-send")
            # The coloured tokens are the answer in its chat bubble, not a copy elsewhere on the page.
            page.wait_for_function(f"() => document.querySelectorAll('{BUBBLE_TOKENS}').length >= 6")
            assert text.calls[-1]["top_logprobs"] == 5
            assert page.locator("#ms-chat-confidence").count() == 0
            colours = page.eval_on_selector_all(BUBBLE_TOKENS, "els => els.map(e => e.style.background)")
            assert len(set(colours)) > 1  # coloured by probability
            bubble = page.evaluate(BOT_TEXT)
            assert bubble.strip().startswith("word0 word1 word2")
            page.hover(f"{BUBBLE} .ms-tok:nth-of-type(2)")
            page.wait_for_selector(f"{BUBBLE} .ms-tok:nth-of-type(2) .ms-tip", state="visible")
            page.screenshot(path=str(ARTIFACTS / "confidence_demo_streaming.png"))
            # Let it end, then branch the finished answer (llm.revise(final, offset, token_id=...)).
            page.wait_for_function("() => document.querySelector('#ms-chat-stats').innerText.includes('TTFT') && /^done/.test(document.querySelector('#ms-chat-stats').innerText.trim())",
                                   timeout=60_000)
            page.mouse.move(0, 0)
            second = page.locator(BUBBLE_TOKENS).nth(1)
            second.hover(force=True)
            alt = second.locator(".ms-alt").nth(3)
            assert "ms-t4" in (alt.get_attribute("class") or "").split()  # the alternative's token id
            alt.click(force=True)
            page.wait_for_function("() => document.querySelector('#ms-chatbot').innerText.includes('word0 word4 word5')")
            page.wait_for_function("() => document.querySelector('#ms-chat-stats').innerText.includes('TTFT') && /^done/.test(document.querySelector('#ms-chat-stats').innerText.trim())")
            assert text.calls[-1].get("revise") is True
            page.locator(BUBBLE_TOKENS).nth(1).hover(force=True)
            page.screenshot(path=str(ARTIFACTS / "confidence_demo_branched.png"))
            browser.close()
    finally:
        demo.close()
