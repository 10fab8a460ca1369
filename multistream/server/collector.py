"""Python's cyclic garbage collector while the server streams: its collections wait for a moment
when no stream is live, instead of landing in the middle of streams' first tokens.

CPython collects whenever allocations cross its thresholds (``gc.get_threshold()``: 700 for the
youngest generation), wherever the program is. A streaming server allocates steadily while
streams run (events, their wire JSON, tasks, futures), and everything a live stream holds survives
the young collections, so it keeps being walked again by the older ones. Measured with
``benchmarks/sse_anchor.py`` (200 SSE clients of the scripted model, 15 interleaved rounds, this
2-core machine): the server spent 1.6-1.8 s in the collector over 3,000 streams, about 0.55 ms a
stream, with a full collection of 50-60 ms in every round; its first tokens came at 1.15-1.57x
the bare sse-starlette anchor's (p50, eight runs), and at 1.01-1.15x with automatic collection
switched off after start-up (three runs).

`ServingCollector` raises the first threshold to `BUSY_THRESHOLD` and, every `TICK_S` on the
event loop, asks whether now is a quiet moment (the runner: no stream live, none started or ended
in the last 20 ms); then it runs at once the young collection CPython's thresholds make due (the
oldest of generations 0 and 1 whose count has reached its threshold), so the walk happens while
nobody waits for a token. (A threshold switched only once a stream is seen live would leave the
first tokens of a burst to the old one.) A full collection (generation 2) is due by the same
counts, but this one does not know CPython's other condition (the objects waiting to be examined
must be a quarter of the old generation), so it runs one at a quiet moment at most every
`FULL_INTERVAL_S`. Under sustained load, with no quiet moment, CPython collects by itself, with
all its rules, each time `BUSY_THRESHOLD` objects have piled up, so memory stays bounded. On Python 3.14 and later (the incremental collector) the due collection is
``gc.collect(1)``, a young collection and one increment of the old generation. The server's
runner (`multistream.server.serve`, so `multistream serve`) starts it once the models have loaded
and start-up's objects are frozen, and stops it when it stops; the thresholds come back when the
last collector of the process stops (servers can run side by side); an app served by another
runner keeps CPython's behaviour, and so does a process that set its first threshold to 0.

Example:
    >>> import asyncio, gc
    >>> async def demo():
    ...     collector = ServingCollector(lambda: True, tick_s=0.01)   # always a quiet moment
    ...     collector.start(asyncio.get_running_loop())
    ...     raised = gc.get_threshold()[0]
    ...     await asyncio.sleep(0.05)
    ...     collector.stop()
    ...     return raised
    >>> asyncio.run(demo()) == BUSY_THRESHOLD
    True
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["BUSY_THRESHOLD", "FULL_INTERVAL_S", "TICK_S", "ServingCollector"]

#: The first threshold while serving: objects allocated (net) before CPython collects by itself.
BUSY_THRESHOLD = 100_000
#: How often the event loop asks whether now is a quiet moment.
TICK_S = 0.1
#: The shortest time between two full collections run at quiet moments.
FULL_INTERVAL_S = 10.0

_lock = threading.Lock()
_running = 0  # collectors started and not stopped, in this process
_saved: tuple[int, ...] = ()  # the thresholds before the first of them started (CPython's: what is due)


class ServingCollector:
    """Times the cyclic collector around streams (see the module docstring); ``quiet()`` says
    whether now is a moment to collect (the runner: ``registry.idle_for(0.02)``)."""

    def __init__(self, quiet: Callable[[], bool], *, busy_threshold: int = BUSY_THRESHOLD,
                 tick_s: float = TICK_S) -> None:
        self.quiet = quiet
        self.busy_threshold = busy_threshold
        self.tick_s = tick_s
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_full = time.monotonic()  # start-up's objects were collected and frozen just now
        self.idle_collections = 0  # collections run at a quiet moment

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Raise the first threshold and check every `tick_s` on ``loop`` (call it on the loop's thread)."""
        global _running, _saved
        if self._loop is not None:
            return
        with _lock:
            if _running == 0:
                _saved = gc.get_threshold()
                if _saved[0] > 0:  # 0: the process switched automatic collection off; it stays off
                    gc.set_threshold(max(self.busy_threshold, _saved[0]), *_saved[1:])
            _running += 1
        self._loop = loop
        self._tick()

    def stop(self) -> None:
        """Stop checking; the last collector of the process to stop puts the thresholds back
        (idempotent; from any thread once the loop is done)."""
        global _running
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is None:
            return
        self._loop = None
        with _lock:
            _running -= 1
            if _running == 0:
                gc.set_threshold(*_saved)

    def _tick(self) -> None:
        if self._loop is None:
            return
        if gc.isenabled() and self.quiet():  # a model load's pause (`multistream._gc`) waits
            generation = _due(gc.get_count(), _saved)  # what CPython's own thresholds make due
            if generation == 2 and time.monotonic() - self._last_full < FULL_INTERVAL_S:
                generation = 1
            if generation is not None:
                gc.collect(generation)
                self.idle_collections += 1
                if generation == 2:
                    self._last_full = time.monotonic()
        self._timer = self._loop.call_later(self.tick_s, self._tick)


def _due(counts: tuple[int, ...], thresholds: tuple[int, ...]) -> int | None:
    """The generation CPython's counts make due: the oldest whose count has reached its threshold
    (gen 0: objects allocated; gen 1 and 2: collections of the one below), None when even the
    youngest has not or automatic collection is off (first threshold 0). On 3.14+ (incremental:
    no third threshold) a due collection is generation 1: young plus an increment.

    >>> _due((800, 10, 3), (700, 10, 10)), _due((800, 2, 3), (700, 10, 10)), _due((5, 0, 0), (700, 10, 10))
    (1, 0, None)
    """
    if thresholds[0] <= 0 or counts[0] < thresholds[0]:
        return None
    if sys.version_info >= (3, 14):
        return 1
    for generation in (2, 1):
        if counts[generation] >= thresholds[generation]:
            return generation
    return 0
