"""The one home of the value checks every option parser shares (text, image, server settings).

Integers include numpy's (sizes and seeds often come from arrays), never a bool; numbers are
finite reals, never a bool.

Example:
    >>> is_int(3), is_int(True), is_int(2.0)
    (True, False, False)
    >>> is_number(0.5), is_number(float("nan")), is_number(False)
    (True, False, False)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    # numbers.Integral takes numpy integers too, without importing numpy.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (int or float, numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
