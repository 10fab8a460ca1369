"""The demo's Video tab on scripted models, through gradio_client: previews then the clip, Use this,
Stop, Apply now, the queue place, and "Write and film" (the LLM writes the prompt, one stream)."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from multistream.events import VideoEvent
from multistream.stream import Stream
from multistream.testing import ScriptedImageModel, ScriptedTextModel, ScriptedVideoModel
from multistream.ui.demo import create_demo
from multistream.ui.demo._prompts import shapes_video_pattern, video_prompt_messages
from multistream.ui.view import LiveView

gradio_client = pytest.importorskip("gradio_client")

WEBP = re.compile(r'src="data:image/webp;base64,([^"]+)"')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(condition: Any, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _reached(job: Any, total: int, step: int) -> bool:
    """Whether the page has shown a preview of step ``step`` of ``total`` or later."""
    done = [int(m) for o in job.outputs() for m in re.findall(rf">step (\d+)/{total} ", o[0] if isinstance(o[0], str) else "")]
    return bool(done) and max(done) >= step


def _launch(video_model: Any, text_model: Any = None) -> Any:
    demo = create_demo(text_model or ScriptedTextModel(delay_s=0.01), ScriptedImageModel(steps=2), max_fps=50,
                       speech_model=False, video_model=video_model)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    demo.url = f"http://127.0.0.1:{port}/"
    return demo


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, ScriptedVideoModel]]:
    vm = ScriptedVideoModel(steps=8, num_frames=8, size=32, delay_s=0.03)
    llm = ScriptedTextModel(["a green ", "star moving", " up on a black", " background"], delay_s=0.02)
    demo = _launch(vm, llm)
    try:
        yield demo.url, vm
    finally:
        demo.close()


def test_video_endpoints_are_named(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert {"/video", "/stop_video", "/finish_video", "/steer_video", "/write_and_film"} <= names


def test_video_streams_every_frame_per_step_then_the_clip(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("a red circle moving right on a blue background", 8, 8, 0, "tiny", "webp", api_name="/video")
    _until(job.done, what="the clip")
    outputs = job.outputs()
    previews = [o[0] for o in outputs if WEBP.search(o[0]) and ">step " in o[0]]
    assert previews, outputs[-1]
    for box in previews:
        data = WEBP.search(box).group(1)  # type: ignore[union-attr]
        import base64

        ev = VideoEvent(stream_id="s", seq=0, t=0, step=1, total_steps=8, num_frames=8, fps=8, width=32, height=32,
                        mime="image/webp", data=base64.b64decode(data))
        assert len(ev.frames) == 8  # the box shows every frame (an animated WebP)
        assert re.search(r">step \d/8 · (estimating time left|about [\d.]+ s left) · ", box), box
    last_box, clip = outputs[-1]
    assert "done · 8/8 steps" in last_box and "8 frames 32x32 at 8 fps · WEBM" in last_box
    path = clip["video"] if isinstance(clip, dict) else clip
    assert path.endswith(".webm") and os.path.getsize(path) > 0
    import av

    with av.open(path) as container:
        assert sum(1 for _ in container.decode(video=0)) == 8


def test_contact_sheet_preview(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("a red circle", 2, 4, 0, "latent", "sheet", api_name="/video")
    _until(job.done, what="the clip")
    assert any("data:image/jpeg;base64," in o[0] for o in job.outputs())


def test_use_this_finishes_early_and_stop_cancels(served: tuple) -> None:
    _, vm = served
    client = gradio_client.Client(served[0], verbose=False)
    for button, reason, words in (("/finish_video", "finished_early", "stopped early"), ("/stop_video", "cancelled", "cancelled")):
        before = len(vm.finish_reasons)
        job = client.submit("a red circle", 100, 4, 0, "tiny", "webp", api_name="/video")
        _until(lambda: _reached(job, 100, 2), what="step 2")  # noqa: B023
        client.predict(api_name=button)
        _until(job.done, what="the end of the run")
        last_box, clip = job.outputs()[-1]
        assert last_box.split('class="ms-step"')[1].split(">", 1)[1].startswith(words), last_box
        _until(lambda: len(vm.finish_reasons) > before, what="the model thread to end")  # noqa: B023
        assert vm.finish_reasons[before:] == [reason]  # the model stopped, not just the page
        if reason == "finished_early":
            assert clip  # the clip as it was
        else:
            assert clip is None and WEBP.search(last_box)  # cancelled: no clip; its newest preview stays in the box


def _red_centres_x(path: str) -> list[float]:
    import av
    import numpy as np

    with av.open(path) as container:
        frames = [f.to_ndarray(format="rgb24").astype(int) for f in container.decode(video=0)]
    centres = []
    for rgb in frames:
        ys, xs = np.nonzero((rgb[..., 0] > 150) & (rgb[..., 2] < 100))
        centres.append(float(xs.mean()))
    return centres


def test_apply_now_steers_the_running_clip(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("a red circle moving right", 40, 6, 0, "tiny", "webp", api_name="/video")
    _until(lambda: _reached(job, 40, 1), what="step 1")
    client.predict("a red circle moving left", api_name="/steer_video")
    _until(job.done, what="the end of the run")
    last_box, clip = job.outputs()[-1]
    assert "done · 40/40 steps" in last_box
    xs = _red_centres_x(clip["video"] if isinstance(clip, dict) else clip)
    assert xs == sorted(xs, reverse=True) and xs[0] - xs[-1] > 4  # it moves left now, as steered
    with pytest.raises(Exception, match="nothing is being filmed"):
        client.predict("a red circle moving left", api_name="/steer_video")


def test_write_and_film_is_one_composed_stream(served: tuple) -> None:
    client = gradio_client.Client(served[0], verbose=False)
    job = client.submit("a kite rising", 4, 4, 0, "tiny", "webp", api_name="/write_and_film")
    _until(job.done, what="the clip")
    outputs = job.outputs()
    written = [o[0] for o in outputs if o[0]]
    assert len(set(written)) >= 2  # the prompt grew live in the prompt box
    assert written[-1] == "a green star moving up on a black background"
    assert any("the LLM is writing" in o[1] for o in outputs)
    assert outputs[-1][2] and "done · 4/4 steps" in outputs[-1][1]


def test_the_llm_is_held_to_what_the_video_model_can_film() -> None:
    import multistream._shapes as shapes

    if not hasattr(shapes, "MOTIONS"):
        pytest.skip("the embedded video model's vocabulary (multistream._shapes.MOTIONS) has not landed yet")
    pattern = re.compile(shapes_video_pattern())
    assert pattern.fullmatch("a red circle moving right on a blue background")
    assert pattern.fullmatch("a small yellow star moving down on a black background")
    assert not pattern.fullmatch("a red circle on a blue background")  # a clip needs a motion
    assert not pattern.fullmatch("a red circle moving sideways on a blue background")
    msgs = video_prompt_messages("a falling leaf", "shapes")
    assert all(pattern.fullmatch(m["content"]) for m in msgs if m["role"] == "assistant")
    assert video_prompt_messages("x", "free")[-1] == {"role": "user", "content": "x"}


class _QueuedVideoModel:
    """Stands in for the server's gated model: its stream first waits for a slot, keeping
    ``queue_position`` = (position, waiting in all) up to date (each place held until the test has
    seen it on the page), then runs ``inner``."""

    def __init__(self, inner: ScriptedVideoModel, places: list[tuple[int, int]]) -> None:
        self.inner, self.places = inner, places
        self.seen = [threading.Event() for _ in places]
        self.default_num_frames = inner.default_num_frames

    def stream(self, prompt: str, **kwargs: Any) -> Stream:
        made = threading.Event()
        box: list[Stream] = []

        def producer(w: Any) -> None:
            made.wait(10)
            for place, seen in zip(self.places, self.seen):
                box[0].queue_position = place  # type: ignore[attr-defined]
                seen.wait(30)
            box[0].queue_position = None  # type: ignore[attr-defined]
            for ev in self.inner.stream(prompt, **kwargs):
                w.forward(ev, is_final=ev.is_final)

        stream = Stream(producer, kind="video")
        stream.queue_position = None  # type: ignore[attr-defined]
        box.append(stream)
        made.set()
        return stream


def test_video_says_where_a_queued_request_stands() -> None:
    vm = _QueuedVideoModel(ScriptedVideoModel(steps=3, num_frames=4, size=16), [(3, 4), (1, 2)])
    demo = _launch(vm)
    try:
        client = gradio_client.Client(demo.url, verbose=False)
        job = client.submit("a red circle", 3, 4, 0, "tiny", "webp", api_name="/video")
        for note, seen in zip(("waiting: 2 ahead", "waiting: next in line"), vm.seen):
            _until(lambda: any(note in o[0] for o in job.outputs()), what=note)  # noqa: B023
            seen.set()
        _until(job.done, what="the clip")
        assert "done · 3/3 steps" in job.outputs()[-1][0]
    finally:
        demo.close()


def test_view_of_a_video_stream_keeps_the_clip_apart_from_images() -> None:
    view = LiveView()
    for ev in ScriptedVideoModel(steps=2, num_frames=4, size=16).stream("a red circle"):
        view.apply(ev)
    assert not view.images and view.videos[0].final


@pytest.mark.model
def test_video_tab_on_a_real_video_model() -> None:
    """The tab on a real `VideoModel` (a tiny random Wan 2.1 pipeline): its frame count is the slider's
    default, and the slider offers only the counts its VAE makes."""
    from multistream.testing._random_video import tiny_wan_pipeline
    from multistream.video import load_video_model

    vm = load_video_model(tiny_wan_pipeline(), defaults={"num_frames": 9, "height": 16, "width": 16})
    demo = _launch(vm)
    try:
        # Wan's causal VAE makes 1 + 4k frames: the slider offers only those.
        frames = next(c for c in demo.blocks.values() if getattr(c, "elem_id", None) == "ms-video-frames")
        assert (frames.minimum, frames.step, frames.maximum, frames.value) == (1, 4, 61, 9)
        client = gradio_client.Client(demo.url, verbose=False)
        job = client.submit("a red circle moving right", 3, vm.default_num_frames, 0, "latent", "sheet",
                            api_name="/video")
        _until(job.done, timeout=300, what="the clip")
        outputs = job.outputs()
        assert any("data:image/jpeg;base64," in o[0] for o in outputs)  # contact sheets of every frame
        last_box, clip = outputs[-1]
        assert "done · 3/3 steps" in last_box and "9 frames 16x16" in last_box
        path = clip["video"] if isinstance(clip, dict) else clip
        assert path.endswith(".webm") and os.path.getsize(path) > 0
    finally:
        demo.close()
        vm.close()


def test_the_embedded_video_model_is_loaded_at_first_use_or_its_absence_is_said(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import multistream.video
    from multistream.ui.demo._page import _video_slot

    assert _video_slot(False) is None  # no Video tab
    monkeypatch.setattr(multistream.video, "EMBEDDED_VIDEO_DIR", tmp_path)
    slot = _video_slot(None)
    assert slot is not None and slot.missing and "not installed" in slot.why  # the tab says why
    (tmp_path / "model_index.json").write_text("{}")
    slot = _video_slot(None)
    assert slot is not None and not slot.missing and callable(slot.model)  # loaded at the first request
    demo = create_demo(ScriptedTextModel(), ScriptedImageModel(steps=2), speech_model=False, video_model=False)
    assert not any(d.get("api_name") == "video" for d in demo.config["dependencies"])
