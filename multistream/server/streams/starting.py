"""Starting a model's stream without holding the event loop up: ``model.stream(...)`` tokenizes a
prompt, compiles a grammar or (the embedded video model) encodes its motion prior, seconds on a
busy CPU, and every other stream's events and every other request wait while it runs on the
loop. `start_stream` runs it on a worker thread of its own, unless the model's ``.stream()``
needs the loop (``stream_needs_loop``: the Ray handle schedules its pump there).

Example:
    >>> import asyncio
    >>> from multistream.testing import ScriptedTextModel
    >>> async def main():
    ...     stream = await start_stream(ScriptedTextModel(), lambda m: m.stream("hi"))
    ...     return [ev.type for ev in stream][-1]
    >>> asyncio.run(main())
    'text'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from ...stream import Stream

__all__ = ["start_off_loop", "start_stream"]

S = TypeVar("S", bound=Stream)

# Threads of their own: the default executor also runs long model calls (`run_admitted`), and a
# stream's start must not queue behind them.
_STARTERS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="multistream-start")


async def start_off_loop(start: Callable[[], S]) -> S:
    """``start()`` (a model's ``.stream(...)``) on a worker thread, not on the event loop. A caller
    cancelled meanwhile has the stream closed once it exists: nobody else holds it."""
    task = asyncio.get_running_loop().run_in_executor(_STARTERS, start)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def close(done: asyncio.Future[S]) -> None:
            if not done.cancelled() and done.exception() is None:
                done.result().close()

        task.add_done_callback(close)
        raise


async def start_stream(model: Any, start: Callable[[Any], S]) -> S:
    """``start(model)`` on a worker thread (`start_off_loop`), or on the loop for a model that says
    its ``.stream()`` needs it (``stream_needs_loop = True``)."""
    if getattr(model, "stream_needs_loop", False):
        return start(model)
    return await start_off_loop(lambda: start(model))
