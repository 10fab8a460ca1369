"""A model stand-in whose ``.stream()`` goes through the server's gates, for the Gradio demo.

The demo page calls ``model.stream(...)`` as it would on a real model; `GatedModel` turns that
into `ServerState.open_stream` (admission, quotas, priority ceiling, content filter, request
timeout, drain) and forwards the server stream's events (already filtered) into a `Stream`. The
waiting (a model still loading, the queue) happens in the stream's producer thread, never on
the event loop, so a page visit during model loading freezes nothing else.

Example:
    >>> gated = GatedModel(app, "text")                                     # doctest: +SKIP
    >>> for ev in gated.stream("hi", max_new_tokens=8): print(ev.delta)     # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

from ...errors import InvalidArgumentError
from ...events import Event
from ...stream import Stream, StreamWriter
from ..access.keys import Principal
from ..http.problems import Problem, problem_from_exception

__all__ = ["GatedModel"]

_LOAD_WAIT_S = 300.0


class GatedModel:
    """``.stream(prompt, **kwargs)`` through the server of ``app`` (the demo's model provider)."""

    def __init__(self, app: Any, kind: str) -> None:
        self.app = app
        self.kind = kind
        state = app.state.multistream
        self.name = state.models[kind].name
        s = state.settings
        self.principal = Principal("demo", s.max_priority, s.client_concurrency, False)

    def stream(self, prompt: Any, **kwargs: Any) -> Stream:
        state = self.app.state.multistream
        loop: asyncio.AbstractEventLoop = state.loop
        kind = self.kind
        principal = self.principal
        kwargs = {"prompt": prompt, **kwargs}

        def producer(w: StreamWriter) -> None:
            slot = state.models[kind]
            deadline = time.monotonic() + _LOAD_WAIT_S
            while slot.state in ("pending", "loading") and time.monotonic() < deadline and not w.cancelled:
                time.sleep(0.2)  # in this producer thread, not on the event loop
            inbox: queue.Queue[Any] = queue.Queue()

            async def follow() -> None:
                def queued(position: int, waiting: int) -> None:  # the page shows "waiting: N ahead"
                    out.queue_position = (position, waiting)

                try:
                    record = await state.open_stream(kind, kwargs, principal=principal, resumable=False,
                                                     on_queued=queued)
                except Exception as exc:  # noqa: BLE001 - reported on the page as the stream's error
                    inbox.put(problem_from_exception(exc))
                    return
                finally:
                    out.queue_position = None  # admitted (or refused): no longer waiting
                inbox.put(record)
                async for ev in record.subscribe():
                    inbox.put(ev)

            future = asyncio.run_coroutine_threadsafe(follow(), loop)
            record = None
            cancelled = False
            while True:
                if w.cancelled and record is not None and not cancelled:
                    cancelled = True
                    loop.call_soon_threadsafe(record.cancel)
                try:
                    item = inbox.get(timeout=0.05)
                except queue.Empty:
                    if future.done() and inbox.empty():
                        return
                    continue
                if isinstance(item, Problem):
                    w.fail(InvalidArgumentError(item.message))
                    return
                if not isinstance(item, Event.__args__):  # type: ignore[attr-defined]
                    record = item
                    continue
                w.forward(item)
                if item.is_final:
                    return

        out = Stream(producer, kind=kind)
        out.queue_position = None  # (position, waiting) while the server's queue holds the request
        return out
