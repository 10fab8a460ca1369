"""The sizes an image model can make: its native size, the factor every side is a multiple of, and
the range of sides it accepts. Torch-free, so the command line checks the embedded model's sizes
before it loads anything.

A side that is not a multiple of the pipeline's real factor fails inside diffusers (a ValueError
after the request started: a 500 on the server, a traceback on the command line), and a side far
above what the model was made for runs for minutes a step (``1024x1024`` on the 64-pixel
embedded model took 535 s, and ``cancel()`` only acts between steps). So each model declares
`ImageSizes` and every surface refuses a bad size before any work, naming the sizes it can make.

Example:
    >>> EMBEDDED_IMAGE_SIZES.check(height=96, width=128)
    (96, 128)
    >>> EMBEDDED_IMAGE_SIZES.check(height=100, width=64)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: height=100 is not a multiple of 16: this model makes sides that are multiples of 16 from 32 to 128 pixels, native 64x64 (the embedded model was trained on 64x64 pictures and draws from half to twice that); use e.g. height=96 or 112
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["EMBEDDED_IMAGE_SIZES", "EMBEDDED_VIDEO_MAX_FRAMES", "EMBEDDED_VIDEO_SIZES", "ImageSizes", "check_max_frames",
           "sizes_for"]


@dataclass(frozen=True)
class ImageSizes:
    """What an image model accepts for ``height`` and ``width``: multiples of ``multiple`` from
    ``min_side`` to ``max_side`` pixels; ``native`` is its own ``(height, width)`` (what it makes
    when none is given; None where the pipeline declares none) and ``why`` says where the factor
    comes from.

    Example:
        >>> ImageSizes(multiple=8, min_side=8, max_side=1024, native=(512, 512)).describe()
        'sides that are multiples of 8 from 8 to 1024 pixels, native 512x512'
    """

    multiple: int
    min_side: int
    max_side: int
    native: tuple[int, int] | None = None
    why: str = ""

    def describe(self) -> str:
        """The sizes in words, for error messages and ``--help``."""
        native = ""
        if self.native is not None:
            h, w = self.native
            native = f", native {w}x{h}" + (" (width x height)" if h != w else "")
        return f"sides that are multiples of {self.multiple} from {self.min_side} to {self.max_side} pixels{native}"

    def check_side(self, name: str, value: int) -> int:
        """``value`` if this model can make a side of that length, else `InvalidArgumentError`
        naming the sizes it makes and the nearest ones."""
        if value > self.max_side:
            problem, hint = f"is above {self.max_side}", f"{name}={self.max_side}"
        elif value < self.min_side:
            problem, hint = f"is below {self.min_side}", f"{name}={self.min_side}"
        elif value % self.multiple:
            lower = value - value % self.multiple
            problem = f"is not a multiple of {self.multiple}"
            hint = f"{name}={lower}" + (f" or {lower + self.multiple}" if lower + self.multiple <= self.max_side else "")
        else:
            return value
        why = f" ({self.why})" if self.why else ""
        raise InvalidArgumentError(f"{name}={value} {problem}: this model makes {self.describe()}{why}; use e.g. {hint}",
                                   param=name)

    def check(self, height: int | None, width: int | None) -> tuple[int | None, int | None]:
        """Both sides checked; None (the model's own default) passes as it is."""
        return (
            None if height is None else self.check_side("height", height),
            None if width is None else self.check_side("width", width),
        )

    def native_or(self, height: int | None, width: int | None) -> tuple[int | None, int | None]:
        """The given sides, checked, with the native size where a side is None."""
        h, w = self.check(height, width)
        if self.native is not None:
            h = self.native[0] if h is None else h
            w = self.native[1] if w is None else w
        return h, w


#: The embedded shapes model: trained on 64x64 pictures (16x16 latents; the VAE downsamples by 4
#: and its UNet twice more, so a side is a whole number of the UNet's 16-pixel cells). It draws
#: from half to twice its training size; a denoising step at the largest, 128x128, takes tens of
#: milliseconds on a laptop CPU, so ``cancel()`` stays prompt (256x256 was ~0.7 s a step and 1024x1024
#: ~25 s, for pictures it was never taught to draw).
EMBEDDED_IMAGE_SIZES = ImageSizes(
    multiple=16, min_side=32, max_side=128, native=(64, 64),
    why="the embedded model was trained on 64x64 pictures and draws from half to twice that",
)


#: The embedded video model (an AnimateDiff adapter on the embedded image model: the same VAE,
#: downsampling by 4, and a UNet whose 4x4 cells make a side a multiple of 16), native 64x64, up to
#: twice that: what `sizes_for` makes of its pipeline, declared here so that the command line can
#: refuse a size before the model loads (`load_video_model` gives the embedded model these).
EMBEDDED_VIDEO_SIZES = ImageSizes(
    multiple=16, min_side=16, max_side=128, native=(64, 64),
    why="the VAE downsamples by 4 and the denoiser patches by 4",
)

#: The most frames the embedded video model takes: its motion modules' positional table
#: (``motion_max_seq_length``, what `VideoModel.max_num_frames` reads from the loaded model),
#: declared here so that the command line can refuse ``--num-frames 40`` before the model loads.
EMBEDDED_VIDEO_MAX_FRAMES = 32


def check_max_frames(num_frames: int, most: int | None) -> int:
    """``num_frames`` if a denoiser that takes at most ``most`` frames (None: no known limit) takes
    them, else `InvalidArgumentError`; `VideoModel.check_num_frames` and the command line say it alike.

    Example:
        >>> check_max_frames(16, EMBEDDED_VIDEO_MAX_FRAMES)
        16
    """
    if most is not None and num_frames > most:
        raise InvalidArgumentError(
            f"num_frames={num_frames} is more than this model takes: its motion modules hold at most {most} "
            f"frames; use num_frames={most} or fewer (a lower fps makes the clip last longer)")
    return num_frames


def sizes_for(multiple: int, native: tuple[int | None, int | None], why: str, max_side: int | None = None) -> ImageSizes:
    """The sizes of a pipeline whose sides must be multiples of ``multiple`` (its VAE factor, times
    any patching; at least diffusers' own 8) and whose native ``(height, width)`` is ``native``:
    up to ``max_side``, by default twice the native longer side (a step there costs about four
    times a native one), or 2048 where the pipeline declares no native size.

    Example:
        >>> sizes_for(8, (512, 512), "the VAE downsamples by 8").max_side
        1024
    """
    multiple = math.lcm(int(multiple), 8)
    h, w = native
    known = (int(h), int(w)) if h is not None and w is not None else None
    if max_side is None:
        max_side = 2 * max(known) if known is not None else 2048
    max_side = max(multiple, max_side - max_side % multiple)
    return ImageSizes(multiple=multiple, min_side=multiple, max_side=max_side, native=known, why=why)
