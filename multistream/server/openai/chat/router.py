"""OpenAI-compatible routes, so the official ``openai`` SDK works unchanged against this server.

- ``POST /v1/chat/completions``: messages, max_tokens / max_completion_tokens, temperature, top_p,
  stop, seed, presence_penalty, frequency_penalty, logit_bias, ``logprobs`` / ``top_logprobs``
  (``choices[].logprobs.content[]``: raw model log-softmax, before temperature and penalties),
  ``n`` up to 8 (the prompt prefilled once; streamed choices interleave, each chunk with its
  ``index``; choice i seeded from (seed, i)), ``stream`` and ``stream_options.include_usage`` /
  vLLM's ``continuous_usage_stats`` (plus the extensions top_k, min_p, repetition_penalty,
  priority), ``response_format`` (``json_object``, ``json_schema``) and ``tools`` /
  ``tool_choice`` / ``parallel_tool_calls``. Streaming sends ``chat.completion.chunk`` objects, then
  ``[DONE]``; a call streams as ``tool_calls`` deltas (id, type and name first, then the
  ``arguments`` JSON in fragments as it is generated), ending with ``finish_reason="tool_calls"``.
- ``POST /v1/completions``: see `multistream.server.openai.completions`.
  A cancelled generation reports ``finish_reason="stop"`` (OpenAI has no "cancelled").
- ``POST /v1/images/generations``: prompt, n, size ("64x64"), output_format, ``response_format``
  "b64_json", ``stream`` with ``partial_images`` 0-3 (SSE events ``image_generation.partial_image``
  and ``image_generation.completed``), plus the extensions steps, seed, guidance_scale,
  negative_prompt, priority.
- ``GET /v1/models``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Edits (``finish``, ``steer``, ``rewind``; see `multistream.server.native.routes`) have no
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
- ``num_beams`` (an extension, as vLLM's): a beam search's best hypothesis may change, so a
  streaming response sends only committed text (``committed``), which never changes: OpenAI
  clients get a correct, monotonic stream whose concatenation is the final text.

Example:
    >>> from openai import OpenAI                                             # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # doctest: +SKIP
    >>> for chunk in client.chat.completions.create(model="default", stream=True,  # doctest: +SKIP
    ...         messages=[{"role": "user", "content": "hi"}]):
    ...     print(chunk.choices[0].delta.content or "", end="")
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....events import ErrorEvent, TextEvent
from ....text import ToolCallParser, parse_tool_calls
from ...access.security import Principal
from ...http.bodies import read_body
from ...http.errors import json_body
from ...http.sse import DONE, json_event
from ...state import ServerState, get_principal, get_state
from .._choices import chat_logprobs, collect_choices, interleave, open_choices, usage_of
from .._common import ERRORS, error_body, openai_finish, sse_of
from .audio import chat_with_audio, wants_audio
from .protocol import ChatCompletionRequest, chat_choices, chat_kwargs

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", responses=ERRORS, openapi_extra=json_body(ChatCompletionRequest))
async def chat(request: Request, state: ServerState = Depends(get_state),
               principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    settings = state.settings
    body = await read_body(request, state)
    state.check_model_name("text", body.get("model") if isinstance(body, dict) else None)
    if wants_audio(body):  # modalities=["text", "audio"]: the answer spoken while it is written
        return await chat_with_audio(request, state, principal, body)
    kwargs, priority, stream, include_usage = chat_kwargs(body, settings)
    n, continuous_usage = chat_choices(body)
    want_logprobs = bool(kwargs.get("logprobs"))
    records = await open_choices(state, kwargs, n, priority=priority, request=request, arrived_at=arrived,
                                 principal=principal)
    record = records[0]
    cid, created, model = f"chatcmpl-{record.stream_id}", int(time.time()), record.model_name
    headers = {"X-Stream-Id": ",".join(r.stream_id for r in records)}

    with_tools = bool(kwargs.get("tools")) and kwargs.get("tool_choice") != "none"
    beams = (kwargs.get("num_beams") or 1) > 1

    def finish_reason(ev: TextEvent, called: bool) -> str:
        return "tool_calls" if called else openai_finish(ev.finish_reason)

    def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0,
              logprobs: Any = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    if not stream:
        states = await collect_choices(records, request)
        failed = next((c.error for c in states if c.error is not None), None)
        if failed is not None or any(c.final is None for c in states):
            return JSONResponse(error_body(failed) if failed is not None else
                                {"error": {"message": "no final event", "type": "server_error"}}, status_code=500)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, c in enumerate(states):
            final = c.final
            assert final is not None
            u = final.usage or {"prompt_tokens": 0, "completion_tokens": 0}
            prompt_tokens, completion_tokens = u["prompt_tokens"], completion_tokens + u["completion_tokens"]
            message: dict[str, Any] = {"role": "assistant", "content": final.text or ""}
            calls = final.tool_calls or []
            if with_tools:
                content, _ = parse_tool_calls(final.text or "", records[i].stream_id)
                message["content"] = content or (None if calls else "")
                if calls:
                    message["tool_calls"] = [{"id": call["id"], "type": "function",
                                              "function": {"name": call["name"], "arguments": call["arguments"]}}
                                             for call in calls]
            choices.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(c.entries) if want_logprobs else None,
                            "finish_reason": finish_reason(final, bool(calls))})
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None, "choices": choices, "usage": usage_of(prompt_tokens, completion_tokens),
        }, headers=headers)

    def tool_deltas(items: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        """Chunk deltas for what the parser read: content, a call's head, its argument fragments."""
        out: list[dict[str, Any]] = []
        for item in items:
            if item[0] == "content":
                out.append({"content": item[1]})
            elif item[0] == "call":
                _, index, call_id, name = item
                out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": item[1], "function": {"arguments": item[2]}}]})
        return out


    async def events() -> AsyncIterator[ServerSentEvent]:
        prompt_tokens = 0
        done: dict[int, int] = {}  # completion tokens of each choice, as they go
        parsers = {i: ToolCallParser(r.stream_id) for i, r in enumerate(records)} if with_tools else {}
        texts: dict[int, str] = {}  # with beams: each choice's text so far,
        sent: dict[int, int] = {}  # and how much of it went out
        for i in range(n):
            yield json_event(chunk({"role": "assistant", "content": ""}, index=i))
        async for i, ev in interleave(records):
            if isinstance(ev, ErrorEvent):
                yield json_event(error_body(ev))
                return
            assert isinstance(ev, TextEvent)
            if ev.token_ids:
                done[i] = max(done.get(i, 0), ev.index + len(ev.token_ids))
            if ev.is_final and ev.usage:
                prompt_tokens, done[i] = ev.usage["prompt_tokens"], ev.usage["completion_tokens"]
            extra = {"usage": usage_of(prompt_tokens, sum(done.values()))} if continuous_usage else {}
            logprobs = chat_logprobs(ev.logprobs) if want_logprobs and ev.logprobs else None
            parser = parsers.get(i)
            if beams:
                # OpenAI chunks can only append: send the text that can no longer change.
                text = texts[i] = texts.get(i, "")[: ev.offset] + ev.delta
                end = len(text) if ev.is_final else min(ev.committed, len(text))
                if end > sent.get(i, 0):
                    yield json_event({**chunk({"content": text[sent.get(i, 0):end]}, index=i), **extra})
                    sent[i] = end
            elif parser is not None:
                items = parser.feed(ev.delta) + (parser.finish() if ev.is_final else [])
                for delta in tool_deltas(items):
                    yield json_event({**chunk(delta, index=i), **extra})
            elif ev.delta or logprobs is not None:
                yield json_event({**chunk({"content": ev.delta}, index=i, logprobs=logprobs), **extra})
            if ev.is_final:
                called = bool(parser is not None and parser.calls)
                yield json_event({**chunk({}, finish_reason(ev, called), index=i), **extra})
        if include_usage:
            yield json_event({**chunk({}), "choices": [], "usage": usage_of(prompt_tokens, sum(done.values()))})
        yield ServerSentEvent(data=DONE)

    return sse_of(records, settings, events())
