"""VideoModel.stream() options: declared once (VideoOptions), checked before any work, with the fix in the message."""

from __future__ import annotations

import dataclasses
import re

import pytest

from multistream._spec import option_fields
from multistream.errors import InvalidArgumentError
from multistream.video import VIDEO_PREVIEW_MODES, VIDEO_STREAM_ARGS, VideoOptions, parse_video_options


def test_defaults_are_the_documented_ones():
    opts = parse_video_options("a red circle moving right")
    assert (opts.preview, opts.preview_every, opts.preview_format, opts.preview_max_side, opts.priority,
            opts.video_format) == ("tiny", 1, "webp", 256, 0, "webm")
    assert opts.num_frames is opts.fps is opts.steps is opts.seed is opts.guidance_scale is opts.negative_prompt is None
    assert set(VIDEO_PREVIEW_MODES) == {"latent", "x0", "tiny", "vae", "none"}


def test_every_option_is_declared_once_with_a_description():
    names = [f.name for f in option_fields(VideoOptions)]
    assert tuple(names) == VIDEO_STREAM_ARGS
    for name in ("num_frames", "fps", "steps", "seed", "guidance_scale", "negative_prompt", "preview", "preview_every",
                 "preview_format", "preview_max_side", "priority", "video_format", "height", "width"):
        assert name in names
    for f in option_fields(VideoOptions):
        assert f.metadata["option"].doc


@pytest.mark.parametrize("kwargs,message", [
    ({"preview": "taesd"}, "unknown preview='taesd'"),
    ({"preview_format": "gif"}, "use 'webp' (an animated image) or 'sheet'"),
    ({"video_format": "avi"}, "use 'webm' (VP9) or 'mp4' (H.264)"),
    ({"fps": 0}, "fps must be a number from 1 to 120"),
    ({"fps": float("nan")}, "fps must be a number from 1 to 120"),
    ({"num_frames": 0}, "num_frames must be an integer >= 1"),
    ({"steps": 2.5}, "steps must be an integer from 1 to 1000"),
    ({"seed": -1}, "seed must be an integer in [0, 2**63) or None, got -1"),
    ({"guidance_scale": float("inf")}, "guidance_scale must be a finite number"),
    ({"preview_every": 0}, "preview_every must be an integer >= 1"),
    ({"priority": "high"}, "priority must be an integer"),
    ({"negative_prompt": 3}, "negative_prompt must be a string"),
    ({"output_type": "np"}, "'output_type' is set by VideoModel.stream() itself"),
    ({"num_inference_steps": 4}, "use steps="),
    ({"callback_on_step_end": 3}, "callback_on_step_end must be callable"),
    ({"seed": 1, "generator": object()}, "either seed= or generator="),
])  # fmt: skip
def test_bad_values_name_the_problem_and_the_fix(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        parse_video_options("x", **kwargs)


def test_a_prompt_must_be_text():
    with pytest.raises(InvalidArgumentError, match="prompt must be a string"):
        parse_video_options(["x"])


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_video_options("x").steps = 3  # type: ignore[misc]


def test_unknown_names_go_to_the_pipeline_and_the_model_names_a_typo():
    from multistream.testing._random_video import tiny_video_pipeline
    from multistream.video import VideoModel

    assert parse_video_options("x", num_frame=3).pipeline_kwargs == {"num_frame": 3}
    with VideoModel(tiny_video_pipeline("wan")) as vm:
        with pytest.raises(InvalidArgumentError, match="WanPipeline takes no 'num_frame' argument"):
            vm.stream("x", num_frame=9, preview="none")


def test_a_mistyped_keyword_names_the_closest_option():
    """``vm.stream(stepz=2)`` said only "WanPipeline takes no 'stepz' argument"; the error now names
    the option it is closest to, as text streams do (`multistream._spec.reject_unknown`), on the
    real model and the scripted fake alike."""
    from multistream.testing import ScriptedVideoModel
    from multistream.testing._random_video import tiny_video_pipeline
    from multistream.video import VideoModel

    with VideoModel(tiny_video_pipeline("wan")) as vm:
        for model in (vm, ScriptedVideoModel(size=32)):
            with pytest.raises(InvalidArgumentError) as info:
                model.stream("x", stepz=2, preview="none")
            message = str(info.value)
            assert message.startswith("unknown argument 'stepz' for VideoModel.stream(). Did you mean 'steps'?"), message
            assert info.value.param == "stepz"
        with pytest.raises(InvalidArgumentError, match="Did you mean 'resume_from'?"):
            vm.stream("x", resume_frm=None)


@pytest.mark.parametrize("kwargs,param", [
    ({"output_type": "np"}, "output_type"),
    ({"num_inference_steps": 4}, "num_inference_steps"),
    ({"callback_on_step_end": 3}, "callback_on_step_end"),
    ({"seed": 1, "generator": object()}, "generator"),
])  # fmt: skip
def test_a_refused_pipeline_argument_is_named_as_the_param_at_fault(kwargs, param):
    """As for images (one check, `multistream.diffusion._pipeline_kwargs`): a server's 400 says which
    field to fix. The video copy of the check raised without it."""
    with pytest.raises(InvalidArgumentError) as info:
        parse_video_options("x", **kwargs)
    assert info.value.param == param


def test_callback_on_step_end_none_passes_as_for_images():
    """The video copy of the check refused None (the pipeline's own default); it stays unset."""
    assert parse_video_options("x", callback_on_step_end=None).pipeline_kwargs == {"callback_on_step_end": None}
