"""What ``preview=`` and ``preview_every=`` mean to every denoising family (image and video):
`parse_preview` reads a ``preview=`` value into a `PreviewPlan` (a source and a decoder, see
`multistream.diffusion._previews`), `PreviewThrottle` says which steps get a preview.

Example:
    >>> parse_preview("x0+taesd").decoder, PreviewThrottle(every=3).count(7)
    ('taesd', 3)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._checks import is_int
from ..errors import InvalidArgumentError

__all__ = ["PREVIEW_MODES", "PreviewPlan", "PreviewThrottle", "parse_preview"]

PREVIEW_MODES: tuple[str, ...] = ("latent", "x0", "taesd", "vae", "none", "x0+taesd", "x0+vae", "tiny", "x0+tiny")


@dataclass(frozen=True)
class PreviewPlan:
    """What ``preview=`` asks for: ``source`` ("latent" | "x0" | None) and ``decoder``
    ("linear" | "taesd" | "tiny" | "vae" | None, a name of `multistream.diffusion._previews.DECODERS`).

    ``prefer`` names decoders to use instead of ``decoder`` where the model has one at hand
    without fitting or downloading anything: ``"x0"`` prefers ``"tiny"`` (a fitted decoder
    shows the model's estimate in the image's own colours, the linear map only roughly), so
    ``decoder`` is what every model can do and ``prefer`` what a model may do better. The model
    settles it (`multistream.diffusion._previews.settle_plan`) before the run starts.

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
