"""The one home of the value checks every option parser shares (text, image, video, server settings).

Integers include numpy's (sizes and seeds often come from arrays), never a bool; numbers are
finite reals, never a bool.

Example:
    >>> is_int(3), is_int(True), is_int(2.0)
    (True, False, False)
    >>> is_number(0.5), is_number(float("nan")), is_number(False)
    (True, False, False)
    >>> check_seed(7), check_seed(None)
    (7, None)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["check_seed", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    # numbers.Integral takes numpy integers too, without importing numpy.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (int or float, numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_seed(value: Any) -> int | None:
    """A ``seed`` option's value: None (a random seed) or an integer in [0, 2**63), as an int;
    one message for every family."""
    if value is not None and (not is_int(value) or not 0 <= value < 2**63):
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**63) or None, got {value!r}")
    return None if value is None else int(value)
