"""Admission control per model: a concurrency limit and a bounded priority queue.

A request either runs at once (a free slot and nobody queued), waits in the queue (higher
``priority`` first, then first come first served), or is refused with `QueueFull` (HTTP 429 with a
``Retry-After`` estimated from recent generation times). Pure asyncio, no I/O.

A waiter can ask to be told where it stands (``on_move``): ``on_move(position, queued)`` is
called when it joins the queue and each time its position changes (position 1 = next to run;
``queued`` = how many wait in all), e.g. a higher priority arrives ahead of it or one ahead leaves.

Example:
    >>> import asyncio
    >>> async def demo():
    ...     gate = Admission("text", concurrency=1, queue_size=4)
    ...     await gate.acquire(priority=0)      # runs at once
    ...     waiter = asyncio.ensure_future(gate.acquire(priority=5))
    ...     await asyncio.sleep(0)
    ...     queued = gate.queued
    ...     gate.release(duration_s=1.0)        # hands the slot to the waiter
    ...     await waiter
    ...     return queued, gate.running
    >>> asyncio.run(demo())
    (1, 1)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections.abc import Callable

from ..http.problems import Problem

__all__ = ["Admission", "QueueFull"]


class QueueFull(Problem):
    def __init__(self, name: str, queued: int, retry_after: int) -> None:
        super().__init__(429, "queue_full",
                         f"the {name} queue is full ({queued} requests waiting); retry after {retry_after} s",
                         {"Retry-After": str(retry_after)})


class Admission:
    """Concurrency slots for one model, with a bounded priority queue in front of them."""

    def __init__(self, name: str, concurrency: int, queue_size: int) -> None:
        self.name = name
        self.concurrency = concurrency
        self.queue_size = queue_size
        self.running = 0
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._avg_duration_s: float | None = None
        self._closed: Problem | None = None
        # Waiters that asked for their position: future -> [on_move, last position told].
        self._watchers: dict[asyncio.Future[None], list[object]] = {}

    @property
    def queued(self) -> int:
        return sum(1 for _, _, fut in self._heap if not fut.done())

    def would_wait(self) -> bool:
        """True when a request now would queue (or be refused) rather than run at once."""
        return self._closed is not None or not (self.running < self.concurrency and not self.queued)

    def retry_after(self) -> int:
        """Seconds until a queue slot likely frees: queue length x average duration / slots."""
        avg = self._avg_duration_s or 1.0
        return max(1, math.ceil(avg * (self.queued + 1) / self.concurrency))

    def try_acquire(self) -> bool:
        """Take a free slot now if there is one (no suspension); False when a request would queue.

        The hot path of an idle server: `acquire` is a coroutine, and awaiting it under a
        disconnect watch costs a task and loop iterations before a stream can start."""
        if self._closed is None and self.running < self.concurrency and not self.queued:
            self.running += 1
            return True
        return False

    async def acquire(self, priority: int = 0, timeout: float | None = None,
                      on_move: Callable[[int, int], None] | None = None) -> None:
        """Wait for a slot. Raises `QueueFull` at once when the queue is full, a 503 `Problem`
        after ``timeout`` seconds in the queue or when the server is shutting down.
        ``on_move(position, queued)``: called (before the first suspension) when the request
        joins the queue, then each time its position changes; never when it runs at once."""
        if self._closed is not None:
            raise self._closed
        if self.try_acquire():
            return
        if self.queued >= self.queue_size:
            raise QueueFull(self.name, self.queued, self.retry_after())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (-priority, next(self._order), fut))
        if on_move is not None:
            self._watchers[fut] = [on_move, 0]
        if self._watchers:
            self._tell_positions()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # the slot arrived just as we gave up: pass it on
            else:
                fut.cancel()
                self._compact()
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                raise Problem(503, "queue_timeout",
                              f"waited {timeout:g} s in the {self.name} queue without getting a slot; retry later",
                              {"Retry-After": str(self.retry_after())}) from None
            raise
        finally:
            self._watchers.pop(fut, None)

    def release(self, duration_s: float | None = None) -> None:
        """Free a slot (hand it to the best waiter). ``duration_s`` feeds the Retry-After estimate."""
        if duration_s is not None:
            a = self._avg_duration_s
            self._avg_duration_s = duration_s if a is None else 0.8 * a + 0.2 * duration_s
        self.running -= 1
        while self._heap and self.running < self.concurrency:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                self.running += 1
                fut.set_result(None)
                self._watchers.pop(fut, None)
        if self._watchers:
            self._tell_positions()

    def close(self, problem: Problem) -> None:
        """Refuse new requests and fail every waiter with ``problem`` (graceful shutdown)."""
        self._closed = problem
        while self._heap:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_exception(problem)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if not e[2].done()]
        heapq.heapify(self._heap)
        if self._watchers:
            self._tell_positions()

    def _tell_positions(self) -> None:
        """Call ``on_move`` of every watching waiter whose position changed (the queue is at most
        ``queue_size`` long, so sorting it on each change is cheap)."""
        waiting = sorted(e for e in self._heap if not e[2].done())
        for position, (_, _, fut) in enumerate(waiting, 1):
            watcher = self._watchers.get(fut)
            if watcher is not None and watcher[1] != position:
                watcher[1] = position
                try:
                    watcher[0](position, len(waiting))  # type: ignore[operator]
                except Exception:  # noqa: BLE001 - a listener must not break the queue
                    logging.getLogger("multistream.server").exception("a queue position listener failed")
