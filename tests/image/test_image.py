"""The diffusers adapter end to end, on a tiny random-weight Stable Diffusion pipeline built here.

Random weights make noise, not pictures, but every code path is the real one: the pipeline's own
denoising loop, its step callback, its scheduler, its VAE.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import multistream as ms
from multistream.image import ImageModel
from multistream.testing import _random_pipelines as rp


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP spinning
    makes them many times slower. (Other image test modules import this autouse fixture.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sd() -> ImageModel:
    return ms.load_image_model(rp.tiny_sd_pipeline(scheduler="ddim"))


def _pace(seconds: float = 0.02):
    """A user step callback that slows the pipeline a little."""

    def callback(pipe, i, t, kwargs):
        time.sleep(seconds)
        return kwargs

    return callback


class Lockstep:
    """Holds the pipeline, after each step that made a preview, until the consumer has that
    preview, so no preview is skipped however busy the machine is (the Stream itself never makes
    the model wait: tests that count previews need this, production does not).

    Pass ``callback`` as ``callback_on_step_end`` and read the stream with ``events(stream)``.
    """

    def __init__(self, every: int = 1, num_images: int = 1, timeout: float = 20.0) -> None:
        self.every, self.num_images, self.timeout = every, num_images, timeout
        self._seen: dict[int, int] = {}
        self._cond = threading.Condition()

    def callback(self, pipe, i, t, kwargs):
        step = i + 1
        if (step - 1) % self.every == 0:
            with self._cond:
                self._cond.wait_for(
                    lambda: all(self._seen.get(k, 0) >= step for k in range(self.num_images)), self.timeout
                )
        return kwargs

    def seen(self, ev) -> None:
        if ev.type == "image" and not ev.is_final:
            with self._cond:
                self._seen[ev.index] = max(self._seen.get(ev.index, 0), ev.step)
                self._cond.notify_all()

    def events(self, stream) -> list:
        out = []
        for ev in stream:
            self.seen(ev)
            out.append(ev)
        return out


def cancel_at(step: int):
    """A step callback that cancels its stream at ``step`` (set ``callback.stream`` first)."""

    def callback(pipe, i, t, kwargs):
        if i + 1 == step:
            callback.stream.cancel()
        return kwargs

    return callback


def _previews(events):
    return [e for e in events if not e.is_final]


class _DecodeSpy:
    def __init__(self, vae) -> None:
        self.vae = vae
        self.calls = 0

    def __enter__(self):
        original = self.vae.decode

        def decode(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        self.vae.decode = decode
        return self

    def __exit__(self, *exc):
        del self.vae.decode


# --- the happy path -----------------------------------------------------------------------------


def test_previews_in_step_order_then_full_size_final(sd: ImageModel) -> None:
    lock = Lockstep()
    events = lock.events(sd.stream("a red circle", steps=7, seed=0, preview="latent", callback_on_step_end=lock.callback))
    previews, final = _previews(events), events[-1]
    assert [e.step for e in previews] == [1, 2, 3, 4, 5, 6, 7]
    assert all(e.total_steps == 7 and e.type == "image" and e.mime == "image/jpeg" for e in previews)
    assert all(e.image.size == (e.width, e.height) == (32, 32) for e in previews)  # 64 px / VAE factor 2
    assert [e.seq for e in events] == list(range(len(events)))
    assert all(a.t <= b.t for a, b in zip(events, events[1:]))
    # The final event is the last one, and it is the full-size image, losslessly encoded.
    assert final.is_final and sum(e.is_final for e in events) == 1
    assert (final.step, final.total_steps, final.finish_reason) == (7, 7, "stop")
    assert final.mime == "image/png" and final.image.format == "PNG"
    assert final.image.size == (final.width, final.height) == (64, 64)
    m = final.metrics
    assert m["steps"] == 7 and m["previews"] == 7 and m["previews_dropped"] == 0 and m["seed"] == 0
    for key in ("duration_ms", "ms_per_step", "time_to_first_preview_ms", "preview_ms", "encode_ms", "preview_bytes", "decode_ms"):
        assert m[key] >= 0, key
    assert ms.event_from_dict(final.to_dict()) == final


def test_final_matches_the_plain_pipeline_call(sd: ImageModel) -> None:
    final = sd.generate("a red circle", steps=4, seed=3, preview="x0")
    plain = sd.pipeline("a red circle", num_inference_steps=4, generator=torch.Generator().manual_seed(3)).images[0]
    assert np.array_equal(np.asarray(final.image.convert("RGB")), np.asarray(plain))
    assert "step" not in vars(sd.pipeline.scheduler)  # the x0 wrapper is gone after the run


def test_x0_tracking_keeps_ancestral_samplers_seeded() -> None:
    # Pipelines pass ``generator`` to scheduler.step only if its signature has it; the x0 wrapper
    # must keep that signature, or an ancestral sampler's noise would no longer follow the seed.
    from diffusers import EulerAncestralDiscreteScheduler

    pipe = rp.tiny_sd_pipeline()
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    model = ImageModel(pipe)
    final = model.generate("a red circle", steps=4, seed=5, preview="x0")
    plain = pipe("a red circle", num_inference_steps=4, generator=torch.Generator().manual_seed(5)).images[0]
    assert np.array_equal(np.asarray(final.image.convert("RGB")), np.asarray(plain))


@pytest.mark.parametrize(("every", "expected"), [(1, [1, 2, 3, 4, 5, 6, 7]), (2, [1, 3, 5, 7]), (3, [1, 4, 7]), (10, [1])])
def test_preview_every_gives_ceil_steps_over_k(sd: ImageModel, every: int, expected: list[int]) -> None:
    lock = Lockstep(every)
    events = lock.events(sd.stream("a red circle", steps=7, seed=1, preview_every=every, callback_on_step_end=lock.callback))
    assert [e.step for e in _previews(events)] == expected
    assert len(expected) == -(-7 // every)
    assert events[-1].metrics["previews"] == len(expected)


@pytest.mark.parametrize("preview", ["vae", "x0+vae"])
def test_previews_approach_the_final_image(sd: ImageModel, preview: str) -> None:
    # Decoded with the pipeline's own VAE, each step's latent is nearer the final one than the
    # step before: the scheduler walks the latent to its end point whatever the (random) model
    # predicts, and the decoder is continuous. PNG previews at full size: no codec noise.
    lock = Lockstep()
    events = lock.events(
        sd.stream("a blue square", steps=8, seed=0, preview=preview, preview_format="png", preview_max_side=None,
                  callback_on_step_end=lock.callback)
    )  # fmt: skip
    final = np.asarray(events[-1].image.convert("RGB"), dtype=np.float32)
    distances = [float(np.abs(np.asarray(e.image.convert("RGB"), dtype=np.float32) - final).mean()) for e in _previews(events)]
    assert len(distances) == 8
    assert distances[0] > 2.0
    for before, after in zip(distances, distances[1:]):
        assert after < before or after < 0.05, distances
    assert distances[-1] < 0.05  # the last step's latent is the final latent


def test_preview_size_and_formats(sd: ImageModel) -> None:
    events = list(sd.stream("x", steps=2, seed=0, preview="vae", preview_format="webp", preview_max_side=16,
                            final_format="jpeg", callback_on_step_end=_pace()))  # fmt: skip
    assert all(e.mime == "image/webp" and e.image.size == (16, 16) for e in _previews(events))
    assert events[-1].mime == "image/jpeg" and events[-1].image.size == (64, 64)


def test_batch_of_images(sd: ImageModel) -> None:
    lock = Lockstep(num_images=2)
    events = lock.events(sd.stream("x", steps=3, seed=0, num_images=2, callback_on_step_end=lock.callback))
    previews = _previews(events)
    done = [e for e in events if e.finish_reason is not None]
    assert sorted((e.index, e.step) for e in previews if e.finish_reason is None) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert [(e.index, e.is_final, e.finish_reason) for e in done] == [(0, False, "stop"), (1, True, "stop")]
    assert events[-1] is done[-1] and done[0].image.size == (64, 64)
    assert not np.array_equal(np.asarray(done[0].image), np.asarray(done[1].image))


async def test_async_iteration(sd: ImageModel) -> None:
    steps = []
    lock = Lockstep()
    async for ev in sd.stream("x", steps=3, seed=0, callback_on_step_end=lock.callback):
        lock.seen(ev)
        steps.append((ev.step, ev.is_final))
        await asyncio.sleep(0)
    assert steps == [(1, False), (2, False), (3, False), (3, True)]


def test_taesd_preview_with_random_weights(sd: ImageModel) -> None:
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    taesd = AutoencoderTiny(
        encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8), num_encoder_blocks=(1, 1),
        num_decoder_blocks=(1, 1), latent_channels=4,
    )  # fmt: skip
    with _DecodeSpy(sd.pipeline.vae) as vae_spy, _DecodeSpy(taesd) as taesd_spy:
        lock = Lockstep()
        events = lock.events(sd.stream("x", steps=3, seed=0, preview="taesd", taesd=taesd, callback_on_step_end=lock.callback))
    assert [e.step for e in _previews(events)] == [1, 2, 3]
    assert taesd_spy.calls == 3 and vae_spy.calls == 1  # TAESD for previews, the VAE only for the final
    assert events[-1].image.size == (64, 64)


# --- cancel, errors, backpressure ---------------------------------------------------------------


def test_cancel_stops_within_one_step_without_final_decode(sd: ImageModel) -> None:
    cancel = cancel_at(3)
    with _DecodeSpy(sd.pipeline.vae) as spy:
        cancel.stream = sd.stream("x", steps=50, seed=0, preview="latent", callback_on_step_end=cancel)
        events = list(cancel.stream)
    final = events[-1]
    assert final.is_final and final.finish_reason == "cancelled"
    assert final.metrics["steps"] == 4  # step 4's callback saw the request and stopped the run
    assert spy.calls == 0  # no final VAE decode, and no decode for the cancelled frame either
    # The cancelled final shows the newest preview (a cheap latent render, preview-sized).
    assert final.step == 3 and final.total_steps == 50 and final.mime == "image/jpeg"
    assert final.image.size == (32, 32)


def test_cancel_from_the_consumer_ends_quickly(sd: ImageModel) -> None:
    with _DecodeSpy(sd.pipeline.vae) as spy:
        stream = sd.stream("x", steps=200, seed=0, preview="x0", callback_on_step_end=_pace(0.01))
        cancelled_at = None
        events = []
        for ev in stream:
            events.append(ev)
            if cancelled_at is None and ev.step >= 2:
                stream.cancel()
                cancelled_at = time.perf_counter()
        waited = time.perf_counter() - cancelled_at
    assert events[-1].finish_reason == "cancelled" and events[-1].metrics["steps"] < 100
    assert spy.calls == 0
    assert waited < 5.0
    assert "step" not in vars(sd.pipeline.scheduler)


def test_cancel_before_any_preview_renders_the_latents_cheaply(sd: ImageModel) -> None:
    cancel = cancel_at(1)
    with _DecodeSpy(sd.pipeline.vae) as spy:
        cancel.stream = sd.stream("x", steps=10, seed=0, preview="none", callback_on_step_end=cancel)
        events = list(cancel.stream)
    assert len(events) == 1 and events[0].finish_reason == "cancelled" and spy.calls == 0
    assert events[0].step == 2 and events[0].image.size == (32, 32)


def test_pipeline_error_becomes_an_error_event(sd: ImageModel) -> None:
    def explode(pipe, i, t, kwargs):
        if i == 1:
            raise ValueError("the UNet caught fire")
        return kwargs

    stream = sd.stream("x", steps=5, seed=0, preview="x0", callback_on_step_end=explode)
    events = list(stream)
    assert events[-1].type == "error" and events[-1].is_final
    assert events[-1].error == {"type": "ValueError", "message": "the UNet caught fire"}
    assert isinstance(stream.exception, ValueError)
    assert all(e.type == "image" and not e.is_final for e in events[:-1])
    assert "step" not in vars(sd.pipeline.scheduler)
    assert sd.generate("x", steps=2, seed=0).finish_reason == "stop"  # the model still works


def test_slow_consumer_gets_newest_preview_and_final(sd: ImageModel) -> None:
    stream = sd.stream("x", steps=6, seed=0, preview="latent")
    assert stream.join(timeout=120)  # the producer never waited for us: everything is queued
    events = list(stream)
    assert [(e.step, e.is_final) for e in events] == [(6, False), (6, True)]
    assert [e.seq for e in events] == [0, 1]


def test_one_run_at_a_time(sd: ImageModel) -> None:
    first = sd.stream("x", steps=4, seed=0, callback_on_step_end=_pace())
    second = sd.stream("x", steps=4, seed=0, callback_on_step_end=_pace())
    a, b = list(first), list(second)
    assert a[-1].finish_reason == b[-1].finish_reason == "stop"
    assert a[-1].data == b[-1].data  # same seed, same image: the runs did not interleave


def test_cancel_while_waiting_for_the_model(sd: ImageModel) -> None:
    first = sd.stream("x", steps=30, seed=0, callback_on_step_end=_pace())
    second = sd.stream("x", steps=30, seed=0)
    second.cancel()
    events = list(second)
    assert [(e.step, e.finish_reason) for e in events] == [(0, "cancelled")]
    first.cancel()
    assert list(first)[-1].finish_reason == "cancelled"


# --- x0 fallback ----------------------------------------------------------------------------------


class OpaqueScheduler:
    """A scheduler that tells nothing about x0: no alphas, no sigmas, no pred_original_sample."""

    order = 1
    init_noise_sigma = 1.0

    def __init__(self, inner) -> None:
        self._inner = inner
        self.config = SimpleNamespace(prediction_type="mystery", steps_offset=1)

    @property
    def timesteps(self):
        return self._inner.timesteps

    def set_timesteps(self, num_inference_steps, device=None):
        self._inner.set_timesteps(num_inference_steps, device=device)

    def scale_model_input(self, sample, timestep=None):
        return sample

    def step(self, model_output, timestep, sample, return_dict=True, **kwargs):
        prev = self._inner.step(model_output, timestep, sample, return_dict=False)[0]
        return (prev,) if not return_dict else SimpleNamespace(prev_sample=prev)


def test_x0_falls_back_to_the_noisy_latent_with_one_warning() -> None:
    from diffusers import DDIMScheduler

    pipe = rp.tiny_sd_pipeline()
    inner = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False)
    object.__setattr__(pipe, "scheduler", OpaqueScheduler(inner))
    model = ImageModel(pipe)
    with pytest.warns(UserWarning, match="shows the noisy latent instead"):
        lock = Lockstep()
        events = lock.events(model.stream("x", steps=3, seed=0, preview="x0", callback_on_step_end=lock.callback))
    assert [e.step for e in _previews(events)] == [1, 2, 3]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model and scheduler, not every stream
        model.stream("x", steps=1, seed=0, preview="x0").wait()


# --- bad input, loading -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps must be an integer from 1 to 1000"),
        ({"steps": -3}, "steps must be"),
        ({"steps": 2.5}, "steps must be"),
        ({"height": 33}, "height=33 is not a multiple of 8"),
        ({"width": 0}, "width must be a positive integer"),
        ({"preview": "blurry"}, "unknown preview='blurry'"),
        ({"preview_format": "gif"}, "unknown preview_format 'gif'"),
        ({"final_format": "bmp"}, "unknown final_format 'bmp'"),
        ({"preview_quality": 0}, "preview_quality must be an integer from 1 to 100"),
        ({"preview_quality": 101}, "preview_quality must be"),
        ({"preview_every": 0}, "preview_every must be an integer >= 1"),
        ({"num_images": 0}, "num_images must be an integer >= 1"),
        ({"preview": "taesd"}, "preview='taesd' needs TAESD weights"),
        ({"preview_max_side": 0}, "preview_max_side must be"),
        ({"seed": -1}, "seed must be"),
        ({"guidance_scale": "high"}, "guidance_scale must be a number"),
        ({"no_such_arg": 1}, "takes no 'no_such_arg' argument"),
        ({"output_type": "latent"}, "output_type='latent' is not supported"),
        ({"num_inference_steps": 5}, "use steps="),
        ({"generator": torch.Generator(), "seed": 1}, "either seed= or generator="),
    ],
)
def test_bad_arguments_raise_at_call_time(sd: ImageModel, kwargs: dict, match: str) -> None:
    with pytest.raises(ms.InvalidArgumentError, match=match):
        sd.stream("a red circle", **kwargs)


def test_bad_prompt_and_taesd(sd: ImageModel, tmp_path) -> None:
    with pytest.raises(ms.InvalidArgumentError, match="prompt must be a string"):
        sd.stream(123)  # type: ignore[arg-type]
    with pytest.raises(ms.ModelLoadError, match="TAESD"):
        sd.stream("x", preview="taesd", taesd=str(tmp_path / "nope"))
    with pytest.raises(ms.InvalidArgumentError, match="ImageModel wraps a diffusers pipeline"):
        ImageModel("some/path")
    with pytest.raises(ms.InvalidArgumentError, match="needs a diffusers pipeline"):
        ImageModel(object())


def test_load_existing_pipeline_keeps_it(sd: ImageModel) -> None:
    model = ms.load_image_model(sd.pipeline)
    assert model.pipeline is sd.pipeline and model.device.type == "cpu" and model.dtype == torch.float32
    assert model.family == "sd15" and model.latent_rgb.source == "published:sd15"
    assert "ImageModel" in repr(model)


def test_hub_id_without_network_says_pass_a_folder(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ms.ModelLoadError, match="pass it: ms.load_image_model"):
        ms.load_image_model("someone/some-model-that-is-not-cached", device="cpu")


def test_single_file_is_refused_clearly(tmp_path) -> None:
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"x")
    with pytest.raises(ms.ModelLoadError, match="single file"):
        ms.load_image_model(str(ckpt), device="cpu")


def test_no_embedded_model_is_a_clear_error(monkeypatch, tmp_path) -> None:
    import multistream.image._loading as loading

    monkeypatch.setattr(loading, "EMBEDDED_MODEL_DIR", tmp_path / "shapes")
    with pytest.raises(ms.ModelLoadError, match="embedded image model is not installed"):
        ms.load_image_model()


# --- from a folder, and the command line ------------------------------------------------------------


@pytest.fixture(scope="module")
def sd_folder(sd: ImageModel, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd")
    sd.pipeline.save_pretrained(folder)
    (folder / "latent_rgb.json").write_text(json.dumps({"matrix": [[0.5, 0.5, 0.5]] * 4, "bias": [0, 0, 0]}))
    return folder


def test_load_from_folder_uses_its_latent_rgb(sd_folder) -> None:
    model = ms.load_image_model(str(sd_folder), device="cpu")
    assert model.latent_rgb.source.startswith("file:")
    assert model.generate("x", steps=2, seed=0).image.size == (64, 64)


def test_cli_writes_previews_and_final(sd_folder, tmp_path, capsys) -> None:
    from multistream.cli import main

    out = tmp_path / "out"
    code = main(["image", "a red circle", "--out", str(out), "--steps", "3", "--seed", "0", "--model", str(sd_folder),
                 "--device", "cpu", "--max-side", "16"])  # fmt: skip
    assert code == 0
    names = {p.name for p in out.iterdir()}
    steps = names - {"final.png"}
    assert "final.png" in names and steps and steps <= {"step_001.jpg", "step_002.jpg", "step_003.jpg"}
    assert Image.open(out / "final.png").size == (64, 64)
    assert Image.open(out / sorted(steps)[0]).size == (16, 16)
    err = capsys.readouterr().err
    assert "/3  " in err and "ms/step" in err and "done: 64x64 image/png" in err


def test_cli_json_prints_wire_events(sd_folder, capsys) -> None:
    from multistream.cli import main

    code = main(["image", "x", "--steps", "2", "--seed", "0", "--model", str(sd_folder), "--device", "cpu", "--json",
                 "--preview", "x0", "--format", "png"])  # fmt: skip
    assert code == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    events = [ms.event_from_json(line) for line in lines]
    assert events[-1].is_final and events[-1].mime == "image/png" and events[0].step == 1
    assert Image.open(io.BytesIO(events[-1].data)).size == (64, 64)


def test_cli_bad_argument_is_reported(sd_folder, capsys) -> None:
    from multistream.cli import main

    assert main(["image", "x", "--model", str(sd_folder), "--device", "cpu", "--steps", "0"]) == 2
    assert "steps must be an integer from 1 to 1000" in capsys.readouterr().err
