"""Image steer: ``stream.steer(prompt=..., negative_prompt=..., guidance_scale=...)`` mid-run."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

import multistream as ms
from multistream.errors import InvalidArgumentError, StreamFinishedError
from multistream.testing._random_pipelines import tiny_flux_pipeline, tiny_sd_pipeline, tiny_sdxl_pipeline

from repo_paths import ROOT

BLUE = "a red circle on a blue background"
YELLOW = "a red circle on a yellow background"


def _steer_at(step: int, **changes):
    """A user callback that steers its own stream after ``step`` steps (deterministic timing)."""
    holder: dict = {}

    def callback(pipe, i, t, kwargs):
        if i + 1 == step:
            holder["stream"].steer(**changes)
        return kwargs

    return holder, callback


def _pixels(ev) -> np.ndarray:
    return np.asarray(ev.image.convert("RGB")).astype(np.int16)


@pytest.fixture(scope="module", params=["sd", "sdxl"])
def tiny(request):
    build = tiny_sd_pipeline if request.param == "sd" else tiny_sdxl_pipeline
    model = ms.ImageModel(build())
    yield model
    model.close()


def test_steer_before_first_step_equals_fresh_run(tiny):
    fresh = tiny.generate("a dog", steps=5, seed=3, preview="none")
    busy = tiny.stream("a cat", steps=5, seed=1, preview="none", priority=10)  # holds the engine
    s = tiny.stream("a cat", steps=5, seed=3, preview="none")
    s.steer(prompt="a dog")
    final = s.wait()
    busy.wait()
    assert final.finish_reason == "stop"
    assert final.metrics["steers"] == 1
    assert np.abs(_pixels(final) - _pixels(fresh)).max() <= 1


def test_midrun_steer_changes_the_result_and_keeps_running(tiny):
    plain = tiny.generate("a cat", steps=6, seed=2, preview="none")
    target = tiny.generate("a dog", steps=6, seed=2, preview="none")
    holder, callback = _steer_at(3, prompt="a dog", negative_prompt="blurry", guidance_scale=4.0)
    s = holder["stream"] = tiny.stream("a cat", steps=6, seed=2, preview="latent", callback_on_step_end=callback)
    events = list(s)
    final = events[-1]
    assert final.finish_reason == "stop" and final.step == 6 and final.metrics["steers"] == 1
    assert [e.step for e in events[:-1]] == [1, 2, 3, 4, 5, 6]
    assert final.data != plain.data and final.data != target.data


def test_guidance_only_steer(tiny):
    holder, callback = _steer_at(2, guidance_scale=9.0)
    s = holder["stream"] = tiny.stream("a cat", steps=4, seed=2, preview="none", callback_on_step_end=callback)
    final = s.wait()
    assert final.metrics["steers"] == 1
    assert final.data != tiny.generate("a cat", steps=4, seed=2, preview="none").data


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((), {"prompt": ""}, "must not be empty"),
        ((), {"prompt": "   "}, "must not be empty"),
        ((), {"prompt": 3}, "must be a string"),
        ((), {"seed": 4}, "unknown seed"),
        ((), {}, "at least one"),
        ((), {"guidance_scale": math.nan}, "finite number"),
        ((), {"guidance_scale": math.inf}, "finite number"),
        ((), {"guidance_scale": -1.0}, "finite number"),
        ((), {"guidance_scale": True}, "finite number"),
        ((), {"guidance_scale": 1.0}, "turn classifier-free guidance off"),
    ],
    ids=["empty", "blank", "not-str", "unknown", "nothing", "nan", "inf", "negative", "bool", "cfg-off"],
)
def test_bad_steers_raise_and_leave_the_run_alone(tiny, args, kwargs, match):
    errors: list[BaseException] = []

    def callback(pipe, i, t, kw):
        if i == 0:
            try:
                s.steer(*args, **kwargs)
            except InvalidArgumentError as exc:
                errors.append(exc)
        return kw

    s = tiny.stream("a cat", steps=3, seed=0, preview="none", guidance_scale=5.0, callback_on_step_end=callback)
    final = s.wait()
    assert final.finish_reason == "stop" and "steers" not in final.metrics
    assert len(errors) == 1 and match in str(errors[0])


def test_negative_prompt_without_guidance_raises(tiny):
    errors: list[BaseException] = []

    def callback(pipe, i, t, kw):
        if i == 0:
            try:
                s.steer(negative_prompt="blurry")
            except InvalidArgumentError as exc:
                errors.append(exc)
        return kw

    s = tiny.stream("a cat", steps=2, seed=0, preview="none", guidance_scale=1.0, callback_on_step_end=callback)
    assert s.wait().finish_reason == "stop"
    assert len(errors) == 1 and "no effect" in str(errors[0])


def test_rewind_and_finished_streams_raise(tiny):
    s = tiny.stream("a cat", steps=2, seed=0, preview="none")
    with pytest.raises(InvalidArgumentError, match="cannot rewind"):
        s.rewind(3)
    s.wait()
    with pytest.raises(StreamFinishedError):
        s.steer(prompt="a dog")
    c = tiny.stream("a cat", steps=2, seed=0, preview="none")
    c.cancel()
    with pytest.raises(StreamFinishedError):
        c.steer(prompt="a dog")
    c.wait()


def test_other_families_raise_a_clear_error():
    model = ms.ImageModel(tiny_flux_pipeline())
    try:
        s = model.stream("a cat", steps=2, seed=0, preview="none")
        with pytest.raises(InvalidArgumentError, match="supports Stable Diffusion 1.x/2.x and SDXL"):
            s.steer(prompt="a dog")
        assert s.wait().finish_reason == "stop"
    finally:
        model.close()


# -- the embedded shapes model: the steer shows in what is drawn --------------------------------


def _judge():
    path = ROOT / "benchmarks" / "shapes_quality.py"
    spec = importlib.util.spec_from_file_location("_shapes_quality", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    judge, acc = module.train_judge(0, 2000, 2, lambda *_: None)
    assert acc["background"] > 0.9, acc
    return module, judge


@pytest.mark.model
def test_embedded_step0_steer_is_byte_identical(shapes):
    fresh = shapes.generate(YELLOW, steps=20, seed=0, preview="none")
    busy = shapes.stream("a green square on a white background", steps=20, seed=5, preview="none", priority=10)
    s = shapes.stream(BLUE, steps=20, seed=0, preview="none")
    s.steer(prompt=YELLOW)
    final = s.wait()
    busy.wait()
    assert final.data == fresh.data


@pytest.mark.model
def test_embedded_steer_at_step_5_changes_the_background(shapes):
    module, judge = _judge()
    blue = shapes.generate(BLUE, steps=20, seed=0, preview="none")
    holder, callback = _steer_at(5, prompt=YELLOW)
    s = holder["stream"] = shapes.stream(BLUE, steps=20, seed=0, preview="x0", callback_on_step_end=callback)
    steered = s.wait()
    assert steered.metrics["steers"] == 1
    images = np.stack([np.asarray(e.image.convert("RGB")) for e in (blue, steered)])
    pred = module.predict(judge, module.to_tensor(images))
    names = module.COLOR_NAMES
    backgrounds = [names[int(p[2])] for p in pred]
    assert backgrounds == ["blue", "yellow"], backgrounds
    # The composition formed in the first five steps stays: the red circle is where it was.
    red = lambda a: (a[..., 0] > 150) & (a[..., 1] < 100) & (a[..., 2] < 100)  # noqa: E731
    a, b = red(images[0].astype(int)), red(images[1].astype(int))
    assert a.sum() > 20 and (a & b).sum() / (a | b).sum() > 0.6
