"""The Chat tab's JSON option in headless Chromium: paste a schema, the JSON streams in, then it is
shown formatted. Real embedded text model; screenshots in artifacts/demo_chat_json_*.png."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from browser_fixtures import CHROME_ARGS, CHROMIUM

from repo_paths import ARTIFACTS

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import multistream as ms
from multistream.testing import ScriptedImageModel
from multistream.ui.demo import create_demo

pytestmark = [pytest.mark.browser, pytest.mark.model]

BOT_TEXT = """() => { const m = document.querySelectorAll('#ms-chatbot .bot, #ms-chatbot [data-testid="bot"]');
  return m.length ? m[m.length - 1].innerText : ''; }"""
# The demo samples (temperature 0.7, a random seed): an unbounded integer can run on to the token
# limit ("851118888..."), so the schema bounds it, as a user asking for a population would.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0,
                                                          "maximum": 99_999_999}},
          "required": ["city", "country", "population"], "additionalProperties": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_json_option_streams_then_shows_formatted_json() -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium at /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    demo = create_demo(ms.load_text_model(), ScriptedImageModel(steps=4, size=32))
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
            pg = browser.new_page(viewport={"width": 1280, "height": 1000})
            pg.set_default_timeout(120_000)
            pg.goto(f"http://127.0.0.1:{port}/")
            pg.wait_for_selector("#ms-chat-input textarea")
            # Every text the answer shows, recorded by the page as it changes: polling from here
            # misses steps when the model is fast and the machine loaded.
            pg.evaluate("() => { const read = " + BOT_TEXT + "; window.__botTexts = [];"
                        " new MutationObserver(() => { const t = read(), seen = window.__botTexts;"
                        " if (t && t !== seen[seen.length - 1]) seen.push(t); })"
                        ".observe(document.querySelector('#ms-chatbot'),"
                        " { subtree: true, childList: true, characterData: true }); }")
            pg.get_by_text("JSON", exact=True).click()
            pg.click("#ms-chat-json input[type=checkbox]")
            editor = pg.locator("#ms-chat-schema .cm-content")
            editor.click()
            pg.keyboard.insert_text(json.dumps(SCHEMA))
            pg.fill("#ms-chat-input textarea", "Describe a big city as JSON.")
            pg.click("#ms-chat-send")
            states: list[str] = []
            shot = False
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                text = pg.evaluate(BOT_TEXT)
                if text and (not states or text != states[-1]):
                    states.append(text)
                stats = pg.inner_text("#ms-chat-stats")
                if not shot and "streaming" in stats and len(text) > 10:
                    pg.screenshot(path=str(ARTIFACTS / "demo_chat_json_streaming.png"))
                    shot = True
                if stats.startswith("done"):  # "done", or "done (reached the token limit)"
                    # The page renders the final answer a moment after the stats line on a busy
                    # machine: wait (up to 10 s) until the text stops changing.
                    settle = time.monotonic() + 10
                    last = pg.evaluate(BOT_TEXT)
                    while time.monotonic() < settle:
                        time.sleep(0.5)
                        now = pg.evaluate(BOT_TEXT)
                        if now == last:
                            break
                        last = now
                    states.append(last)
                    break
                time.sleep(0.05)
            pg.screenshot(path=str(ARTIFACTS / "demo_chat_json_done.png"))
            shown = pg.evaluate("window.__botTexts")
            browser.close()
    finally:
        demo.close()
    assert len(shown) >= 3, shown  # it grew in steps
    final = json.loads(states[-1].strip().removeprefix("json").strip())
    assert set(final) == {"city", "country", "population"}
    assert "\n" in states[-1].strip()  # shown formatted (indented), not as the one raw line it streamed as
