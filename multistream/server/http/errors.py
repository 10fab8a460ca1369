"""The one table of refusals every route documents in ``/openapi.json``.

Each route lists the statuses it can answer with its surface's error body (`ErrorResponse` on the
native routes, `OpenAIErrorResponse` on the OpenAI ones); the descriptions are written once here.

Example:
    >>> from multistream.server.http.bodies import OpenAIErrorResponse
    >>> table = error_responses(OpenAIErrorResponse)
    >>> sorted(table)[:3], table[413]["description"]
    ([400, 401, 403], 'body too large')
"""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_STATUSES", "error_responses", "json_body", "request_bodies"]

# Every status a route of this server can refuse with: a body can be too large, not JSON or too
# slow on any POST, and admission can answer 429 or 503 on any generating route.
ERROR_STATUSES: dict[int, str] = {
    400: "bad request: the message names the field and the fix",
    401: "missing or wrong API key",
    403: "not allowed",
    404: "no such stream, response or model",
    408: "the body came too slowly",
    413: "body too large",
    415: "not JSON",
    429: "queue or quota full (Retry-After)",
    500: "server failure (a request id, no internals)",
    503: "loading, busy or shutting down (Retry-After)",
}


def error_responses(model: type, extra: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` for every refusal, each with ``model`` (the error body) as its schema;
    ``extra`` adds or rewords statuses particular to a route (e.g. 409 on an edit of an ended stream)."""
    return {status: {"model": model, "description": text} for status, text in {**ERROR_STATUSES, **(extra or {})}.items()}


def json_body(model: type, media: tuple[str, ...] = ("application/json",)) -> dict[str, Any]:
    """``openapi_extra`` naming ``model`` as the request body (the routes read the body themselves,
    so FastAPI cannot infer it). The model is remembered: the app puts every one `request_bodies`
    lists in the document, so a route's ``$ref`` always resolves.

    Example:
        >>> from multistream.server.bodies import SteerBody
        >>> json_body(SteerBody)["requestBody"]["content"]["application/json"]["schema"]
        {'$ref': '#/components/schemas/SteerBody'}
    """
    known = _REQUEST_BODIES.setdefault(model.__name__, model)
    if known is not model:  # two schemas under one name: one route's $ref would show the other's body
        raise TypeError(f"two request bodies are named {model.__name__} ({known.__module__}, {model.__module__})")
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {m: {"schema": schema} for m in media}}}


def request_bodies() -> tuple[type, ...]:
    """Every model a route named with `json_body`, for the OpenAPI document's components."""
    return tuple(_REQUEST_BODIES.values())


_REQUEST_BODIES: dict[str, type] = {}
