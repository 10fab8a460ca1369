"""The arguments of ``ImageModel.stream()``, checked once, without torch.

Shared by the real image model and the scripted fake in `multistream.testing`, so both reject
the same mistakes with the same message and make previews at the same steps. What depends on
the model (height and width as multiples of its VAE's factor, TAESD weights, which pipeline
arguments exist, whether the pipeline has step callbacks) is checked by the model, fed by the
parsed `ImageOptions`.

Also here because they are argument parsing: `parse_preview` (``preview=`` into a source and a
decoder, see `multistream.image._previews`) and `PreviewThrottle` (``preview_every=`` into the steps
that get a preview).

Example:
    >>> opts = parse_image_options("a red circle", steps=7, preview="x0", preview_every=3)
    >>> opts.steps, opts.preview.source, [s for s in range(1, 8) if opts.throttle.should_preview(s)]
    (7, 'x0', [1, 4, 7])
    >>> parse_image_options("a red circle", steps=0)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: steps must be an integer >= 1, got 0
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._checks import is_int
from ..errors import InvalidArgumentError

__all__ = [
    "PREVIEW_MODES",
    "ImageOptions",
    "PreviewPlan",
    "PreviewThrottle",
    "check_size_multiple",
    "parse_image_options",
    "parse_preview",
]

PREVIEW_MODES: tuple[str, ...] = ("latent", "x0", "taesd", "vae", "none", "x0+taesd", "x0+vae", "tiny", "x0+tiny")

# Arguments `stream()` sets itself; passing them through **pipeline_kwargs would fight it.
_RESERVED = {
    "prompt": "the first argument",
    "num_inference_steps": "steps=",
    "num_images_per_prompt": "num_images=",
    "return_dict": None,
    "callback": "callback_on_step_end=",
    "callback_steps": "callback_on_step_end=",
}


@dataclass(frozen=True)
class PreviewPlan:
    """What ``preview=`` asks for: ``source`` ("latent" | "x0" | None) and ``decoder``
    ("linear" | "taesd" | "tiny" | "vae" | None, a name of `multistream.image._previews.DECODERS`).

    ``prefer`` names decoders to use instead of ``decoder`` where the model has one at hand
    without fitting or downloading anything: ``"x0"`` prefers ``"tiny"`` (a fitted decoder
    shows the model's estimate in the image's own colours, the linear map only roughly), so
    ``decoder`` is what every model can do and ``prefer`` what a model may do better. The model
    settles it (`multistream.image._previews.settle_plan`) before the run starts.

    Example:
        >>> parse_preview("x0").prefer, parse_preview("latent").prefer
        (('tiny',), ())
    """

    mode: str
    source: str | None
    decoder: str | None
    prefer: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.decoder is not None


def parse_preview(mode: str) -> PreviewPlan:
    """Read a ``preview=`` value, or raise `InvalidArgumentError` naming the valid ones.

    Example:
        >>> parse_preview("x0")
        PreviewPlan(mode='x0', source='x0', decoder='linear', prefer=('tiny',))
        >>> parse_preview("tiny")
        PreviewPlan(mode='tiny', source='x0', decoder='tiny', prefer=())
    """
    if not isinstance(mode, str) or mode.lower() not in PREVIEW_MODES:
        raise InvalidArgumentError(f"unknown preview={mode!r}; use one of {list(PREVIEW_MODES)}")
    mode = mode.lower()
    if mode == "none":
        return PreviewPlan(mode, None, None)
    if mode == "latent":
        return PreviewPlan(mode, "latent", "linear")
    if mode == "x0":
        # The best cheap decoder the model has: its fitted one if it has one ready, else the map.
        return PreviewPlan(mode, "x0", "linear", ("tiny",))
    if mode == "tiny":
        return PreviewPlan(mode, "x0", "tiny")
    if mode.startswith("x0+"):
        return PreviewPlan(mode, "x0", mode[3:])
    return PreviewPlan(mode, "latent", mode)


class PreviewThrottle:
    """Decides which steps get a preview: steps 1, 1+k, 1+2k, ... for ``every=k``.

    The first step always gets one (the sooner the user sees something, the better), so a run
    of ``n`` steps makes exactly ``ceil(n / k)`` previews. The last step's preview is kept even
    though the final image follows: it costs one cheap decode and keeps the count predictable.

    Example:
        >>> PreviewThrottle(every=1).count(4), PreviewThrottle(every=4).count(4)
        (4, 1)
    """

    def __init__(self, every: int = 1) -> None:
        if not is_int(every) or every < 1:
            raise InvalidArgumentError(f"preview_every must be an integer >= 1, got {every!r}")
        self.every = int(every)

    def should_preview(self, step: int) -> bool:
        """True if ``step`` (1-based) gets a preview."""
        return step >= 1 and (step - 1) % self.every == 0

    def count(self, total_steps: int) -> int:
        """How many previews a run of ``total_steps`` steps makes."""
        return math.ceil(max(0, total_steps) / self.every)


@dataclass(frozen=True)
class ImageOptions:
    """Checked ``ImageModel.stream()`` options (see there for their meaning).

    None means "the model's own default" for ``steps``, ``guidance_scale``, ``height``,
    ``width`` and ``preview`` (the model's ``default_preview``); ``seed`` None means a random one.
    ``pipeline_kwargs`` are the other keyword arguments, for the pipeline call.
    """

    prompt: str
    negative_prompt: str | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    num_images: int = 1
    preview: PreviewPlan | None = None
    preview_every: int = 1
    preview_format: str = "jpeg"
    preview_quality: int = 75
    preview_max_side: int | None = 256
    final_format: str = "png"
    final_quality: int = 95
    priority: int = 0
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def throttle(self) -> PreviewThrottle:
        """The steps that get a preview: 1, 1+k, 1+2k, ... for ``preview_every=k``."""
        return PreviewThrottle(self.preview_every)


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


def _check_pipeline_kwargs(pipeline_kwargs: dict[str, Any], seed: Any) -> None:
    for key, value in pipeline_kwargs.items():
        if key in _RESERVED:
            instead = _RESERVED[key]
            hint = f"; use {instead}" if instead else ""
            raise InvalidArgumentError(f"{key!r} is set by stream() itself{hint}")
        if key == "callback_on_step_end" and value is not None and not callable(value):
            raise InvalidArgumentError("callback_on_step_end must be callable")
        if key == "output_type" and value not in ("pil", "np", "pt"):
            raise InvalidArgumentError(
                f"output_type={value!r} is not supported: the stream encodes images; use 'pil' (default), 'np' or 'pt'"
            )
        if key == "generator" and seed is not None:
            raise InvalidArgumentError("pass either seed= or generator=, not both")


def parse_image_options(
    prompt: Any,
    negative_prompt: Any = None,
    steps: Any = None,
    guidance_scale: Any = None,
    height: Any = None,
    width: Any = None,
    seed: Any = None,
    num_images: Any = 1,
    preview: Any = None,
    preview_every: Any = 1,
    preview_format: Any = "jpeg",
    preview_quality: Any = 75,
    preview_max_side: Any = 256,
    final_format: Any = "png",
    final_quality: Any = 95,
    priority: Any = 0,
    **pipeline_kwargs: Any,
) -> ImageOptions:
    """Check every model-independent option; raise `InvalidArgumentError` naming the first bad one.

    Example:
        >>> parse_image_options("x", guidance_scale=float("nan"))
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: guidance_scale must be a finite number >= 0, got nan
    """
    # Here, not at the top: frames needs Pillow and numpy, and the server imports PREVIEW_MODES.
    from ._frames import check_format, check_quality

    if not isinstance(prompt, str):
        raise InvalidArgumentError(f"prompt must be a string, got {type(prompt).__name__}")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise InvalidArgumentError(f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
    steps = _check_int("steps", steps, 1, optional=True)
    guidance = _check_guidance(guidance_scale)
    num_images = _check_int("num_images", num_images, 1)
    plan = None if preview is None else parse_preview(preview)
    preview_every = PreviewThrottle(preview_every).every
    preview_format = check_format(preview_format, "preview_format")
    preview_quality = check_quality(preview_quality, "preview_quality")
    preview_max_side = _check_int("preview_max_side", preview_max_side, 1, optional=True)
    final_format = check_format(final_format, "final_format")
    final_quality = check_quality(final_quality, "final_quality")
    if seed is not None and (not is_int(seed) or not 0 <= int(seed) < 2**63):
        raise InvalidArgumentError(f"seed must be an integer from 0 to 2**63-1 or None, got {seed!r}")
    sides = []
    for name, value in (("height", height), ("width", width)):
        if value is not None and (not is_int(value) or value < 1):
            raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        sides.append(None if value is None else int(value))
    if not is_int(priority):
        raise InvalidArgumentError(f"priority must be an integer (higher runs first), got {priority!r}")
    _check_pipeline_kwargs(pipeline_kwargs, seed)
    return ImageOptions(
        prompt=prompt,
        negative_prompt=negative_prompt,
        steps=steps,
        guidance_scale=guidance,
        height=sides[0],
        width=sides[1],
        seed=None if seed is None else int(seed),
        num_images=num_images,  # type: ignore[arg-type]
        preview=plan,
        preview_every=preview_every,
        preview_format=preview_format,
        preview_quality=preview_quality,
        preview_max_side=preview_max_side,
        final_format=final_format,
        final_quality=final_quality,
        priority=int(priority),
        pipeline_kwargs=dict(pipeline_kwargs),
    )


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
