"""Waiting for work while watching the HTTP client: one helper for every route that waits.

A route that waits (for an admission slot, or for a whole answer on a non-streaming route) must
not keep the model working for a client that has gone: `until_done_or_gone` awaits the work and
checks the connection every half second; when the client is gone it cancels the wait, runs
``on_gone`` (cancel the generation) and answers 499.

Example:
    >>> import asyncio
    >>> async def answer() -> int:
    ...     return 42
    >>> asyncio.run(until_done_or_gone(answer(), None))
    42
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from .problems import Problem

__all__ = ["until_done_or_gone"]

T = TypeVar("T")
_POLL_S = 0.5  # how often the connection is checked: a gone client is noticed within this


async def until_done_or_gone(awaitable: Awaitable[T], request: Request | None, *,
                             on_gone: Callable[[], Any] | None = None,
                             message: str = "the client went away before the answer was ready",
                             on_abandoned: Callable[[], Any] | None = None) -> T:
    """Await ``awaitable``, or give up with a 499 ``client_closed`` once ``request``'s client is gone.

    ``on_gone`` runs when the client went away (e.g. cancel the generation). ``on_abandoned`` runs
    when the wait succeeded but its result never reached the caller (the caller was cancelled in
    between), so an admission slot won then is given back, not leaked.
    """
    task = asyncio.ensure_future(awaitable)
    delivered = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_S)
            if done:
                result = task.result()
                delivered = True
                return result
            if request is not None and await request.is_disconnected():
                task.cancel()
                if on_gone is not None:
                    on_gone()
                raise Problem(499, "client_closed", message)
    finally:
        if not task.done():
            task.cancel()
        elif not delivered and on_abandoned is not None and not task.cancelled() and task.exception() is None:
            on_abandoned()
