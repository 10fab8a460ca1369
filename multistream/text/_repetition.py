"""Repetition loops: a stream whose newest tokens repeat one short unit again and again (a small
model stuck on a string under a JSON schema, "ha ha ha ...").

`RepetitionDetector` is incremental and cheap: one comparison per candidate period per token.
For each period ``p`` it keeps how many of the newest tokens equal the token ``p`` before them;
when that run covers ``repeats - 1`` further copies of the unit and at least ``min_span`` tokens,
the tail is the unit repeated ``repeats`` times or more: a loop.

Example:
    >>> d = RepetitionDetector(min_span=8)
    >>> [d.feed(t) for t in [1, 2, 3, 9, 8, 9, 8, 9, 8, 9, 8]][-3:]
    [False, False, True]
    >>> d.found
    {'period': 2, 'start': 3}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["RepetitionDetector"]


class RepetitionDetector:
    """Finds a repeated unit of 1..``max_period`` tokens at the end of a token sequence.

    A unit shorter than 16 tokens must repeat ``repeats`` (4) times, a longer one 3 times, and
    the repeated stretch must span at least ``min_span`` tokens (32), so ordinary text (a short
    list, a markdown rule, a word said twice) is not a loop.
    """

    def __init__(self, *, max_period: int = 64, repeats: int = 4, min_span: int = 32) -> None:
        self.max_period = max_period
        self.repeats = repeats
        self.min_span = min_span
        self.tokens: list[int] = []
        self.count = 0  # tokens fed in all
        self._runs = [0] * (max_period + 1)
        self.found: dict[str, Any] | None = None  # the first loop: {"period", "start" (token index)}

    @classmethod
    def of(cls, tokens: Iterable[int], **kwargs: Any) -> RepetitionDetector:
        """A detector that has seen ``tokens`` (e.g. the answer kept after an edit)."""
        d = cls(**kwargs)
        for t in tokens:
            d.feed(t)
        return d

    def feed(self, token: int) -> bool:
        """Take the next token; True the first time a loop is found."""
        tokens, runs = self.tokens, self._runs
        n = len(tokens)
        hit = None
        for p in range(1, min(self.max_period, n) + 1):
            if tokens[n - p] == token:
                runs[p] += 1
                if hit is None and runs[p] + p >= self.min_span and \
                        runs[p] >= p * ((self.repeats if p < 16 else 3) - 1):
                    hit = p
            else:
                runs[p] = 0
        tokens.append(token)
        self.count += 1
        if len(tokens) > 4 * self.max_period:
            del tokens[: len(tokens) - self.max_period]
        if hit is not None and self.found is None:
            self.found = {"period": hit, "start": self.count - (runs[hit] + hit)}
            return True
        return False
