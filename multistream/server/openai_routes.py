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

Edits (``finish``, ``steer``, ``rewind``; see `multistream.server.routes_native`) have no
OpenAI form. These routes return no resume token, so only a keyed server's same API key can edit
their streams (through ``POST /v1/streams/{X-Stream-Id}/...``); on an open server nobody can.
What an OpenAI client then sees:

- ``finish``: the stream ends at once with ``finish_reason="stop"`` (OpenAI has no
  "finished_early"); an image request gets its current image as the completed one.
- ``steer``: nothing marks it; the content that follows simply goes the new way.
- ``rewind``: OpenAI chunks can only append, so a streaming client is NOT told that text was
  cut: its concatenated ``delta.content`` keeps the cut text and then the regenerated text
  follows (it differs from the stream's real final text). A non-streaming response
  (``stream: false``) carries the final text after all edits, which is right. Clients that edit
  should use the native routes, whose events carry ``offset`` and ``revision``.

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
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..events import ErrorEvent, ImageEvent, TextEvent
from .bodies import (
    ChatCompletionRequest,
    ImageGenerationRequest,
    OpenAIErrorResponse,
    check_image_limits,
    check_prompt_limit,
    validate_body,
)
from .problems import Problem
from .registry import StreamRecord
from .routes_native import read_body
from .security import Principal
from .settings import ServerSettings
from .state import ServerState, get_principal, get_state

__all__ = ["router"]

logger = logging.getLogger("multistream.server")

_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "content_filter": "content_filter",
           "cancelled": "stop"}
_IGNORED_CHAT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "model")
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": OpenAIErrorResponse, "description": text} for status, text in (
        (400, "bad request"), (401, "missing or wrong API key"), (404, "no such model"),
        (408, "the body came too slowly"), (413, "body too large"), (415, "not JSON"),
        (429, "queue or quota full"), (500, "server failure"), (503, "loading, busy or shutting down"))}


def _body(model: type) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _unsupported(name: str, message: str) -> Problem:
    return Problem(400, "unsupported", message, param=name)


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m.get("role"), str):
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
        if m.get("tool_calls"):
            raise _unsupported("messages", f"messages[{i}] has tool_calls; this server does not run tools")
        out.append({"role": m["role"], "content": content})
    return out


def chat_kwargs(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int, bool, bool]:
    """OpenAI chat body -> (TextModel.stream kwargs, priority, stream?, include_usage?).

    Refuses what would change the answer (``n > 1``, tools, logprobs, penalties, JSON mode);
    accepts and ignores (with a log line) what does not (``user``, ``metadata``, empty ``tools``)."""
    req = validate_body(ChatCompletionRequest, body, "POST /v1/chat/completions")
    assert isinstance(req, ChatCompletionRequest)
    if req.n not in (None, 1):
        raise _unsupported("n", f"only n=1 is supported (got n={req.n}); send n separate requests")
    if req.logprobs or req.top_logprobs:
        raise _unsupported("logprobs", "logprobs are not supported; leave logprobs unset or false")
    if req.tools:
        raise _unsupported("tools", "tools are not supported by this server; send no tools (an empty list is fine)")
    if req.tool_choice not in (None, "none", "auto"):
        raise _unsupported("tool_choice", "tool_choice must be unset, 'none' or 'auto' (this server runs no tools)")
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not supported; send none (an empty object is fine)")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _unsupported(name, f"{name} is not supported (use repetition_penalty)")
    if req.response_format is not None and req.response_format != {"type": "text"}:
        raise _unsupported("response_format", "only response_format {'type': 'text'} is supported")
    extra = sorted(set(body) - set(ChatCompletionRequest.model_fields))
    ignored = [n for n in _IGNORED_CHAT if body.get(n) not in (None, "", {}, [])] + extra
    if ignored or req.tools == [] or req.logit_bias == {}:
        logger.info("chat completion: ignoring field(s) %s", ignored or ["tools/logit_bias (empty)"])
    messages = _messages(req.messages)
    check_prompt_limit(messages, settings)
    kwargs: dict[str, Any] = {"prompt": messages}
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = settings.default_max_new_tokens
    if max_tokens > settings.max_new_tokens:
        raise Problem(400, "limit_exceeded", f"max_tokens is {max_tokens} but this server allows at most "
                      f"{settings.max_new_tokens}", param="max_tokens")
    kwargs["max_new_tokens"] = max_tokens
    for name in ("temperature", "top_p", "stop", "seed", "top_k", "repetition_penalty"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)
    return kwargs, req.priority, bool(req.stream), include_usage


