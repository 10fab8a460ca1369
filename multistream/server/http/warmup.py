"""The first request's one-off costs, paid at start-up instead of by the first client.

FastAPI builds the state of each included router's routes (a pydantic adapter for every
parameter and body) the first time a request is matched against them, and anyio imports its
asyncio backend the first time one of its primitives is used (then: by sse-starlette). On a 2-core machine (scripted
model, raw socket) the server's first ``POST /v1/text`` took 86-91 ms to its first event against
4-5 ms for the next ones, and its first ``GET /healthz`` 96-100 ms. `warm_up` pays both on the event loop as
soon as the server starts: one request for a path no route serves walks every router, so every
route's state is built; nothing is sent anywhere.

Example (in an app's lifespan):
    >>> asyncio.get_running_loop().create_task(warm_up(app.router))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from starlette.types import ASGIApp, Message

__all__ = ["WARM_UP_PATH", "warm_up"]

logger = logging.getLogger("multistream.server")

WARM_UP_PATH = "/.multistream-warm-up"  # served by no route: the router tries every route on it


async def warm_up(router: ASGIApp) -> None:
    """Match one request for `WARM_UP_PATH` through ``router`` (the app's, not the middleware
    stack's: no metrics, logs or request ids for it) and import anyio's backend. Never raises:
    a failed warm-up only leaves the costs to the first request."""
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": WARM_UP_PATH, "raw_path": WARM_UP_PATH.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1")], "client": None, "server": None, "state": {},
    }

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass  # the 404 goes nowhere

    try:
        anyio.current_time()  # the first call imports anyio's asyncio backend
        await router(scope, receive, send)
    except Exception:  # noqa: BLE001 - an optimisation: the server works without it
        logger.debug("warm-up of the routes failed; the first request builds them", exc_info=True)
