"""Seeds of seeded sampling, torch-free (the server derives the seeds of ``n`` choices too).

A seeded draw depends only on ``(seed, position)``; choice ``i`` of an ``n``-choice request is
seeded from ``(seed, i)``.

Example:
    >>> position_seed(7, 0) != position_seed(7, 1)
    True
"""

from __future__ import annotations

__all__ = ["choice_seed", "position_seed"]

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at ``position`` of a stream seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of an ``n``-choice request seeded with ``seed``: choice 0 keeps
    ``seed`` (so it equals the same request with n=1), the others are mixed from (seed, index).

    Example:
        >>> choice_seed(5, 0), choice_seed(5, 1) != choice_seed(5, 2)
        (5, True)
    """
    return seed if index == 0 else position_seed(seed ^ 0x5F3759DF, -1 - index)
