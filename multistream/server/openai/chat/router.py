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

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...http.errors import json_body
from ...http.routes import RequestOnlyRoute
from ...state import principal_of, state_of
from .._choices import collect_choices, interleave, open_choices
from .._common import ERRORS, chunk_events, error_body, read_model_body, sse_of
from .audio import chat_with_audio, wants_audio
from .protocol import ChatCompletionRequest, chat_choices, chat_kwargs
from .serving import ChatChunks

router = APIRouter(tags=["openai"], route_class=RequestOnlyRoute)  # the hot path: no FastAPI dependencies


@router.post("/v1/chat/completions", responses=ERRORS, openapi_extra=json_body(ChatCompletionRequest))
async def chat(request: Request) -> Response:
    arrived = time.perf_counter()
    state, principal = state_of(request), principal_of(request)
    settings = state.settings
    body = await read_model_body(request, state, "text")
    if wants_audio(body):  # modalities=["text", "audio"]: the answer spoken while it is written
        return await chat_with_audio(request, state, principal, body)
    kwargs, priority, stream, include_usage = chat_kwargs(body, settings)
    n, continuous_usage = chat_choices(body)
    records = await open_choices(state, kwargs, n, priority=priority, request=request, arrived_at=arrived,
                                 principal=principal)
    record = records[0]
    cid, created, model = f"chatcmpl-{record.stream_id}", int(time.time()), record.model_name
    headers = {"X-Stream-Id": ",".join(r.stream_id for r in records)}

    chunks = ChatChunks(cid, created, model, [r.stream_id for r in records],
                        with_tools=bool(kwargs.get("tools")) and kwargs.get("tool_choice") != "none",
                        beams=(kwargs.get("num_beams") or 1) > 1, logprobs=bool(kwargs.get("logprobs")),
                        continuous_usage=continuous_usage, include_usage=include_usage)

    if not stream:
        states = await collect_choices(records, request)
        failed = next((c.error for c in states if c.error is not None), None)
        if failed is not None or any(c.final is None for c in states):
            return JSONResponse(error_body(failed) if failed is not None else
                                {"error": {"message": "no final event", "type": "server_error"}}, status_code=500)
        return JSONResponse(chunks.completion(states), headers=headers)

    return sse_of(records, settings, chunk_events(chunks, interleave(records)))
