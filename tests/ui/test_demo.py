"""The Gradio demo on scripted models: endpoints stream through gradio_client, Stop cancels the model."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import Iterator

import pytest

from repo_paths import ROOT

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import multistream as ms
from multistream._shapes import COLORS, SHAPES, parse_prompt
from multistream.testing import ScriptedImageModel, ScriptedTextModel
from multistream.ui.demo import create_demo, mount_demo, prompt_messages, shapes_prompt_pattern, throttled_views

gradio_client = pytest.importorskip("gradio_client")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, ScriptedTextModel, ScriptedImageModel]]:
    llm = ScriptedTextModel(delay_s=0.03)
    sd = ScriptedImageModel(steps=12, size=32, delay_s=0.03)
    demo = create_demo(llm, sd, max_fps=50)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", llm, sd
    finally:
        demo.close()


def _wait_done(job: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not job.done() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    assert job.done(), "the demo endpoint did not finish"  # type: ignore[attr-defined]


def test_endpoints_are_named(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {"/chat", "/stop_chat", "/image", "/stop_image", "/prompt_to_picture", "/stop_picture"} <= names


def test_chat_streams_through_gradio_client(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("hello", [], 64, 0.0, 1.0, -1, api_name="/chat")
    _wait_done(job)
    outputs = job.outputs()
    answers = [_answer(o[0]) for o in outputs]
    grown = [a for i, a in enumerate(answers) if a and (i == 0 or a != answers[i - 1])]
    assert len(grown) >= 5, answers  # the answer arrived in several growing states
    assert all(b.startswith(a) for a, b in zip(grown, grown[1:]))
    assert grown[-1] == "".join(ScriptedTextModel().tokens)
    assert "tokens/s" in outputs[-1][2] and "TTFT" in outputs[-1][2]


def _answer(history: list) -> str:
    if not history or history[-1]["role"] != "assistant":
        return ""
    content = history[-1]["content"]
    if isinstance(content, list):
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return str(content)


def test_image_streams_previews_then_final(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("a red circle on a blue background", 12, 0, "latent", 1, 75, 256, True, api_name="/image")
    _wait_done(job)
    outputs = job.outputs()
    previews = [o[0] for o in outputs if "data:image/jpeg;base64," in o[0]]
    assert len(set(previews)) >= 4  # several different frames reached the client
    # The status line says how long is left once the steps give an estimate (eta_s: none at step 1).
    lines = [re.search(r"step (\d+)/12(?: · about ([\d.]+) s left)? · ", p) for p in previews]
    assert all(lines) and any(m.group(2) for m in lines if m), previews[-1]  # type: ignore[union-attr]
    left = [float(m.group(2)) for m in lines if m and m.group(2)]
    # Counting down: the steps left fall from about 10 to 1 while a step stays about 30 ms.
    assert len(left) >= 2 and left[-1] < left[0], left
    last = outputs[-1]
    assert "data:image/png;base64," in last[0] and "done · 12/12 steps" in last[0]
    assert last[1] and os.path.exists(last[1])  # the final full-quality image
    assert last[2].count("<img") >= 3  # the strip of frames


def test_prompt_to_picture_is_one_composed_stream(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("a red ball in the blue sea", 8, 0, "latent", api_name="/prompt_to_picture")
    _wait_done(job)
    outputs = job.outputs()
    written = [o[0] for o in outputs]
    assert len({w for w in written if w}) >= 3  # the LLM's text grew live
    assert any("data:image/jpeg" in o[2] for o in outputs)
    assert outputs[-1][3] and "data:image/png" in outputs[-1][2]
    # What the LLM wrote is exactly what is drawn: no table of hint words overrides it.
    assert outputs[-1][1] == outputs[-1][0].strip()


def test_stop_cancels_the_model(served: tuple) -> None:
    _, _, sd = served
    client = gradio_client.Client(served[0], verbose=False)
    before = len(sd.finish_reasons)
    job = client.submit("a red circle", 100, 0, "latent", 1, 75, 256, False, api_name="/image")
    deadline = time.monotonic() + 60
    while sum("data:image/jpeg" in o[0] for o in job.outputs()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    client.predict(api_name="/stop_image")
    _wait_done(job)
    last = job.outputs()[-1][0]
    assert "cancelled" in last
    deadline = time.monotonic() + 10
    while len(sd.finish_reasons) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sd.finish_reasons[before:] == ["cancelled"]  # the model thread stopped, not just the page


async def test_throttled_views_coalesce_and_keep_final() -> None:
    sd = ScriptedImageModel(steps=300, size=8, delay_s=0.002)
    views = []
    async for view in throttled_views(sd.stream("x", steps=300), max_fps=10):
        views.append((view.images[0].ev.step, view.images[0].final))
    assert views[-1] == (300, True)
    assert 2 <= len(views) < 60  # ~0.6 s+ of frames at 10 updates/s, not 300 updates


async def test_throttled_views_cancel_the_stream_when_left() -> None:
    llm = ScriptedTextModel(delay_s=0.01)
    agen = throttled_views(llm.stream("x", max_new_tokens=10_000), max_fps=100)
    async for _ in agen:
        break
    await agen.aclose()
    for _ in range(500):
        if not llm.active:
            break
        await asyncio.sleep(0.01)
    assert llm.finish_reasons == ["cancelled"]


@pytest.mark.model
@pytest.mark.parametrize("idea", ["the sun over the sea", "a pine tree in the snow", "a fire truck"])
def test_the_llm_writes_only_what_the_image_model_can_draw(text_model, idea: str) -> None:
    import re

    final = text_model.generate(prompt_messages(idea, "shapes"), max_new_tokens=32, temperature=0.0,
                                allowed=shapes_prompt_pattern())
    assert re.fullmatch(shapes_prompt_pattern(), final.text), final.text
    shape, color, background = parse_prompt(final.text)
    assert shape in SHAPES and color in COLORS and background in COLORS


@pytest.mark.model
def test_the_default_idea_is_written_and_drawn_right_by_the_embedded_models(text_model) -> None:
    # What a newcomer sees first on the Prompt-to-picture tab (and in the notebook): the 135M LLM
    # must turn it into the picture the idea means, and the shapes model must draw that picture.
    import json
    from collections import Counter

    import numpy as np

    from multistream.ui.demo import DEFAULT_IDEA

    notebook = json.loads(open(str(ROOT / "demos" / "notebook.ipynb")).read())
    assert any(f'idea = "{DEFAULT_IDEA}"' in "".join(c["source"]) for c in notebook["cells"])
    final = text_model.generate(prompt_messages(DEFAULT_IDEA, "shapes"), max_new_tokens=32, temperature=0.0,
                                allowed=shapes_prompt_pattern())
    assert final.text.strip() == "a red circle on a blue background"
    sd = ms.load_image_model()
    try:
        img = np.asarray(sd.generate(final.text.strip(), steps=20, seed=0).image.convert("RGB")).astype(float)
    finally:
        sd.close()

    def nearest(rgb: np.ndarray) -> str:
        return min(COLORS, key=lambda c: float(sum((a - b) ** 2 for a, b in zip(COLORS[c], rgb))))

    names = np.array([nearest(p) for p in img.reshape(-1, 3)]).reshape(img.shape[:2])
    assert Counter(names.ravel()).most_common(1)[0][0] == "blue"  # the background
    shape = names == "red"
    ys, xs = np.nonzero(shape)
    assert shape.sum() > 0.03 * shape.size, shape.sum()
    # A disc fills about pi/4 of its bounding box (a square all of it, a triangle or star half or less).
    fill = shape.sum() / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
    assert 0.65 < fill < 0.9, fill


def test_create_demo_bad_arguments() -> None:
    with pytest.raises(ms.InvalidArgumentError, match="max_fps"):
        create_demo(ScriptedTextModel(), ScriptedImageModel(), max_fps=0)
    with pytest.raises(ms.InvalidArgumentError, match="prompt_style"):
        create_demo(ScriptedTextModel(), ScriptedImageModel(), prompt_style="poetic")
    with pytest.raises(ms.InvalidArgumentError, match="path"):
        mount_demo(object(), ScriptedTextModel(), ScriptedImageModel(), path="demo")


def test_every_handler_gets_the_session_request() -> None:
    """Gradio passes gr.Request only when it can resolve ALL of a handler's annotations (else it
    silently passes none): every tab handler that takes ``request`` must resolve it."""
    import inspect

    import gradio as gr
    from gradio.utils import get_type_hints

    demo = create_demo(ScriptedTextModel(), ScriptedImageModel())
    handlers = [f.fn for f in demo.fns.values() if f.fn is not None]
    with_request = [fn for fn in handlers if "request" in inspect.signature(fn).parameters]
    assert len(with_request) >= 10, handlers
    for fn in with_request:
        assert get_type_hints(fn).get("request") is gr.Request, fn


def test_mount_demo_serves_the_page_from_a_fastapi_app() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = mount_demo(FastAPI(), lambda: ScriptedTextModel(), ScriptedImageModel(), path="/demo")  # a provider works too
    with TestClient(app) as client:
        page = client.get("/demo/")
        assert page.status_code == 200 and "gradio" in page.text.lower()
        config = client.get("/demo/config").json()
        assert any(d.get("api_name") == "image" for d in config["dependencies"])


class _QueuedTextModel:
    """Stands in for the server's gated model (`GatedModel`): its stream first waits for a slot,
    keeping ``queue_position`` = (position, waiting in all) up to date, then runs ``inner``."""

    def __init__(self, inner: ScriptedTextModel, places: list[tuple[int, int]], hold_s: float = 0.8) -> None:
        self.inner, self.places, self.hold_s = inner, places, hold_s

    def stream(self, prompt, **kwargs):  # type: ignore[no-untyped-def]
        import threading

        from multistream.stream import Stream

        made = threading.Event()
        box: list = []

        def producer(w) -> None:  # type: ignore[no-untyped-def]
            made.wait(10)
            for place in self.places:
                box[0].queue_position = place
                time.sleep(self.hold_s)
            box[0].queue_position = None
            for ev in self.inner.stream(prompt, **kwargs):
                w.forward(ev)

        stream = Stream(producer, kind="text")
        stream.queue_position = None  # type: ignore[attr-defined]
        box.append(stream)
        made.set()
        return stream


def test_chat_says_where_a_queued_request_stands() -> None:
    llm = _QueuedTextModel(ScriptedTextModel(delay_s=0.02), [(3, 4), (1, 2)])
    demo = create_demo(llm, ScriptedImageModel(steps=2), max_fps=50, speech_model=False)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
        job = client.submit("hello", [], 16, 0.0, 1.0, -1, api_name="/chat")
        _wait_done(job)
        stats = [o[2] for o in job.outputs()]
        assert "waiting: 2 ahead" in stats and "waiting: next in line" in stats, stats
        assert stats.index("waiting: 2 ahead") < stats.index("waiting: next in line")
        assert "TTFT" in stats[-1]  # then it ran as usual
    finally:
        demo.close()
