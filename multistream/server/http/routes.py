"""A FastAPI route for the endpoints that start streams: called with the Request alone.

FastAPI solves an endpoint's parameters on every request (``solve_dependencies``): even two
trivial dependencies (the server state, the caller) and the Request cost it about 0.11 ms of
the event loop per request here, a tenth of what a new SSE stream costs the server before its
response starts, and still 0.05 ms with the Request as the only parameter. A `RequestOnlyRoute`
calls its endpoint with the Request and nothing else; the endpoint reads what it needs itself
(`state.state_of`, `state.principal_of`). Kept from FastAPI: the path, the OpenAPI operation
(summary, responses, ``openapi_extra``), the exception handlers (the handler still runs inside
FastAPI's ``request_response``). Not applied: dependencies of any kind, ``dependency_overrides``
included, and those of a router, of ``include_router`` or of the app; an endpoint that declares
parameters or dependencies is refused when the route is built, so one added later to such a
router fails at start-up instead of being called wrongly. (FastAPI documents subclassing
`APIRoute` and overriding ``get_route_handler``; its example wraps FastAPI's handler, this one
replaces it.)

Example:
    >>> from fastapi import APIRouter, Request
    >>> router = APIRouter()
    >>> async def post_thing(request: Request): ...
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

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        d = self.dependant
        if (d.dependencies or d.path_params or d.query_params or d.header_params or d.cookie_params
                or d.body_params):
            raise TypeError(f"{path}: a RequestOnlyRoute's endpoint takes the Request alone (no parameters "
                            "or dependencies); use a plain APIRoute")

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint  # type: ignore[return-value]
