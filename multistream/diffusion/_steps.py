"""How many denoising steps a request may ask for, for images and video alike.

``steps=10**11`` passed every check and failed inside diffusers (numpy tried to allocate 745 GiB
for the timesteps), as an error event after the model loaded; ``steps=2000`` ran for minutes with
no end in sight. The schedulers diffusers pipelines use are trained on 1000 timesteps, and most of
them cannot take more inference steps than that, so the bound is 1000, checked at call time (and by
the command line before a model loads).

Example:
    >>> check_steps(20), check_steps(None)
    (20, None)
    >>> check_steps(5000)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: steps must be an integer from 1 to 1000 (the schedulers' training timesteps), got 5000
"""

from __future__ import annotations

from typing import Any

from .._checks import is_int
from ..errors import InvalidArgumentError

__all__ = ["MAX_STEPS", "check_steps"]

MAX_STEPS = 1000


def check_steps(value: Any) -> int | None:
    """``value`` as an int in 1..`MAX_STEPS`, None for the model's default, else `InvalidArgumentError`."""
    if value is None:
        return None
    if not is_int(value) or not 1 <= int(value) <= MAX_STEPS:
        raise InvalidArgumentError(f"steps must be an integer from 1 to {MAX_STEPS} (the schedulers' training "
                                   f"timesteps), got {value!r}")
    return int(value)
