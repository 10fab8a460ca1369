"""The arguments of ``VideoModel.stream()``, each declared once, checked without torch.

Shared by the real video model, the server's request bodies and any fake, so all refuse the same
values with the same message. What depends on the model (the sizes and frame counts it can make,
whether its pipeline has step callbacks, its pipeline's own arguments) is checked by the model.

Example:
    >>> opts = parse_video_options("a red circle moving right", steps=6, preview="latent", preview_every=2)
    >>> opts.steps, opts.preview, [s for s in range(1, 7) if opts.throttle.should_preview(s)]
    (6, 'latent', [1, 3, 5])
    >>> parse_video_options("a red circle", preview_format="gif")
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: unknown preview_format='gif'; use 'webp' (an animated image) or 'sheet' (a JPEG contact sheet)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .._checks import check_seed, is_int
from .._spec import option, option_names, parse_options, refuse_unknown_keyword
from ..diffusion._pipeline_kwargs import check_pipeline_kwargs
from ..diffusion._preview_options import PreviewThrottle
from ..diffusion._steps import MAX_STEPS, check_steps
from ..errors import InvalidArgumentError

__all__ = [
    "PREVIEW_FORMATS",
    "VIDEO_FORMATS",
    "VIDEO_PREVIEW_MODES",
    "VIDEO_STREAM_ARGS",
    "VideoOptions",
    "parse_video_options",
    "refuse_pipeline_argument",
]

#: ``preview=``: the noisy latent through the linear map, the model's clean estimate (x0) through
#: the linear map, the fitted tiny video decoder, or the full VAE; or no previews.
VIDEO_PREVIEW_MODES: tuple[str, ...] = ("latent", "x0", "tiny", "vae", "none")
#: ``preview_format=``: an animated WebP of every frame, or a JPEG contact sheet.
PREVIEW_FORMATS: dict[str, str] = {"webp": "image/webp", "sheet": "image/jpeg"}
#: ``video_format=``: the final clip's container and codec.
VIDEO_FORMATS: dict[str, str] = {"webm": "video/webm", "mp4": "video/mp4"}

# Arguments `stream()` sets itself; passing them as pipeline keywords would fight it.
_RESERVED = {
    "prompt": "the first argument",
    "num_inference_steps": "steps=",
    "num_videos_per_prompt": None,
    "output_type": None,
    "return_dict": None,
    "callback": "callback_on_step_end=",
    "callback_steps": "callback_on_step_end=",
    "callback_on_step_end_tensor_inputs": None,
}


def _prompt(v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidArgumentError(f"prompt must be a string, got {type(v).__name__}")
    return v


def _negative_prompt(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise InvalidArgumentError(f"negative_prompt must be a string or None, got {type(v).__name__}")
    return v  # type: ignore[no-any-return]


def _int(name: str, minimum: int, optional: bool = True) -> Any:
    def check(v: Any) -> int | None:
        if v is None and optional:
            return None
        if not is_int(v) or int(v) < minimum:
            raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {v!r}")
        return int(v)

    return check


def _fps(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not 1 <= v <= 120:
        raise InvalidArgumentError(f"fps must be a number from 1 to 120 (frames per second), got {v!r}")
    return float(v)


def _guidance(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise InvalidArgumentError(f"guidance_scale must be a finite number >= 0, got {v!r}")
    return float(v)


def _preview(v: Any) -> str:
    if not isinstance(v, str) or v.lower() not in VIDEO_PREVIEW_MODES:
        raise InvalidArgumentError(f"unknown preview={v!r}; use one of {list(VIDEO_PREVIEW_MODES)}")
    return v.lower()


def _preview_format(v: Any) -> str:
    if not isinstance(v, str) or v.lower() not in PREVIEW_FORMATS:
        raise InvalidArgumentError(
            f"unknown preview_format={v!r}; use 'webp' (an animated image) or 'sheet' (a JPEG contact sheet)"
        )
    return v.lower()


def _video_format(v: Any) -> str:
    if not isinstance(v, str) or v.lower() not in VIDEO_FORMATS:
        raise InvalidArgumentError(f"unknown video_format={v!r}; use 'webm' (VP9) or 'mp4' (H.264)")
    return v.lower()


def _priority(v: Any) -> int:
    if not is_int(v):
        raise InvalidArgumentError(f"priority must be an integer (higher runs first), got {v!r}")
    return int(v)


@dataclass(frozen=True)
class VideoOptions:
    """Checked ``VideoModel.stream()`` options: each declared once, here.

    None means the model's own default (``num_frames``, ``fps``, ``steps``, ``guidance_scale``,
    ``height``, ``width``: `VideoModel.default_num_frames` and its siblings); ``seed`` None picks one.
    ``pipeline_kwargs`` are other keyword arguments, for the pipeline call.
    """

    prompt: str
    num_frames: Optional[int] = option(None, "an integer >= 1: frames of the clip; null: the model's default",
                                       _int("num_frames", 1), wire=Optional[int])
    fps: Optional[float] = option(None, "frames per second of the clip (1..120); null: the model's default", _fps,
                                  wire=Optional[float])
    steps: Optional[int] = option(None, f"an integer from 1 to {MAX_STEPS}: denoising steps; null: the model's "
                                  "default", check_steps, wire=Optional[int], ge=1, le=MAX_STEPS)
    seed: Optional[int] = option(None, "an integer in [0, 2**63): a reproducible clip; null: random", check_seed,
                                 wire=Optional[int])
    guidance_scale: Optional[float] = option(None, "a finite number >= 0; null: the model's default", _guidance,
                                             wire=Optional[float])
    negative_prompt: Optional[str] = option(None, "a string, or null", _negative_prompt, wire=Optional[str])
    height: Optional[int] = option(None, "pixels, one of the model's sizes (model.sizes); null: its default",
                                   _int("height", 1), wire=Optional[int])
    width: Optional[int] = option(None, "pixels, one of the model's sizes (model.sizes); null: its default",
                                  _int("width", 1), wire=Optional[int])
    preview: str = option("tiny", f"one of {', '.join(VIDEO_PREVIEW_MODES)}", _preview, wire=str)
    preview_every: int = option(1, "an integer >= 1: preview steps 1, 1+k, 1+2k, ...",
                                lambda v: PreviewThrottle(v).every, wire=int)
    preview_format: str = option("webp", "'webp' (animated, every frame) or 'sheet' (JPEG contact sheet)",
                                 _preview_format, wire=str)
    preview_max_side: Optional[int] = option(256, "an integer: pixels of a preview frame's longer side; null: full size",
                                             _int("preview_max_side", 8), wire=Optional[int])
    priority: int = option(0, "an integer; higher gets the next denoising step first", _priority, wire=int)
    video_format: str = option("webm", "'webm' (VP9, the default) or 'mp4' (H.264)", _video_format, wire=str)
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def throttle(self) -> PreviewThrottle:
        """The steps that get a preview: 1, 1+k, 1+2k, ... for ``preview_every=k``."""
        return PreviewThrottle(self.preview_every)


VIDEO_STREAM_ARGS: tuple[str, ...] = option_names(VideoOptions)


def parse_video_options(prompt: Any, **options: Any) -> VideoOptions:
    """Check every model-independent option; raise `InvalidArgumentError` naming the first bad one.
    Names that are not options go to ``pipeline_kwargs`` (the pipeline call's own arguments).

    Example:
        >>> parse_video_options("x", fps=0)
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: fps must be a number from 1 to 120 (frames per second), got 0
    """
    parsed = parse_options(VideoOptions, "VideoModel.stream()", options, extra="pipeline_kwargs", prompt=_prompt(prompt))
    check_pipeline_kwargs(parsed.pipeline_kwargs, seed=parsed.seed, owner="VideoModel.stream()", reserved=_RESERVED)
    return parsed


# What `VideoModel.stream` takes: its options and its own keywords (a typo of any is named).
VIDEO_STREAM_KEYWORDS = (*VIDEO_STREAM_ARGS, "resume_from", "on_checkpoint", "checkpoint_every")


def refuse_pipeline_argument(name: str, pipeline: str | None) -> None:
    """`multistream._spec.refuse_unknown_keyword` for ``VideoModel.stream()`` (and its scripted fake)."""
    refuse_unknown_keyword(name, pipeline, VIDEO_STREAM_KEYWORDS, "VideoModel.stream()")
