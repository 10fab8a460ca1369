"""Request bodies: read JSON with a size cap, check field names and types, apply server limits.

What the model itself checks (ranges such as ``top_p`` in (0, 1]) is left to its ``.stream()``,
whose `InvalidArgumentError` becomes a 400 with the same message; here we make sure only known
fields of the right JSON type reach it, and that the server's limits hold.

Example:
    >>> from multistream.server import ServerSettings
    >>> kwargs, priority = parse_text_body({"prompt": "hi", "max_new_tokens": 8, "priority": 2}, ServerSettings())
    >>> kwargs["max_new_tokens"], priority
    (8, 2)
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from .problems import Problem
from .settings import ServerSettings

__all__ = ["parse_image_body", "parse_text_body", "read_json"]


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_bytes`` (checked while reading), 400 if
    it is not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    if not raw:
        raise Problem(400, "invalid_json", "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Problem(400, "invalid_json", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Problem(400, "invalid_json", f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _too_large(size: int, limit: int) -> Problem:
    return Problem(413, "body_too_large",
                   f"the request body has {size} bytes or more; this server accepts at most {limit} (max_body_bytes)")


# JSON types per field: "int", "number", "str", "bool", "null", "str_list", "messages".
_TEXT_FIELDS: dict[str, tuple[str, ...]] = {
    "prompt": ("str", "messages"),
    "max_new_tokens": ("int",),
    "temperature": ("number",),
    "top_p": ("number",),
    "top_k": ("int",),
    "repetition_penalty": ("number",),
    "seed": ("int", "null"),
    "stop": ("str", "str_list", "null"),
    "chunk_tokens": ("int",),
    "chunk_ms": ("number", "null"),
    "chat": ("bool", "null"),
    "priority": ("int",),
}
_IMAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "prompt": ("str",),
    "negative_prompt": ("str", "null"),
    "steps": ("int", "null"),
    "guidance_scale": ("number", "null"),
    "height": ("int", "null"),
    "width": ("int", "null"),
    "seed": ("int", "null"),
    "num_images": ("int",),
    "preview": ("str",),
    "preview_every": ("int",),
    "preview_format": ("str",),
    "preview_quality": ("int",),
    "preview_max_side": ("int",),
    "final_format": ("str",),
    "priority": ("int",),
}


def _is(value: Any, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "str_list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "messages":
        return (isinstance(value, list) and bool(value) and all(
            isinstance(m, dict) and set(m) <= {"role", "content", "name"}
            and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))
    raise AssertionError(kind)


_TYPE_WORDS = {"any": "any JSON value", "int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
               "null": "null", "str_list": "a list of strings",
               "messages": 'a non-empty list of {"role": str, "content": str} messages'}


def check_fields(body: dict[str, Any], spec: dict[str, tuple[str, ...]], what: str) -> None:
    unknown = sorted(set(body) - set(spec))
    if unknown:
        raise Problem(400, "unknown_field", f"unknown field(s) {unknown} for {what}; accepted fields: {sorted(spec)}",
                      param=unknown[0])
    for name, value in body.items():
        kinds = spec[name]
        if not any(_is(value, k) for k in kinds):
            words = " or ".join(_TYPE_WORDS[k] for k in kinds)
            raise Problem(400, "invalid_type", f"'{name}' must be {words}, got {json.dumps(value)[:80]}", param=name)


def _limit(name: str, value: int, limit: int, setting: str) -> None:
    if value > limit:
        raise Problem(400, "limit_exceeded",
                      f"'{name}' is {value} but this server allows at most {limit} ({setting}); lower it", param=name)


def prompt_chars(prompt: str | list[dict[str, str]]) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def check_prompt_limit(prompt: str | list[dict[str, str]], settings: ServerSettings) -> None:
    n = prompt_chars(prompt)
    if n > settings.max_prompt_chars:
        raise Problem(400, "limit_exceeded", f"the prompt has {n} characters but this server allows at most "
                      f"{settings.max_prompt_chars} (max_prompt_chars); shorten it", param="prompt")


def parse_text_body(body: dict[str, Any], settings: ServerSettings) -> tuple[dict[str, Any], int]:
    """``POST /v1/text`` body -> (keyword arguments for ``TextModel.stream``, priority)."""
    check_fields(body, _TEXT_FIELDS, "POST /v1/text")
    if "prompt" not in body:
        raise Problem(400, "missing_field", "'prompt' is required (a string or a list of chat messages)", param="prompt")
    kwargs = dict(body)
    priority = kwargs.pop("priority", 0)
    check_prompt_limit(kwargs["prompt"], settings)
    kwargs.setdefault("max_new_tokens", settings.default_max_new_tokens)
    _limit("max_new_tokens", kwargs["max_new_tokens"], settings.max_new_tokens, "max_new_tokens")
    stops = [kwargs["stop"]] if isinstance(kwargs.get("stop"), str) else (kwargs.get("stop") or [])
    if len(stops) > 16 or any(len(s) > 256 for s in stops):
        raise Problem(400, "limit_exceeded", "'stop' allows at most 16 strings of at most 256 characters", param="stop")
    return kwargs, priority


def parse_image_body(body: dict[str, Any], settings: ServerSettings) -> tuple[dict[str, Any], int]:
    """``POST /v1/image`` body -> (keyword arguments for ``ImageModel.stream``, priority)."""
    check_fields(body, _IMAGE_FIELDS, "POST /v1/image")
    if "prompt" not in body:
        raise Problem(400, "missing_field", "'prompt' is required (a string)", param="prompt")
    kwargs = dict(body)
    priority = kwargs.pop("priority", 0)
    check_image_limits(kwargs, settings)
    return kwargs, priority


def check_image_limits(kwargs: dict[str, Any], settings: ServerSettings) -> None:
    check_prompt_limit(kwargs["prompt"], settings)
    if kwargs.get("steps") is not None:
        _limit("steps", kwargs["steps"], settings.max_steps, "max_steps")
    for side in ("height", "width", "preview_max_side"):
        if kwargs.get(side) is not None:
            _limit(side, kwargs[side], settings.max_image_side, "max_image_side")
    if "num_images" in kwargs:
        _limit("num_images", kwargs["num_images"], settings.max_images, "max_images")