def image_kwargs(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int, bool, int, str]:
    """OpenAI images body -> (ImageModel.stream kwargs, priority, stream?, partial_images, output_format)."""
    req = validate_body(ImageGenerationRequest, body, "POST /v1/images/generations")
    assert isinstance(req, ImageGenerationRequest)
    if req.response_format not in (None, "b64_json"):
        raise _unsupported("response_format", "only response_format 'b64_json' is supported (this server keeps no "
                           "files)")
    fmt = req.output_format or "png"
    if fmt not in ("png", "jpeg", "webp"):
        raise Problem(400, "invalid_argument", f"output_format must be png, jpeg or webp, got {fmt[:20]!r}",
                      param="output_format")
    partial = req.partial_images or 0
    if not 0 <= partial <= 3:
        raise Problem(400, "invalid_argument", f"partial_images must be 0..3, got {partial}", param="partial_images")
    n = req.n if req.n is not None else 1
    kwargs: dict[str, Any] = {"prompt": req.prompt, "num_images": n, "final_format": fmt}
    if req.size not in (None, "auto"):
        w, sep, h = req.size.partition("x")
        ok = sep and all(v.isascii() and v.isdigit() and 0 < len(v) <= 5 for v in (w, h))
        if not ok:
            raise Problem(400, "invalid_argument", f"size must look like '64x64' (WIDTHxHEIGHT in ASCII digits) or "
                          f"'auto', got {req.size[:20]!r}", param="size")
        kwargs["width"], kwargs["height"] = int(w), int(h)
    for name in ("steps", "seed", "guidance_scale", "negative_prompt"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    stream = bool(req.stream)
    if stream and partial:
        kwargs["preview_format"] = fmt
        if "width" in kwargs:
            kwargs["preview_max_side"] = max(kwargs["width"], kwargs["height"])
    else:
        kwargs["preview"] = "none"
    check_image_limits(kwargs, settings)
    return kwargs, req.priority, stream, partial, fmt


def _sse(record: StreamRecord, settings: ServerSettings, events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    return EventSourceResponse(events, headers={"X-Stream-Id": record.stream_id}, ping=settings.heartbeat_s,
                               send_timeout=settings.send_timeout_s or None,
                               shutdown_grace_period=settings.shutdown_deadline_s + settings.cancel_timeout_s + 5)


def _data(obj: Any, event: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, ensure_ascii=False, separators=(",", ":")), event=event)


def _error_body(ev: ErrorEvent) -> dict[str, Any]:
    return {"error": {"message": ev.error.get("message", "generation failed"), "type": "server_error",
                      "param": None, "code": ev.error.get("type")}}  # already made safe by the registry


router = APIRouter(tags=["openai"])


@router.get("/v1/models", responses=_ERRORS)
async def models(state: ServerState = Depends(get_state)) -> Response:
    data = [{"id": slot.name, "object": "model", "created": int(state.started_at), "owned_by": "multistream",
             "kind": kind, "state": slot.state}
            for kind, slot in state.models.items() if slot.state != "disabled"]
    return JSONResponse({"object": "list", "data": data})

@router.post("/v1/chat/completions", responses=_ERRORS, openapi_extra=_body(ChatCompletionRequest))
async def chat(request: Request, state: ServerState = Depends(get_state),
               principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    settings = state.settings
    kwargs, priority, stream, include_usage = chat_kwargs(await read_body(request, state), settings)
    record = await state.open_stream("text", kwargs, priority=priority, request=request, resumable=False,
                                     arrived_at=arrived, principal=principal)
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

@router.post("/v1/images/generations", responses=_ERRORS, openapi_extra=_body(ImageGenerationRequest))
async def images(request: Request, state: ServerState = Depends(get_state),
                 principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    settings = state.settings
    kwargs, priority, stream, partial, fmt = image_kwargs(await read_body(request, state), settings)
    record = await state.open_stream("image", kwargs, priority=priority, request=request, resumable=False,
                                     arrived_at=arrived, principal=principal)
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
