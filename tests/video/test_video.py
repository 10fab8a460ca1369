"""The video model's machinery on random-weight pipelines: cancel, finish_early, steer, priority,
newest-preview-only backpressure, the engine base, loading errors."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

import multistream as ms
from multistream.engine import EngineModel
from multistream.errors import InvalidArgumentError, ModelLoadError, StreamFinishedError
from multistream.events import VideoEvent
from multistream.stream import MergeKey, Stream
from multistream.testing._random_video import RANDOM_VIDEO_FAMILIES, tiny_video_pipeline
from multistream.video import VideoModel

WAN = RANDOM_VIDEO_FAMILIES["wan"][1]
ANIMATEDIFF = RANDOM_VIDEO_FAMILIES["animatediff"][1]


@pytest.fixture(scope="module")
def wan():
    vm = VideoModel(tiny_video_pipeline("wan"))
    yield vm
    vm.close()


@pytest.fixture(scope="module")
def animatediff():
    vm = VideoModel(tiny_video_pipeline("animatediff"))
    yield vm
    vm.close()


@pytest.fixture(scope="module")
def animatediff_sdxl():
    vm = VideoModel(tiny_video_pipeline("animatediff_sdxl"))
    yield vm
    vm.close()


@contextlib.contextmanager
def engine_busy(vm: VideoModel):
    """Hold the model's engine between two steps while the block runs: what the block sends
    (requests, cancels, steers) is all there at the engine's next step, whatever the machine's speed."""
    gate = threading.Event()
    blocker = threading.Thread(target=vm.engine.run_on_engine, args=(gate.wait,))
    blocker.start()
    try:
        yield
    finally:
        gate.set()
        blocker.join()


def _pixels(ev: VideoEvent) -> np.ndarray:
    return np.stack([np.asarray(f, dtype=np.float64) for f in ev.frames])


def test_cancel_stops_within_a_step_and_ends_with_the_newest_preview(wan):
    s = wan.stream("x", steps=40, seed=0, preview="vae", **WAN)
    first = next(s)
    s.cancel()
    rest = list(s)
    final = rest[-1]
    assert final.is_final and final.finish_reason == "cancelled"
    assert final.mime == "image/webp" and len(final.frames) == WAN["num_frames"]
    assert final.metrics["steps"] < 40
    assert first.step >= 1


def test_cancel_before_the_first_step(wan):
    with engine_busy(wan):
        s = wan.stream("x", steps=5, seed=0, preview="vae", **WAN)
        s.cancel()
    events = list(s)
    assert len(events) == 1 and events[0].finish_reason == "cancelled" and events[0].metrics["steps"] == 0


def test_finish_early_gives_the_current_estimate_through_the_full_vae(wan):
    s = wan.stream("x", steps=30, seed=0, preview="vae", preview_max_side=None, **WAN)
    events = []
    for ev in s:
        events.append(ev)
        if ev.step == 2 and not ev.is_final:
            s.finish_early()
    final = events[-1]
    assert final.finish_reason == "finished_early" and final.mime == "video/webm"
    assert 2 <= final.metrics["steps"] < 30
    assert len(final.frames) == WAN["num_frames"]
    # The clip is the estimate the last preview showed (same VAE decode; only the codecs differ).
    last_preview = [e for e in events if not e.is_final][-1]
    assert last_preview.step == final.metrics["steps"]
    assert np.abs(_pixels(last_preview) - _pixels(final)).mean() < 12.0


def test_generate_returns_the_final_with_its_seed(wan):
    seen: list[VideoEvent] = []
    final = wan.generate("a red circle", steps=3, seed=5, preview="latent", on_event=seen.append, **WAN)
    assert final is seen[-1] and final.is_final and final.metrics["seed"] == 5 and final.total_steps == 3
    assert final.metrics["previews"] == 3 and "ttfp_ms" in final.metrics


@pytest.mark.parametrize("fixture,call", [("wan", WAN), ("animatediff", ANIMATEDIFF),
                                          ("animatediff_sdxl", RANDOM_VIDEO_FAMILIES["animatediff_sdxl"][1])])
def test_steer_changes_the_conditioning_from_the_next_step(request, fixture, call):
    """Wan keeps negative and positive embeddings apart; AnimateDiff batches them; on SDXL every step
    also reads the pooled prompt (``add_text_embeds``): each steers."""
    vm = request.getfixturevalue(fixture)
    embeds: dict[int, object] = {}
    pooled: dict[int, object] = {}

    def spy(pipe, i, t, kwargs):
        embeds[int(i) + 1] = kwargs["prompt_embeds"].clone()
        if "add_text_embeds" in kwargs:
            pooled[int(i) + 1] = kwargs["add_text_embeds"].clone()
        return {}

    with engine_busy(vm):  # the steer waits for the run's first step, so it applies from step 2 on
        s = vm.stream("a red circle", steps=4, seed=1, guidance_scale=3.0, preview="vae", callback_on_step_end=spy,
                      **call)
        s.steer(prompt="a green square on a yellow background")
    s.wait()
    assert s.final.finish_reason == "stop" and s.final.metrics["steers"] == 1
    assert embeds[1].shape == embeds[2].shape
    assert not embeds[1].equal(embeds[2])  # step 2 ran on the new prompt
    assert embeds[2].equal(embeds[4])
    if fixture == "animatediff_sdxl":
        assert pooled[1].shape == pooled[2].shape and not pooled[1].equal(pooled[2]) and pooled[2].equal(pooled[4])
    with pytest.raises(StreamFinishedError):
        s.steer(prompt="too late")


def test_steer_checks_its_arguments(wan):
    s = wan.stream("x", steps=20, seed=0, preview="vae", **WAN)
    try:
        with pytest.raises(InvalidArgumentError, match="takes prompt, negative_prompt and guidance_scale"):
            s.steer(prompt="y", seed=3)
        with pytest.raises(InvalidArgumentError, match="takes keywords"):
            s.steer("make it blue")
    finally:
        s.cancel()
        list(s)


def test_higher_priority_takes_every_step_first(wan):
    with engine_busy(wan):  # both requests are there at the engine's next step
        low = wan.stream("low", steps=3, seed=0, preview="none", priority=0, **WAN)
        high = wan.stream("high", steps=6, seed=0, preview="none", priority=5, **WAN)
    order: list[str] = []
    lock = threading.Lock()

    def consume(name: str, s: Stream) -> None:
        s.wait()
        with lock:
            order.append(name)

    threads = [threading.Thread(target=consume, args=(n, s)) for n, s in (("low", low), ("high", high))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == ["high", "low"]


def test_a_slow_consumer_gets_the_newest_preview_only_and_the_final():
    def producer(w):
        for step in range(1, 6):
            w.emit(VideoEvent, step=step, total_steps=5, num_frames=2, fps=8.0, width=1, height=1, mime="image/webp",
                   data=bytes([step]))
        w.emit(VideoEvent, step=5, total_steps=5, num_frames=2, fps=8.0, width=1, height=1, mime="video/webm",
               data=b"clip", is_final=True, finish_reason="stop", metrics={})

    s = Stream(producer, kind="video")
    assert s.join(5.0)
    events = list(s)
    assert [(e.step, e.data, e.is_final) for e in events] == [(5, bytes([5]), False), (5, b"clip", True)]
    assert [e.seq for e in events] == [0, 1]


def test_merge_keys_are_named():
    assert MergeKey.preview("video", 1) != MergeKey.preview("image", 1)
    assert MergeKey.preview("video").is_preview and not MergeKey("text").is_preview


def test_every_engine_backed_model_shares_one_base(wan):
    from multistream.image import ImageModel
    from multistream.speech._model import SpeechModel
    from multistream.text import TextModel

    for cls in (TextModel, ImageModel, SpeechModel, VideoModel):
        assert issubclass(cls, EngineModel)
    with VideoModel(tiny_video_pipeline("cogvideox")) as vm:
        assert not vm.engine.closed
    assert vm.engine.closed
    with pytest.raises(ms.EngineClosedError):
        vm.stream("x", num_frames=9, height=16, width=16, max_sequence_length=16, preview="none")


def test_the_embedded_model_missing_is_a_clear_error(monkeypatch, tmp_path):
    from multistream.video import _loading

    monkeypatch.setattr(_loading, "EMBEDDED_VIDEO_DIR", tmp_path / "shapes_video")
    with pytest.raises(ModelLoadError, match="embedded video model is not installed"):
        ms.load_video_model()


def test_loading_a_video_folder_warns_of_nothing_deprecated(tmp_path):
    """diffusers deprecates ``torch_dtype=``; the image family passed ``dtype=`` and the video
    family still the old name, which printed a FutureWarning at every `multistream serve`."""
    import warnings

    tiny_video_pipeline("wan").save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vm = ms.load_video_model(tmp_path)
    vm.close()
    assert not [w for w in caught if "torch_dtype" in str(w.message)], [str(w.message) for w in caught]


def test_a_folder_and_its_video_json_defaults(tmp_path):
    pipe = tiny_video_pipeline("wan")
    pipe.save_pretrained(tmp_path)
    (tmp_path / "video.json").write_text('{"num_frames": 5, "fps": 12, "steps": 2, "width": 32, "height": 16}')
    vm = ms.load_video_model(str(tmp_path), device="cpu")
    try:
        assert (vm.default_num_frames, vm.default_fps, vm.default_steps, vm.default_size) == (5, 12.0, 2, (16, 32))
        assert vm.sizes.native == (16, 32) and vm.sizes.multiple == 16
        final = vm.generate("x", seed=0, preview="none")
        assert (final.num_frames, final.fps, final.total_steps, final.width, final.height) == (5, 12.0, 2, 32, 16)
    finally:
        vm.close()


def test_a_folder_ships_its_preview_maps_and_nothing_is_fitted(tmp_path):
    """A folder with a 3D video VAE may ship ``latent_rgb.json`` and ``preview_decoder.safetensors``
    (fitted once by whoever trained it): the model previews with them and fits nothing (a fit
    takes seconds on a first stream)."""
    from multistream.diffusion._latent_rgb import LatentRGB
    from multistream.video import VideoPreviewNet
    from multistream.video._tiny import cached_video_preview_decoder, save_video_preview_decoder

    pipe = tiny_video_pipeline("wan")
    pipe.save_pretrained(tmp_path)
    shipped = VideoPreviewNet(16, spatial=8, temporal=4, width=8, blocks=1)  # not what a fit would give
    save_video_preview_decoder(shipped, tmp_path / "preview_decoder.safetensors")
    LatentRGB(((0.5, 0.0, 0.0),) * 16, (0.1, 0.2, 0.3)).save(tmp_path / "latent_rgb.json")
    vm = ms.load_video_model(str(tmp_path), device="cpu")
    try:
        net = vm._tiny_net()
        assert all(a.equal(b) for a, b in zip(net.state_dict().values(), shipped.state_dict().values()))
        assert vm._latent_rgb() == LatentRGB.load(tmp_path / "latent_rgb.json")
        for mode in ("tiny", "latent"):
            events = list(vm.stream("x", num_frames=5, height=16, width=16, steps=2, seed=0, preview=mode,
                                    max_sequence_length=16))
            assert events[-1].finish_reason == "stop" and len(events[0].frames) == 5, mode
        assert cached_video_preview_decoder(vm.pipeline.vae) is None  # nothing was fitted
    finally:
        vm.close()
    # A file that is not a video decoder (an image model's, a damaged one) is fitted over, not trusted.
    (tmp_path / "preview_decoder.safetensors").write_bytes(b"not safetensors")
    vm = ms.load_video_model(str(tmp_path), device="cpu")
    try:
        assert isinstance(vm._tiny_net(), VideoPreviewNet) and cached_video_preview_decoder(vm.pipeline.vae) is not None
    finally:
        vm.close()


def test_wrapping_a_path_points_to_the_loader():
    with pytest.raises(InvalidArgumentError, match="ms.load_video_model"):
        VideoModel("./some/folder")


def test_a_preview_decoder_built_while_a_pipeline_loads_has_real_weights(monkeypatch, tmp_path):
    """diffusers' low-memory loading patches torch.nn.Module for the whole process while it builds
    (accelerate's init_empty_weights): a decoder built in another thread meanwhile got "meta"
    weights with no data, and a restarted server failed to continue an image so. Building waits."""
    import threading
    import time

    import accelerate
    import diffusers

    from multistream.video import VideoPreviewNet
    from multistream.video._tiny import load_video_preview_decoder, save_video_preview_decoder

    path = tmp_path / "preview_decoder.safetensors"
    save_video_preview_decoder(VideoPreviewNet(16, spatial=8, temporal=4, width=8, blocks=1), path)
    inside = threading.Event()

    def slow_low_memory_load(*args, **kwargs):
        with accelerate.init_empty_weights():
            inside.set()
            time.sleep(0.5)
        raise OSError("no pipeline here")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", slow_low_memory_load)
    refusals: list[BaseException] = []

    def load() -> None:
        try:
            ms.load_video_model()
        except ModelLoadError as exc:
            refusals.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        assert inside.wait(30)
        net = load_video_preview_decoder(path)
    finally:
        loader.join()
    assert net is not None and not any(p.is_meta for p in net.parameters())
    assert len(refusals) == 1  # the stand-in load ran, and failed as a load does


def test_a_folder_saved_without_a_required_component_loads(tmp_path):
    """AnimateDiffSDXLPipeline requires ``motion_adapter`` though a UNetMotionModel already holds the
    motion modules; diffusers saves it as ``[null, null]`` and then refuses the folder unless told
    ``motion_adapter=None``. load_video_model passes the folder's nulls back as None."""
    pipe = tiny_video_pipeline("animatediff_sdxl")
    pipe.register_modules(motion_adapter=None)  # what a trained model's folder holds: the UNet has the modules
    pipe.save_pretrained(tmp_path)
    vm = ms.load_video_model(tmp_path, device="cpu")
    try:
        assert type(vm.pipeline).__name__ == "AnimateDiffSDXLPipeline"
        final = vm.generate("a red circle", num_frames=4, height=16, width=16, steps=2, seed=0, preview="none")
        assert final.num_frames == 4
    finally:
        vm.close()
