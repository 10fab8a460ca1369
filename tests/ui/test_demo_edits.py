"""The demo's edit controls on scripted models: Steer / Regenerate from here (chat), Use this /
Apply now (image), through gradio_client; and screenshots of both in headless Chromium."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_fixtures import CHROME_ARGS, CHROMIUM

from gradio_fixtures import set_number
from repo_paths import ARTIFACTS

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from multistream.testing import ScriptedImageModel, ScriptedTextModel
from multistream.ui.demo import create_demo

gradio_client = pytest.importorskip("gradio_client")

WORDS = [f" word{i}" for i in range(80)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, ScriptedTextModel, ScriptedImageModel]]:
    llm = ScriptedTextModel(WORDS, delay_s=0.05)
    sd = ScriptedImageModel(steps=40, size=64, delay_s=0.08)
    demo = create_demo(llm, sd, max_fps=30)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", llm, sd
    finally:
        demo.close()


def _wait(cond: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _answer(chatbot: Any) -> str:
    content = chatbot[-1]["content"]
    if isinstance(content, list):
        return "".join(c.get("text", "") if isinstance(c, dict) else str(c) for c in content)
    return str(content)


def test_edit_endpoints_are_named(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {"/steer_chat", "/regenerate_chat", "/finish_image", "/steer_image"} <= names


def test_chat_steer_and_rewind_while_streaming_then_revise(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("hello", [], 60, 0.0, 1.0, -1, api_name="/chat")
    _wait(lambda: len(job.outputs()) >= 4 and len(_answer(job.outputs()[-1][0])) > 20)
    assert client.predict("be brief", api_name="/steer_chat") == ""
    client.predict(3, "", "again", [], api_name="/regenerate_chat")
    _wait(job.done)
    outputs = job.outputs()
    final_answer = _answer(outputs[-1][0])
    stats = outputs[-1][2]
    assert "revision 2" in stats and final_answer.lstrip().startswith("wo word")
    # Somewhere during the run the answer got shorter: the rewind redrew it in place.
    lengths = [len(_answer(o[0])) for o in outputs if o[0]]
    assert any(b < a for a, b in zip(lengths, lengths[1:])), lengths
    # Once it ended: Regenerate from here revises the finished answer (a new stream).
    history = outputs[-1][0]
    job2 = client.submit(5, "", "", history, api_name="/regenerate_chat")
    _wait(job2.done)
    revised = _answer(job2.outputs()[-1][0])
    # The kept five characters (" wo w"; the chatbot strips the leading space), then the new text.
    assert revised.lstrip().startswith("wo w word0 word1"), revised[:40]
    # Nothing streaming: Steer says so.
    with pytest.raises(Exception, match="no answer is being written"):
        client.predict("shorter", api_name="/steer_chat")


def test_regenerate_from_a_selected_span(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("hello", [], 12, 0.0, 1.0, -1, api_name="/chat")
    _wait(job.done)
    history = job.outputs()[-1][0]
    assert _answer(history).endswith("word11")
    job2 = client.submit(0, "word3 word4", "", history, api_name="/regenerate_chat")
    _wait(job2.done)
    out = job2.outputs()[-1]
    # " word0 word1 word2 " is kept; the new text starts where the selection began.
    assert _answer(out[0]).startswith("word0 word1 word2  word0"), _answer(out[0])[:40]
    assert out[3] == ""  # the selection box is cleared
    with pytest.raises(Exception, match="not in the answer"):
        client.predict(0, "no such words", "", out[0], api_name="/regenerate_chat")


def test_image_apply_now_and_use_this(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    args = ("a red circle on a blue background", 40, 0, "latent", 1, 75, 256, False)
    job = client.submit(*args, api_name="/image")
    _wait(lambda: len(job.outputs()) >= 3)
    client.predict("a red circle on a yellow background", api_name="/steer_image")
    _wait(job.done)
    final = job.outputs()[-1][1]
    from PIL import Image

    r, g, b = Image.open(final).convert("RGB").getpixel((0, 0))
    assert r > 200 and g > 200 and b < 80
    with pytest.raises(Exception, match="nothing is being drawn"):
        client.predict("a red circle on a green background", api_name="/steer_image")
    job = client.submit(*args, api_name="/image")
    _wait(lambda: len(job.outputs()) >= 3)
    client.predict(api_name="/finish_image")
    _wait(job.done)
    assert "stopped early" in job.outputs()[-1][0]


@pytest.mark.browser
def test_screenshots_after_apply_now_and_steer(served: tuple) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("no Chromium at /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
        try:
            pg = browser.new_page(viewport={"width": 1280, "height": 860})
            pg.set_default_timeout(60_000)
            pg.goto(served[0])
            pg.wait_for_selector("#ms-chat-input textarea")
            # Chat: a redirected answer mid-stream.
            pg.fill("#ms-chat-input textarea", "Tell me about words")
            pg.click("#ms-chat-send")
            _wait(lambda: "streaming" in pg.inner_text("#ms-chat-stats"))
            pg.wait_for_timeout(800)
            pg.fill("#ms-chat-input textarea", "make it about numbers")
            pg.click("#ms-chat-steer")
            _wait(lambda: "revision 1" in pg.inner_text("#ms-chat-stats"))
            pg.wait_for_timeout(400)
            pg.screenshot(path=str(ARTIFACTS / "demo_chat_steered.png"))
            pg.click("#ms-chat-stop")
            _wait(lambda: pg.inner_text("#ms-chat-stats").startswith("cancelled"))
            # Selecting words in the answer fills the selection box that Regenerate from here uses.
            pg.evaluate("""() => {
              const bots = document.querySelectorAll('#ms-chatbot .bot, #ms-chatbot [data-testid="bot"]');
              const node = bots[bots.length - 1];
              const walker = document.createTreeWalker(node, NodeFilter.SHOW_TEXT);
              let t; while ((t = walker.nextNode()) && !t.textContent.includes('word2')) {}
              const i = t.textContent.indexOf('word2');
              const r = document.createRange(); r.setStart(t, i); r.setEnd(t, i + 11);
              const sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(r);
              document.dispatchEvent(new MouseEvent('mouseup', {bubbles: true}));
            }""")
            assert pg.input_value("#ms-chat-selection textarea") == "word2 word3"
            # Image: Apply now mid-generation.
            pg.get_by_role("tab", name="Image").click()
            pg.wait_for_selector("#ms-image-go")
            set_number(pg, "ms-image-steps", 60)
            pg.click("#ms-image-go")
            _wait(lambda: pg.inner_text("#ms-image-preview .ms-step").startswith("step "))
            pg.wait_for_timeout(600)
            pg.fill("#ms-image-prompt textarea", "a red circle on a yellow background")
            pg.click("#ms-image-apply")
            pg.wait_for_timeout(900)
            pg.screenshot(path=str(ARTIFACTS / "demo_image_applied.png"))
            step = pg.inner_text("#ms-image-preview .ms-step")
            assert step.startswith("step "), step  # still drawing: a mid-generation picture
            _wait(lambda: pg.inner_text("#ms-image-preview .ms-step").startswith("done"), 90)
        finally:
            browser.close()
