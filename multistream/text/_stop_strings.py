"""Stop strings that are never emitted, not even in part.

Text that could be the start of a stop string is held back until it is clear that it is not; when
a stop string appears, everything before it is released and the rest is dropped. I/O-free.

Example:
    >>> m = StopMatcher(["\\n\\nUser:"])
    >>> m.feed("Hello\\n"), m.feed("\\nUs"), m.feed("er: hi")
    (('Hello', False), ('', False), ('', True))
    >>> m = StopMatcher(["END"])
    >>> m.feed("the EN"), m.feed("D"), m.flush()
    (('the ', False), ('', True), '')
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text pieces; get back what is safe to emit and whether a stop string was hit."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit now, stopped)``. After a stop, everything is dropped."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)], True
        hold = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """Release held-back text at the end of generation (it turned out not to be a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
