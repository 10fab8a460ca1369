"""Reading and checking a JSON request body, and the error bodies every refusal is written in.

The routes read the body themselves (size cap while reading, depth and big-integer guards, lone
surrogates) and then validate it with a pydantic model, so every refusal is a 4xx naming the
field, the problem and the fix, in the server's error shape (`ErrorResponse` on the native routes,
`OpenAIErrorResponse` on the OpenAI ones).

Example:
    >>> parse_json_object(b'{"prompt": "hi"}')
    {'prompt': 'hi'}
"""

from __future__ import annotations

import asyncio
import json
import sys
import typing
from typing import TYPE_CHECKING, Any, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from .problems import Problem

if TYPE_CHECKING:
    from ..settings import ServerSettings

__all__ = [
    "LAX_BODY", "STRICT_BODY", "ErrorBody", "ErrorResponse", "OpenAIErrorBody", "OpenAIErrorResponse",
    "parse_json", "parse_json_object", "read_body", "read_bytes", "read_json", "require_object", "validate_body",
]

STRICT_BODY = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
LAX_BODY = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_MAX_DEPTH = 32


class HasSettings(Protocol):
    """What `read_body` needs of the server state: its settings (limits and timeouts)."""

    settings: ServerSettings


# -- response bodies -----------------------------------------------------------------------------


class ErrorBody(BaseModel):
    type: str = Field(description="machine-readable kind, e.g. 'invalid_type', 'queue_full'")
    message: str = Field(description="what went wrong and how to fix it")
    request_id: Optional[str] = Field(default=None, description="quote it when reporting a server error")


class ErrorResponse(BaseModel):
    """Every refusal on the native routes."""

    error: ErrorBody


class OpenAIErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIErrorResponse(BaseModel):
    """Every refusal on the OpenAI routes (the official SDK's error shape)."""

    error: OpenAIErrorBody


# -- reading -------------------------------------------------------------------------------------


async def read_json(request: Request, max_bytes: int, *, require_json_type: bool = True) -> Any:
    """The request body parsed as JSON; 413 past ``max_bytes`` (checked while reading), 415 when
    the content type is not JSON (a cross-site form cannot send ``application/json``), 400 when
    it is not valid JSON."""
    if require_json_type:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
            raise Problem(415, "unsupported_media_type",
                          f"send the body as JSON with 'Content-Type: application/json' (got {ctype or 'none'!r})")
    return parse_json(await read_bytes(request, max_bytes))


async def read_bytes(request: Request, max_bytes: int) -> bytes:
    """The request body's bytes; 413 past ``max_bytes`` (declared, or counted while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; send a finite number")


def parse_json(raw: bytes | str) -> Any:
    """JSON text -> value, refusing what would crash or stall a parser: deep nesting, huge integer
    literals, NaN/Infinity, lone surrogates. Every failure is a 400 ``invalid_json``."""
    if not raw:
        raise Problem(400, "invalid_json", "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError as exc:
        raise Problem(400, "invalid_json", f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    depth = _max_depth(text)
    if depth > _MAX_DEPTH:
        raise Problem(400, "invalid_json", f"the JSON nests {depth} levels deep; at most {_MAX_DEPTH} are accepted")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise Problem(400, "invalid_json", f"the request body is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # ValueError: an integer literal over sys.get_int_max_str_digits() digits, or NaN/Infinity.
        raise Problem(400, "invalid_json", f"the request body is not acceptable JSON: {str(exc)[:200]}") from None
    bad = _lone_surrogate(body)
    if bad is not None:
        raise Problem(400, "invalid_text", f"{bad} contains a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                      "which is not text; send valid Unicode", param=bad.strip("'"))
    return body


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    return require_object(parse_json(raw))


def require_object(body: Any) -> dict[str, Any]:
    """``body`` if it is a JSON object, else a 400 naming what it is in JSON's terms (``got null``)."""
    if not isinstance(body, dict):
        raise Problem(400, "invalid_json", f"the request body must be a JSON object, got {_json_kind(body)}")
    return body


