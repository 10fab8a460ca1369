"""Python's cyclic garbage collector while the server streams: its collections wait for a moment
when no stream is live, instead of landing in the middle of streams' first tokens.

CPython collects whenever allocations cross its thresholds (``gc.get_threshold()``: 700 for the
youngest generation), wherever the program is. A streaming server allocates steadily while
streams run (events, their wire JSON, tasks, futures), and everything a live stream holds survives
the young collections, so it keeps being walked again by the older ones. Measured with
``benchmarks/sse_anchor.py`` (200 SSE clients of the scripted model, 15 interleaved rounds, this
2-core machine): the server spent 1.6-1.8 s in the collector over 3,000 streams, about 0.55 ms a
stream, with a full collection of 50-60 ms in every round; its first tokens came at 1.26-1.53x
the bare sse-starlette anchor's (p50), and at 1.0-1.15x with the collector switched off.

`ServingCollector` raises the first threshold to `BUSY_THRESHOLD` and, every `TICK_S` on the
event loop, looks whether any stream is live: when none is, it runs at once the collection
CPython's thresholds make due (the oldest generation whose count has reached its threshold), so
the walk happens while nobody waits for a token. (A threshold switched only once a stream is
seen live would leave the first tokens of a burst to the old one.) Under sustained load, with a
live stream at every check, the collector still runs by itself, each time `BUSY_THRESHOLD`
objects have piled up: memory stays bounded (about 20 MB of Python objects), and
the young collection it then does (some 50 ms here) takes the place of the full ones CPython
would have done meanwhile. The server's runner (`multistream.server.serve`, so `multistream
serve`) starts it once the models have loaded and start-up's objects are frozen, and puts the
thresholds back when it stops; an app served by another runner keeps CPython's behaviour.

Example:
    >>> import asyncio, gc
    >>> async def demo():
    ...     collector = ServingCollector(lambda: 0, tick_s=0.01)   # no stream live
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
from collections.abc import Callable

__all__ = ["BUSY_THRESHOLD", "TICK_S", "ServingCollector"]

#: The first threshold while streams are live: objects allocated (net) before a young collection.
BUSY_THRESHOLD = 100_000
#: How often the event loop checks whether any stream is live.
TICK_S = 0.1


class ServingCollector:
    """Times the cyclic collector around live streams (see the module docstring); ``live()`` is
    how many streams are live now (``len(registry.live)``)."""

    def __init__(self, live: Callable[[], int], *, busy_threshold: int = BUSY_THRESHOLD,
                 tick_s: float = TICK_S) -> None:
        self.live = live
        self.busy_threshold = busy_threshold
        self.tick_s = tick_s
        self._idle = gc.get_threshold()  # CPython's (or the process's own) thresholds
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.idle_collections = 0  # collections run at a moment without live streams

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Raise the first threshold and check every `tick_s` on ``loop`` (call it on the loop's thread)."""
        self._idle = gc.get_threshold()
        gc.set_threshold(self.busy_threshold, *self._idle[1:])
        self._loop = loop
        self._tick()

    def stop(self) -> None:
        """Stop checking and put the thresholds back (idempotent; from any thread once the loop is done)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None
        gc.set_threshold(*self._idle)

    def _tick(self) -> None:
        if self._loop is None:
            return
        if not self.live():
            generation = _due(gc.get_count(), self._idle)
            if generation is not None and gc.isenabled():  # a model load's pause (`multistream._gc`) waits
                gc.collect(generation)
                self.idle_collections += 1
        self._timer = self._loop.call_later(self.tick_s, self._tick)


def _due(counts: tuple[int, int, int], thresholds: tuple[int, ...]) -> int | None:
    """The generation CPython would collect now with these thresholds: the oldest whose count has
    reached its threshold (gen 0: objects allocated; gen 1 and 2: collections of the one below),
    or None when even the youngest has not.

    >>> _due((800, 10, 3), (700, 10, 10)), _due((800, 2, 3), (700, 10, 10)), _due((5, 0, 0), (700, 10, 10))
    (1, 0, None)
    """
    if counts[0] < thresholds[0]:
        return None
    for generation in (2, 1):
        if counts[generation] >= thresholds[generation]:
            return generation
    return 0
