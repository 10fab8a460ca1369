"""OpenAI-compatible routes, so the official ``openai`` SDK works unchanged against this server.

- ``POST /v1/chat/completions``: messages, max_tokens / max_completion_tokens, temperature, top_p,
  stop, seed, ``stream`` and ``stream_options.include_usage`` (plus the extensions top_k,
  repetition_penalty, priority). Streaming sends ``chat.completion.chunk`` objects, then ``[DONE]``.
  A cancelled generation reports ``finish_reason="stop"`` (OpenAI has no "cancelled").
- ``POST /v1/images/generations``: prompt, n, size ("64x64"), output_format, ``response_format``
  "b64_json", ``stream`` with ``partial_images`` 0-3 (SSE events ``image_generation.partial_image``
  and ``image_generation.completed``), plus the extensions steps, seed, guidance_scale,
  negative_prompt, priority.
- ``GET /v1/models``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Example:
    >>> from openai import OpenAI                                             # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # doctest: +SKIP
    >>> for chunk in client.chat.completions.create(model="default", stream=True,  # doctest: +SKIP
    ...         messages=[{"role": "user", "content": "hi"}]):
    ...     print(chunk.choices[0].delta.content or "", end="")
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..events import ErrorEvent, ImageEvent, TextEvent
from .problems import Problem
from .registry import StreamRecord
from .requests import check_fields, check_image_limits, check_prompt_limit, read_json
from .settings import ServerSettings

__all__ = ["add_openai_routes"]

_CHAT_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("str",), "messages": ("any",), "max_tokens": ("int", "null"), "max_completion_tokens": ("int", "null"),
    "temperature": ("number", "null"), "top_p": ("number", "null"), "stop": ("str", "str_list", "null"),
    "seed": ("int", "null"), "stream": ("bool", "null"), "stream_options": ("any",), "n": ("int", "null"),
    "user": ("str", "null"), "frequency_penalty": ("number", "null"), "presence_penalty": ("number", "null"),
    "logprobs": ("bool", "null"), "metadata": ("any",), "store": ("bool", "null"), "service_tier": ("str", "null"),
    "parallel_tool_calls": ("bool", "null"), "response_format": ("any",), "top_k": ("int", "null"),
    "repetition_penalty": ("number", "null"), "priority": ("int",),
}
_IMAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "prompt": ("str",), "model": ("str", "null"), "n": ("int", "null"), "size": ("str", "null"),
    "stream": ("bool", "null"), "partial_images": ("int", "null"), "response_format": ("str", "null"),
    "output_format": ("str", "null"), "quality": ("str", "null"), "background": ("str", "null"),
    "output_compression": ("int", "null"), "moderation": ("str", "null"), "user": ("str", "null"),
    "style": ("str", "null"), "steps": ("int", "null"), "seed": ("int", "null"),
    "guidance_scale": ("number", "null"), "negative_prompt": ("str", "null"), "priority": ("int",),
}
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "content_filter": "content_filter",
           "cancelled": "stop"}


def _check(body: dict[str, Any], spec: dict[str, tuple[str, ...]], what: str) -> None:
    check_fields(body, spec, what)


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise Problem(400, "invalid_type", "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Problem(400, "invalid_type", f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise Problem(400, "invalid_type", f"messages[{i}].content parts must be text parts "
                              '({"type": "text", "text": ...}); this server has a text-only model', param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise Problem(400, "invalid_type", f"messages[{i}].content must be a string or text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def chat_kwargs(body: dict[str, Any], settings: ServerSettings) -> tuple[dict[str, Any], int, bool, bool]:
    """OpenAI chat body -> (TextModel.stream kwargs, priority, stream?, include_usage?)."""
    _check(body, _CHAT_FIELDS, "POST /v1/chat/completions")
    if "messages" not in body:
        raise Problem(400, "missing_field", "'messages' is required", param="messages")
    if body.get("n") not in (None, 1):
        raise Problem(400, "unsupported", "only n=1 is supported", param="n")
    if body.get("logprobs"):
        raise Problem(400, "unsupported", "logprobs are not supported", param="logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise Problem(400, "unsupported", f"{name} is not supported (use repetition_penalty)", param=name)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise Problem(400, "unsupported", "only response_format {'type': 'text'} is supported", param="response_format")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not set(so) <= {"include_usage", "include_obfuscation"}):
        raise Problem(400, "invalid_type", "stream_options must be an object like {'include_usage': true}",
                      param="stream_options")
    messages = _messages(body["messages"])
    check_prompt_limit(messages, settings)
    kwargs: dict[str, Any] = {"prompt": messages}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = settings.default_max_new_tokens
    if max_tokens > settings.max_new_tokens:
        raise Problem(400, "limit_exceeded", f"max_tokens is {max_tokens} but this server allows at most "
                      f"{settings.max_new_tokens}", param="max_tokens")
    kwargs["max_new_tokens"] = max_tokens
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("stop", "stop"), ("seed", "seed"),
                     ("top_k", "top_k"), ("repetition_penalty", "repetition_penalty")):
        if body.get(src) is not None:
            kwargs[dst] = body[src]
    include_usage = bool((so or {}).get("include_usage"))
    return kwargs, body.get("priority", 0), bool(body.get("stream")), include_usage


def image_kwargs(body: dict[str, Any], settings: ServerSettings) -> tuple[dict[str, Any], int, bool, int, str]:
    """OpenAI images body -> (ImageModel.stream kwargs, priority, stream?, partial_images, output_format)."""
    _check(body, _IMAGE_FIELDS, "POST /v1/images/generations")
    if "prompt" not in body:
        raise Problem(400, "missing_field", "'prompt' is required", param="prompt")
    if body.get("response_format") not in (None, "b64_json"):
        raise Problem(400, "unsupported", "only response_format 'b64_json' is supported (this server keeps no files)",
                      param="response_format")
    fmt = body.get("output_format") or "png"
    if fmt not in ("png", "jpeg", "webp"):
        raise Problem(400, "invalid_argument", f"output_format must be png, jpeg or webp, got {fmt!r}",
                      param="output_format")
    partial = body.get("partial_images") or 0
    if not 0 <= partial <= 3:
        raise Problem(400, "invalid_argument", f"partial_images must be 0..3, got {partial}", param="partial_images")
    kwargs: dict[str, Any] = {"prompt": body["prompt"], "num_images": body.get("n") or 1, "final_format": fmt}
    size = body.get("size")
    if size not in (None, "auto"):
        w, sep, h = size.partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise Problem(400, "invalid_argument", f"size must look like '64x64' (WIDTHxHEIGHT) or 'auto', got {size!r}",
                          param="size")
        kwargs["width"], kwargs["height"] = int(w), int(h)
    for name in ("steps", "seed", "guidance_scale", "negative_prompt"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    stream = bool(body.get("stream"))
    if stream and partial:
        kwargs["preview_format"] = fmt
        if "width" in kwargs:
            kwargs["preview_max_side"] = max(kwargs["width"], kwargs["height"])
    else:
        kwargs["preview"] = "none"
    check_image_limits(kwargs, settings)
    return kwargs, body.get("priority", 0), stream, partial, fmt


def _sse(record: StreamRecord, settings: ServerSettings, events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    return EventSourceResponse(events, headers={"X-Stream-Id": record.stream_id}, ping=settings.heartbeat_s,
                               send_timeout=settings.send_timeout_s or None,
                               shutdown_grace_period=settings.shutdown_deadline_s + settings.cancel_timeout_s + 5)


def _data(obj: Any, event: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, ensure_ascii=False, separators=(",", ":")), event=event)


def _error_body(ev: ErrorEvent) -> dict[str, Any]:
    return {"error": {"message": ev.error.get("message", "generation failed"), "type": "server_error",
                      "param": None, "code": ev.error.get("type")}}


def add_openai_routes(app: FastAPI, settings: ServerSettings, state_of: Callable[[Request], Any]) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state = state_of(request)
        data = [{"id": slot.name, "object": "model", "created": int(state.started_at), "owned_by": "multistream",
                 "kind": kind, "state": slot.state}
                for kind, slot in state.models.items() if slot.state != "disabled"]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrived = time.perf_counter()
        state = state_of(request)
        kwargs, priority, stream, include_usage = chat_kwargs(await read_json(request, settings.max_body_bytes), settings)
        record = await state.open_stream("text", kwargs, priority=priority, request=request, resumable=False,
                                         arrived_at=arrived)
        cid, created, model = f"chatcmpl-{record.stream_id}", int(time.time()), record.model_name

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if not stream:
            collected = await _collect_until_disconnected(record, request)
            final = collected[-1] if collected else None
            if isinstance(final, ErrorEvent) or not isinstance(final, TextEvent):
                return JSONResponse(_error_body(final) if isinstance(final, ErrorEvent) else
                                    {"error": {"message": "no final event", "type": "server_error"}}, status_code=500)
            usage = final.usage or {"prompt_tokens": 0, "completion_tokens": 0}
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": final.text or ""},
                             "logprobs": None, "finish_reason": _FINISH.get(final.finish_reason or "stop", "stop")}],
                "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            }, headers={"X-Stream-Id": record.stream_id})

        async def events() -> AsyncIterator[ServerSentEvent]:
            yield _data(chunk({"role": "assistant", "content": ""}))
            async for ev in record.subscribe():
                if isinstance(ev, ErrorEvent):
                    yield _data(_error_body(ev))
                    return
                assert isinstance(ev, TextEvent)
                if ev.delta:
                    yield _data(chunk({"content": ev.delta}))
                if ev.is_final:
                    yield _data(chunk({}, _FINISH.get(ev.finish_reason or "stop", "stop")))
                    if include_usage:
                        u = ev.usage or {"prompt_tokens": 0, "completion_tokens": 0}
                        yield _data({**chunk({}), "choices": [],
                                     "usage": {**u, "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}})
            yield ServerSentEvent(data="[DONE]")

        return _sse(record, settings, events())

    @app.post("/v1/images/generations")
    async def images(request: Request) -> Response:
        arrived = time.perf_counter()
        state = state_of(request)
        kwargs, priority, stream, partial, fmt = image_kwargs(await read_json(request, settings.max_body_bytes), settings)
        record = await state.open_stream("image", kwargs, priority=priority, request=request, resumable=False,
                                         arrived_at=arrived)
        n = kwargs["num_images"]
        common = {"background": "opaque", "output_format": fmt, "quality": "auto"}
        usage = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                 "output_tokens": 0, "total_tokens": 0}

        def is_done(ev: ImageEvent) -> bool:
            return ev.is_final or ev.finish_reason is not None

        if not stream:
            images: dict[int, ImageEvent] = {}
            error = None
            for ev in await _collect_until_disconnected(record, request):
                if isinstance(ev, ErrorEvent):
                    error = ev
                elif isinstance(ev, ImageEvent) and is_done(ev):
                    images[ev.index] = ev
            if error is not None:
                return JSONResponse(_error_body(error), status_code=500)
            first = next(iter(images.values()), None)
            return JSONResponse({
                "created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(images[i].data).decode("ascii")} for i in sorted(images)],
                **common, "size": f"{first.width}x{first.height}" if first else "auto", "usage": usage,
            }, headers={"X-Stream-Id": record.stream_id})

        async def events() -> AsyncIterator[ServerSentEvent]:
            sent = [0] * n
            async for ev in record.subscribe():
                if isinstance(ev, ErrorEvent):
                    yield _data(_error_body(ev), event="error")
                    return
                assert isinstance(ev, ImageEvent)
                base = {**common, "created_at": int(time.time()), "size": f"{ev.width}x{ev.height}",
                        "b64_json": base64.b64encode(ev.data).decode("ascii")}
                if is_done(ev):
                    yield _data({"type": "image_generation.completed", **base, "usage": usage},
                                event="image_generation.completed")
                elif ev.index < n and sent[ev.index] < partial and \
                        ev.step >= math.ceil((sent[ev.index] + 1) * ev.total_steps / (partial + 1)):
                    yield _data({"type": "image_generation.partial_image", **base,
                                 "partial_image_index": sent[ev.index]}, event="image_generation.partial_image")
                    sent[ev.index] += 1

        return _sse(record, settings, events())


async def _collect_until_disconnected(record: Any, request: Request) -> list[Any]:
    """Every event of a stream, for the non-streaming routes; a client that goes away meanwhile
    (an SDK timeout, say) cancels the generation instead of leaving it running to the end."""

    async def collect() -> list[Any]:
        return [ev async for ev in record.subscribe()]

    task = asyncio.ensure_future(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                record.cancel()
                raise Problem(499, "client_closed", "the client went away before the answer was ready")
    finally:
        if not task.done():
            task.cancel()
