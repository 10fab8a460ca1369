"""The demo's speech in headless Chromium: the Chat tab speaking an answer while it streams, and
the Speech tab. A scripted text model writes slowly; the voice is the embedded one. Screenshots
go to artifacts/speech_*.png."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from browser_fixtures import BROWSER_FLAGS, demo_in_chromium

from repo_paths import ARTIFACTS

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import multistream as ms
from multistream.testing import ScriptedImageModel, ScriptedTextModel
from multistream.ui.demo import create_demo

pytestmark = [pytest.mark.browser]
pytest.importorskip("piper")

CHROME_ARGS = [*BROWSER_FLAGS,
               "--autoplay-policy=no-user-gesture-required"]
ANSWER = ("Sure. The sea covers most of our planet. Its tides follow the moon, and its currents carry heat "
          "around the world. Sailors have crossed it for thousands of years, and they still do today.")
BOT_TEXT = """() => { const m = document.querySelectorAll('#ms-chatbot .bot, #ms-chatbot [data-testid="bot"]');
  return m.length ? m[m.length - 1].innerText : ''; }"""
# Whether the audio player of `sel` has something to play (Gradio sets its source once audio came).
AUDIO_READY = """(sel) => { const a = document.querySelector(sel + ' audio');
  return !!(a && a.currentSrc); }"""
# How far the player of `sel` has played, in seconds.
PLAYED = """(sel) => { const a = document.querySelector(sel + ' audio'); return a ? a.currentTime : 0; }"""


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    words = ANSWER.split(" ")
    llm = ScriptedTextModel([w if i == 0 else " " + w for i, w in enumerate(words)], delay_s=0.15)
    tts = ms.load_speech_model()
    try:
        with demo_in_chromium(create_demo(llm, ScriptedImageModel(), speech_model=tts), timeout_ms=60_000,
                              args=CHROME_ARGS) as pg:
            pg.wait_for_selector("#ms-chat-input textarea")
            yield pg
    finally:
        tts.close()


def test_chat_speaks_the_answer_while_it_streams(page):
    page.click("#ms-chat-speak input[type=checkbox]")
    page.fill("#ms-chat-input textarea", "Tell me about the sea.")
    page.click("#ms-chat-send")
    page.wait_for_function(AUDIO_READY, arg="#ms-chat-audio", timeout=30_000)
    # The chat may render its first words a moment after the player on a loaded machine.
    page.wait_for_function(f"() => ({BOT_TEXT})().length > 0", timeout=30_000)
    mid = page.evaluate(BOT_TEXT)
    page.screenshot(path=str(ARTIFACTS / "speech_chat.png"), full_page=True)
    assert mid and "still do today" not in mid  # the spoken answer is there while the text is still written
    page.wait_for_function(f"() => ({BOT_TEXT})().includes('still do today')", timeout=60_000)
    page.wait_for_function(f"() => ({PLAYED})('#ms-chat-audio') > 0.5", timeout=30_000)  # and it plays


def test_speech_tab_plays_while_it_speaks(page):
    page.click("button[role=tab]:has-text('Speech')")
    page.click("#ms-speech-go")
    page.wait_for_function(AUDIO_READY, arg="#ms-speech-audio", timeout=30_000)
    page.wait_for_function("() => (document.querySelector('#ms-speech-text mark')||{}).innerText?.length > 0")
    page.wait_for_timeout(700)  # a moment of playback, for the screenshot
    page.screenshot(path=str(ARTIFACTS / "speech_tab.png"), full_page=True)
    page.wait_for_function("() => (document.querySelector('#ms-speech-spoken')||{}).innerText?.includes('real-time')",
                           timeout=60_000)
    spoken = page.evaluate("() => document.querySelector('#ms-speech-text mark').innerText")
    assert spoken.strip().endswith("still being made.")
