"""A FastAPI route for the endpoints that start streams: called with the Request alone.

FastAPI solves an endpoint's parameters on every request (``solve_dependencies``): even two
trivial dependencies (the server state, the caller) and the Request cost it about 0.11 ms of
the event loop per request here, a tenth of what a new SSE stream costs the server before its
response starts, and no less with the Request as the only parameter (0.05 ms). A
`RequestOnlyRoute` calls its endpoint with the Request and nothing else; the endpoint reads what
it needs itself (`state.state_of`, `state.principal_of`). Everything else is FastAPI's own: the
path, the OpenAPI operation (summary, responses, ``openapi_extra``), the exception handlers.
FastAPI documents subclassing `APIRoute` and overriding ``get_route_handler`` for this.

Example:
    >>> from fastapi import APIRouter
    >>> router = APIRouter()
    >>> async def post_thing(request): ...
    >>> router.add_api_route("/v1/thing", post_thing, methods=["POST"], route_class_override=RequestOnlyRoute)
    >>> type(router.routes[0]).__name__
    'RequestOnlyRoute'
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["RequestOnlyRoute"]


class RequestOnlyRoute(APIRoute):
    """An `APIRoute` whose endpoint is ``async def endpoint(request) -> Response``, called directly."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint  # type: ignore[return-value]
