"""HTTP errors as values: every rejection carries a status, a machine type and a human message.

Native routes answer ``{"error": {"type", "message"}}``; OpenAI routes answer OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` so the official SDK raises the right class.

Example:
    >>> p = Problem(429, "queue_full", "the text queue is full (64 waiting); retry later", {"Retry-After": "2"})
    >>> p.body()["error"]["type"]
    'queue_full'
    >>> Problem(400, "invalid_argument", "seed must be an integer or None, got -1").message  # JSON's word
    'seed must be an integer or null, got -1'
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import JSONResponse

from ...errors import InvalidArgumentError, MultistreamError, PromptTooLongError

__all__ = ["Problem", "json_spelling", "problem_from_exception"]

# The library's messages are written for Python callers, whose way to ask for the default is None
# ("seed must be an integer in [0, 2**63) or None"); an HTTP client writes JSON, where it is null.
_PYTHON_WORDS = ((re.compile(r"\bTrue, False or None\b"), "true, false or null"), (re.compile(r"\bor None\b"), "or null"))


def json_spelling(message: str) -> str:
    """A library message as an HTTP client reads it: Python's ``None`` (and ``True, False``) in
    JSON's words, as the command line says ``(or leave --seed out)`` for the same message.

    Example:
        >>> json_spelling("chat must be True, False or None (automatic), got 'yes'")
        "chat must be true, false or null (automatic), got 'yes'"
    """
    for pattern, words in _PYTHON_WORDS:
        message = pattern.sub(words, message)
    return message


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                 500: "server_error", 503: "server_error"}


class Problem(Exception):
    """A request we refuse: raise it anywhere in a handler; the app turns it into the response."""

    def __init__(self, status: int, type: str, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        message = json_spelling(message)
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.headers = dict(headers or {})
        self.param = param

    def body(self, openai: bool = False) -> dict[str, Any]:
        if openai:
            return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                              "param": self.param, "code": self.type}}
        return {"error": {"type": self.type, "message": self.message}}

    def response(self, openai: bool = False) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        return JSONResponse(self.body(openai), status_code=self.status, headers=headers)


def problem_from_exception(exc: BaseException) -> Problem:
    """Map a model's call-time validation error to a 4xx; anything else is the server's fault."""
    if isinstance(exc, Problem):
        return exc
    if isinstance(exc, PromptTooLongError):
        return Problem(400, "prompt_too_long", str(exc), param=exc.param or "prompt")
    if isinstance(exc, InvalidArgumentError):
        return Problem(400, "invalid_argument", str(exc), param=exc.param)  # the option named where it was raised
    if isinstance(exc, MultistreamError):
        return Problem(400, type(exc).__name__, str(exc))
    return Problem(500, "internal_error", "the server failed on this request; the server log has the details")
