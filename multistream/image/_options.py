"""The arguments of ``ImageModel.stream()``, checked once, without torch.

Shared by the real image model and the scripted fake in `multistream.testing`, so both reject
the same mistakes with the same message and make previews at the same steps. What depends on
the model (height and width among the sizes it can make, TAESD weights, which pipeline
arguments exist, whether the pipeline has step callbacks) is checked by the model, fed by the
parsed `ImageOptions`.

Also here because they are argument parsing: `parse_preview` (``preview=`` into a source and a
decoder, see `multistream.diffusion._previews`) and `PreviewThrottle` (``preview_every=`` into the steps
that get a preview).

Example:
    >>> opts = parse_image_options("a red circle", steps=7, preview="x0", preview_every=3)
    >>> opts.steps, opts.preview.source, [s for s in range(1, 8) if opts.throttle.should_preview(s)]
    (7, 'x0', [1, 4, 7])
    >>> parse_image_options("a red circle", steps=0)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: steps must be an integer from 1 to 1000 (the schedulers' training timesteps), got 0
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
from ..diffusion._preview_options import PREVIEW_MODES, PreviewPlan, PreviewThrottle, parse_preview
from ..diffusion._sizes import EMBEDDED_IMAGE_SIZES
from ..diffusion._steps import MAX_STEPS, check_steps
from ..errors import InvalidArgumentError

__all__ = [
    "IMAGE_STREAM_ARGS",
    "PREVIEW_MODES",
    "ImageOptions",
    "PreviewPlan",
    "PreviewThrottle",
    "check_size_multiple",
    "parse_image_options",
    "parse_preview",
    "refuse_pipeline_argument",
]


# Arguments `stream()` sets itself; passing them through **pipeline_kwargs would fight it.
_RESERVED = {
    "prompt": "the first argument",
    "num_inference_steps": "steps=",
    "num_images_per_prompt": "num_images=",
    "return_dict": None,
    "callback": "callback_on_step_end=",
    "callback_steps": "callback_on_step_end=",
}


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not is_int(value) or int(value) < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_guidance(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"guidance_scale must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        # NaN passes every comparison, so it is named apart; the pipeline would draw noise with it.
        raise InvalidArgumentError(f"guidance_scale must be a finite number >= 0, got {value!r}")
    return float(value)


def _prompt(v: Any) -> str:
    if not isinstance(v, str):
        raise InvalidArgumentError(f"prompt must be a string, got {type(v).__name__}")
    return v


def _negative_prompt(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise InvalidArgumentError(f"negative_prompt must be a string or None, got {type(v).__name__}")
    return v  # type: ignore[no-any-return]


def _side(name: str) -> Any:
    def check(v: Any) -> int | None:
        if v is not None and (not is_int(v) or v < 1):
            raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
        return None if v is None else int(v)

    return check


def _format(name: str) -> Any:
    def check(v: Any) -> str:
        from ._frames import check_format  # Pillow and numpy, only when checking

        return check_format(v, name)

    return check


def _quality(name: str) -> Any:
    def check(v: Any) -> int:
        from ._frames import check_quality

        return check_quality(v, name)

    return check


def _priority(v: Any) -> int:
    if not is_int(v):
        raise InvalidArgumentError(f"priority must be an integer (higher runs first), got {v!r}")
    return int(v)


# What a side may be is the model's (`ImageModel.sizes`); the embedded model's is known without it.
_SIDE_HELP = (f"an integer: pixels, a size the model can make (model.sizes; the embedded model: "
              f"{EMBEDDED_IMAGE_SIZES.describe()}); null: its native size")


@dataclass(frozen=True)
class ImageOptions:
    """Checked ``ImageModel.stream()`` options: each declared once, here.

    None means "the model's own default" for ``steps``, ``guidance_scale``, ``height``,
    ``width`` and ``preview`` (the model's ``default_preview``); ``seed`` None means a random one.
    ``pipeline_kwargs`` are the other keyword arguments, for the pipeline call.
    """

    prompt: str
    negative_prompt: Optional[str] = option(None, "a string, or null", _negative_prompt, wire=Optional[str])
    steps: Optional[int] = option(None, f"an integer from 1 to {MAX_STEPS}: denoising steps; null: the pipeline's "
                                  "default", check_steps, wire=Optional[int], ge=1, le=MAX_STEPS)
    guidance_scale: Optional[float] = option(None, "a finite number >= 0; null: the pipeline's default",
                                             lambda v: _check_guidance(v), wire=Optional[float], ge=0)
    height: Optional[int] = option(None, _SIDE_HELP, _side("height"),
                                   wire=Optional[int], ge=1)
    width: Optional[int] = option(None, _SIDE_HELP, _side("width"),
                                  wire=Optional[int], ge=1)
    seed: Optional[int] = option(None, "an integer in [0, 2**63): a reproducible picture; null: random", check_seed,
                                 wire=Optional[int], ge=0, lt=2**63)
    num_images: int = option(1, "an integer >= 1: images per prompt", lambda v: _check_int("num_images", v, 1),
                             wire=int, ge=1)
    preview: Optional[PreviewPlan] = option(
        None, f"one of {', '.join(PREVIEW_MODES)}; null: the model's default", lambda v: None if v is None else parse_preview(v),
        wire=Optional[str])
    preview_every: int = option(1, "an integer >= 1: preview steps 1, 1+k, 1+2k, ...",
                                lambda v: PreviewThrottle(v).every, wire=int, ge=1)
    preview_format: str = option("jpeg", "'jpeg', 'png' or 'webp'", _format("preview_format"), wire=str)
    preview_quality: int = option(75, "an integer 1..100", _quality("preview_quality"), wire=int, ge=1, le=100)
    preview_max_side: Optional[int] = option(256, "an integer: pixels; null: never scaled down",
                                             lambda v: _check_int("preview_max_side", v, 1, optional=True),
                                             wire=Optional[int], ge=1)
    final_format: str = option("png", "'png', 'jpeg' or 'webp'", _format("final_format"), wire=str)
    final_quality: int = option(95, "an integer 1..100 (jpeg and webp finals)", _quality("final_quality"), wire=int, ge=1, le=100)
    priority: int = option(0, "an integer; higher gets the next denoising step first (a server caps it per key)",
                           _priority, wire=int)
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def throttle(self) -> PreviewThrottle:
        """The steps that get a preview: 1, 1+k, 1+2k, ... for ``preview_every=k``."""
        return PreviewThrottle(self.preview_every)


IMAGE_STREAM_ARGS: tuple[str, ...] = option_names(ImageOptions)


def parse_image_options(prompt: Any, **options: Any) -> ImageOptions:
    """Check every model-independent option; raise `InvalidArgumentError` naming the first bad one.
    Names that are not options go to ``pipeline_kwargs`` (the pipeline call's own arguments).

    Example:
        >>> parse_image_options("x", guidance_scale=float("nan"))
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: guidance_scale must be a finite number >= 0, got nan
    """
    parsed = parse_options(ImageOptions, "ImageModel.stream()", options, extra="pipeline_kwargs", prompt=_prompt(prompt))
    check_pipeline_kwargs(parsed.pipeline_kwargs, seed=parsed.seed, owner="ImageModel.stream()", reserved=_RESERVED,
                          output_types=("pil", "np", "pt"))
    return parsed


# What `ImageModel.stream` takes: its options and its own keywords (a typo of any is named).
IMAGE_STREAM_KEYWORDS = (*IMAGE_STREAM_ARGS, "taesd", "resume_from", "on_checkpoint", "checkpoint_every")


def refuse_pipeline_argument(name: str, pipeline: str | None) -> None:
    """`multistream._spec.refuse_unknown_keyword` for ``ImageModel.stream()`` (and its scripted fake)."""
    refuse_unknown_keyword(name, pipeline, IMAGE_STREAM_KEYWORDS, "ImageModel.stream()")


def check_size_multiple(name: str, value: int, multiple: int, why: str) -> int:
    """``value`` if it is a multiple of ``multiple``, else an error that says ``why`` and the two
    nearest sizes that work.

    Example:
        >>> check_size_multiple("height", 33, 8, "the VAE's factor")
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: height=33 is not a multiple of 8 (the VAE's factor); use e.g. 32 or 40
    """
    if value % multiple:
        lower = max(multiple, value - value % multiple)
        raise InvalidArgumentError(
            f"{name}={value} is not a multiple of {multiple} ({why}); use e.g. {lower} or {lower + multiple}"
        )
    return value
