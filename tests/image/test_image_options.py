"""Argument checks shared by the real image model and the scripted fake (`multistream.image._options`)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import Lockstep, one_thread  # noqa: F401

import multistream as ms
from multistream.image import EMBEDDED_MODEL_DIR
from multistream.image._options import PreviewThrottle, parse_image_options
from multistream.testing import ScriptedImageModel

embedded = pytest.mark.skipif(
    not (EMBEDDED_MODEL_DIR / "model_index.json").is_file(), reason="the embedded image model is not installed"
)

PROMPT = "a red circle on a blue background"


def test_options_and_the_fake_import_without_torch() -> None:
    code = (
        "import sys; import multistream.image._options; from multistream.testing import ScriptedImageModel; "
        "final = ScriptedImageModel(steps=2, size=16).generate('x', preview='tiny'); "
        "assert final.is_final and 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults_and_normalising() -> None:
    opts = parse_image_options("x", guidance_scale=7, preview="X0", preview_format="JPG", preview_every=3)
    assert opts.guidance_scale == 7.0 and isinstance(opts.guidance_scale, float)
    assert opts.preview is not None and (opts.preview.mode, opts.preview.source) == ("x0", "x0")
    assert opts.preview_format == "jpeg" and opts.throttle.every == 3
    assert parse_image_options("x").preview is None  # None: the model's default_preview decides
    assert dict(parse_image_options("x", eta=0.5).pipeline_kwargs) == {"eta": 0.5}


BAD = [
    ({"prompt": 123}, "prompt must be a string, got int"),
    ({"negative_prompt": 3}, "negative_prompt must be a string or None, got int"),
    ({"steps": 0}, "steps must be an integer from 1 to 1000 (the schedulers' training timesteps), got 0"),
    ({"steps": 2.5}, "steps must be an integer from 1 to 1000 (the schedulers' training timesteps), got 2.5"),
    ({"guidance_scale": "high"}, "guidance_scale must be a number >= 0, got 'high'"),
    ({"guidance_scale": -1}, "guidance_scale must be a finite number >= 0, got -1"),
    ({"guidance_scale": math.nan}, "guidance_scale must be a finite number >= 0, got nan"),
    ({"guidance_scale": math.inf}, "guidance_scale must be a finite number >= 0, got inf"),
    ({"height": 0}, "height must be a positive integer, got 0"),
    ({"width": 2.5}, "width must be a positive integer, got 2.5"),
    ({"seed": -1}, "seed must be an integer in [0, 2**63) or None, got -1"),
    ({"seed": 2**63}, "seed must be an integer in [0, 2**63) or None"),
    ({"num_images": 0}, "num_images must be an integer >= 1, got 0"),
    ({"preview": "blurry"}, "unknown preview='blurry'; use one of"),
    ({"preview_every": 0}, "preview_every must be an integer >= 1, got 0"),
    ({"preview_format": "gif"}, "unknown preview_format 'gif'"),
    ({"preview_quality": 101}, "preview_quality must be an integer from 1 to 100, got 101"),
    ({"preview_max_side": 0}, "preview_max_side must be an integer >= 1, got 0"),
    ({"final_format": "bmp"}, "unknown final_format 'bmp'"),
    ({"final_quality": 0}, "final_quality must be an integer from 1 to 100, got 0"),
    ({"priority": "high"}, "priority must be an integer (higher runs first), got 'high'"),
    ({"num_inference_steps": 5}, "'num_inference_steps' is set by ImageModel.stream() itself; use steps="),
    ({"output_type": "latent"}, "output_type='latent' is not supported"),
    ({"callback_on_step_end": 3}, "callback_on_step_end must be callable"),
]


def _refusal(model, kwargs: dict) -> str:
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(ms.InvalidArgumentError) as info:
        model.stream(kwargs.pop("prompt"), **kwargs)
    return str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_the_fake_refuses_with_the_shared_message(kwargs: dict, message: str) -> None:
    assert message in _refusal(ScriptedImageModel(steps=2, size=16), kwargs)


@pytest.mark.model
@embedded
@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_the_real_model_refuses_as_the_fake_does(shapes, kwargs: dict, message: str) -> None:
    real = _refusal(shapes, kwargs)
    assert message in real and real == _refusal(ScriptedImageModel(steps=2, size=16), kwargs)


GOOD = [
    {"prompt": ""},  # unconditional: the pipeline takes it, so the fake does too
    {"preview": "TINY"},
    {"preview": "x0+vae", "preview_max_side": None},
    {"guidance_scale": 0},
    {"final_format": "webp", "final_quality": 50},
    {"negative_prompt": "green", "seed": 2**63 - 1},
]


@pytest.mark.model
@embedded
@pytest.mark.parametrize("kwargs", GOOD)
def test_both_accept_the_same_values(shapes, kwargs: dict) -> None:
    kwargs = {"prompt": PROMPT, "steps": 2, **kwargs}
    for model in (shapes, ScriptedImageModel(steps=2, size=16)):
        final = model.generate(**kwargs)
        assert final.type == "image" and final.finish_reason == "stop", (model, final)


@pytest.mark.model
@embedded
@pytest.mark.parametrize(("steps", "every"), [(7, 1), (7, 3), (6, 2), (4, 10)])
def test_the_fake_previews_the_steps_the_real_model_does(shapes, steps: int, every: int) -> None:
    lock = Lockstep(every)
    real = lock.events(shapes.stream(PROMPT, steps=steps, seed=0, preview_every=every, callback_on_step_end=lock.callback))
    real_steps = [e.step for e in real[:-1]]
    assert real_steps == [s for s in range(1, steps + 1) if PreviewThrottle(every).should_preview(s)]
    fake = list(ScriptedImageModel(steps=steps, size=16, delay_s=0.01).stream(PROMPT, preview_every=every))
    fake_steps = [e.step for e in fake[:-1]]
    # A reader that falls behind gets only the newest preview, so the fake's are compared as a
    # subset; the count made is in both finals' metrics, and the last one is never replaced.
    assert set(fake_steps) <= set(real_steps) and fake_steps[-1] == real_steps[-1]
    assert fake[-1].metrics["previews"] == real[-1].metrics["previews"] == len(real_steps)


@pytest.mark.model
@embedded
@pytest.mark.parametrize(("typo", "meant"), [("stepz", "steps"), ("negative_promt", "negative_prompt"),
                                             ("on_checkpoints", "on_checkpoint")])
def test_a_mistyped_keyword_names_the_closest_option(shapes, typo: str, meant: str) -> None:
    """``stepz=2`` said only "StableDiffusionPipeline takes no 'stepz' argument": names that are not
    options go to the pipeline, so a typo of an option was blamed on it. Now the error names the
    keyword and the option it is closest to (the helper text's own stream uses), on both models."""
    for model in (shapes, ScriptedImageModel(steps=2, size=16)):
        with pytest.raises(ms.InvalidArgumentError) as info:
            model.stream(PROMPT, **{typo: 2})
        message = str(info.value)
        assert message.startswith(f"unknown argument {typo!r} for ImageModel.stream(). Did you mean {meant!r}?"), message
        assert info.value.param == typo
    assert "StableDiffusionPipeline takes no" in _refusal(shapes, {typo: 2})
