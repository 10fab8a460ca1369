"""Estimated time left for step-wise work (denoising): ``eta_s`` on image events.

I/O-free and incremental: the run calls `StepEta.step` at the end of each step with the time,
and `StepEta.eta` with the steps left (and the seconds the work after the last step will take,
e.g. the final VAE decode). The estimate is the median of the last few step durations times the
steps left: robust to one slow step (a preview encode, another request's step interleaved, the
machine busy for a moment) and quick to follow a lasting change (a second request joining the
engine doubles every step's wall time; the median follows within a few steps).

`PerPixelTime` remembers how long a model's final decode took per pixel, so the next run's ETA
includes it before its own decode happens.

Example:
    >>> eta = StepEta()
    >>> eta.step(1, now=0.0); eta.eta(steps_left=9) is None     # one step: no duration yet
    True
    >>> for i, now in enumerate([0.5, 1.0, 1.5], start=2):
    ...     eta.step(i, now)
    >>> eta.eta(steps_left=6, tail_s=0.25)
    3.25
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

__all__ = ["PerPixelTime", "StepEta"]


class StepEta:
    """Seconds left from the measured durations of the last ``window`` steps of one run."""

    def __init__(self, window: int = 5) -> None:
        self._durations: deque[float] = deque(maxlen=window)
        self._last: tuple[int, float] | None = None

    def step(self, step: int, now: float) -> None:
        """Step ``step`` (1-based) ended at ``now`` (seconds, any monotonic clock)."""
        if self._last is not None and step > self._last[0]:
            # Steps not seen in between (a resume, a skipped callback) share the interval.
            per_step = (now - self._last[1]) / (step - self._last[0])
            self._durations.append(max(0.0, per_step))
        self._last = (step, now)

    @property
    def step_s(self) -> float | None:
        """The typical step duration so far (None before two steps were seen)."""
        return statistics.median(self._durations) if self._durations else None

    def eta(self, steps_left: int, tail_s: float = 0.0) -> float | None:
        """Seconds until the work ends: ``steps_left`` steps, then ``tail_s`` more; None while
        no step duration is known."""
        step_s = self.step_s
        if step_s is None:
            return None
        return max(0, steps_left) * step_s + max(0.0, tail_s)


class PerPixelTime:
    """How long some per-image work (a final decode) took per pixel, smoothed over runs; shared by
    the runs of one model, so it is thread-safe.

    Example:
        >>> t = PerPixelTime(); t.estimate(64 * 64) is None
        True
        >>> t.record(64 * 64, 0.1); round(t.estimate(128 * 128), 3)
        0.4
    """

    def __init__(self, smoothing: float = 0.5) -> None:
        self._per_pixel: float | None = None
        self._smoothing = smoothing
        self._lock = threading.Lock()

    def record(self, pixels: int, seconds: float) -> None:
        if pixels <= 0 or seconds < 0:
            return
        value = seconds / pixels
        with self._lock:
            old = self._per_pixel
            self._per_pixel = value if old is None else old + self._smoothing * (value - old)

    def estimate(self, pixels: int) -> float | None:
        with self._lock:
            return None if self._per_pixel is None else self._per_pixel * pixels