def _json_kind(value: Any) -> str:
    # The client wrote JSON, so name its type as JSON does ("got NoneType" meant nothing to it).
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _max_depth(text: str) -> int:
    """Nesting depth of brackets outside strings, without recursion (a cheap pre-check)."""
    if "[" not in text and "{" not in text:
        return 0
    depth = best = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > best:
                best = depth
                if best > _MAX_DEPTH:
                    return best
        elif ch in "]}":
            depth -= 1
    return best


def _lone_surrogate(value: Any) -> str | None:
    stack: list[tuple[str, Any]] = [("the body", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    continue
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return "a field name"
                stack.append((f"'{k}'", item))
        elif isinstance(v, list):
            stack.extend((where, item) for item in v)
    return None


def _too_large(size: int, limit: int) -> Problem:
    return Problem(413, "body_too_large",
                   f"the request body has {size} bytes or more; this server accepts at most {limit} (max_body_bytes)")


# -- validating ----------------------------------------------------------------------------------


def _show(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=True)[:80]
    except (TypeError, ValueError):
        return type(value).__name__


def validate_body(model: type[BaseModel], body: Any, what: str, *, strict: bool | None = None) -> BaseModel:
    """``model.model_validate(body)``, with pydantic's errors turned into one clear 400.
    ``strict=False`` reads numbers from strings (a form's values are all strings)."""
    require_object(body)
    try:
        return model.model_validate(body, strict=strict)
    except ValidationError as exc:
        raise _problem(model, exc, body, what) from None


def _path(loc: Any) -> str:
    """A pydantic error location as the client wrote it: ``messages[0].content``."""
    return str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])


def _nested_model(field: Any) -> type[BaseModel] | None:
    """The pydantic model an object field holds (``Optional[StreamOptions]`` -> ``StreamOptions``)."""
    if field is None:
        return None
    candidates = [field.annotation, *typing.get_args(field.annotation)]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _problem(model: type[BaseModel], exc: ValidationError, body: dict[str, Any], what: str) -> Problem:
    errors = exc.errors(include_url=False)
    fields = model.model_fields
    nested = [e["loc"] for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) > 1]
    if nested:
        # A field inside an object field ({"stream_options": {"bogus": 1}}): name that one, and what
        # the object takes (the outer name alone read "unknown field 'stream_options'").
        loc = nested[0]
        inner = _nested_model(fields.get(str(loc[0])))
        takes = f"; '{loc[0]}' takes {sorted(inner.model_fields)}" if inner is not None else ""
        return Problem(400, "unknown_field", f"unknown field '{_path(loc)}' for {what}{takes}", param=str(loc[0]))
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and e["loc"])
    if unknown:
        return Problem(400, "unknown_field", f"unknown field(s) {unknown} for {what}; accepted fields: {sorted(fields)}",
                       param=unknown[0])
    missing = [str(e["loc"][0]) for e in errors if e["type"] == "missing" and len(e["loc"]) == 1]
    if missing:
        name = missing[0]
        return Problem(400, "missing_field", f"'{name}' is required ({fields[name].description})", param=name)
    first = errors[0]
    name = str(first["loc"][0]) if first["loc"] else "body"
    where = _path(first["loc"]) if first["loc"] else name
    expected = fields[name].description if name in fields else "a valid value"
    value = body.get(name)
    if first["type"] in ("finite_number",):
        return Problem(400, "invalid_argument", f"'{where}' must be a finite number, got {_show(value)}", param=name)
    kind = "invalid_argument" if first["type"] in ("too_short", "too_long") else "invalid_type"
    return Problem(400, kind, f"'{where}' must be {expected}, got {_show(value)} ({first['msg']})", param=name)


async def read_body(request: Request, state: HasSettings, *, raw: bool = False) -> Any:
    """The JSON body, within ``body_timeout_s`` (a client that trickles its body is cut off);
    ``raw``: its bytes, unparsed, whatever their type (e.g. a form, which the route reads)."""
    limit = state.settings.max_body_bytes
    try:
        reading = read_bytes(request, limit) if raw else read_json(request, limit)
        if sys.version_info >= (3, 11):  # a deadline on this task: no task per request as wait_for makes
            async with asyncio.timeout(state.settings.body_timeout_s):
                return await reading
        return await asyncio.wait_for(reading, state.settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise Problem(408, "request_timeout", f"the request body did not arrive within "
                      f"{state.settings.body_timeout_s:g} s (body_timeout_s); send it at once") from None
