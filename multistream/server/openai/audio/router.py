"""Speech routes: OpenAI's ``POST /v1/audio/speech`` and the native ``POST /v1/speech``.

``POST /v1/audio/speech`` takes OpenAI's body: ``model``, ``input`` (at most 4,096 characters),
``voice``, ``response_format`` (``pcm``: 24 kHz 16-bit mono little-endian, as OpenAI documents;
``wav``, ``mp3``, ``opus``, ``flac``, ``aac``), ``speed`` (0.25-4), ``instructions`` (refused: the
embedded voice cannot follow them) and ``stream_format``: ``audio`` (the default; the encoded bytes
as a chunked body, the first after the first sentence) or ``sse`` (``speech.audio.delta`` events
with base64 audio in ``response_format``, then ``speech.audio.done`` with ``usage``). OpenAI's
model names (``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``) and voice names (``alloy``, ``echo``,
...) mean the served model and its default voice, so an app written for OpenAI works unchanged.
``priority`` is an extension.

``POST /v1/speech`` takes `SpeechModel.stream`'s arguments (``text``, ``voice``, ``speed``,
``priority``: one definition, `SpeechOptions`) and answers the native SSE of wire events
(``audio`` events with base64 PCM; the final one with the whole WAV), resumable like the others
through ``GET /v1/streams/{id}/events`` with the ``X-Resume-Token`` it returns.

Example:
    >>> from openai import OpenAI                                                       # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")           # doctest: +SKIP
    >>> with client.audio.speech.with_streaming_response.create(                         # doctest: +SKIP
    ...         model="tts-1", voice="alloy", input="Hello there.", response_format="mp3") as r:
    ...     r.stream_to_file("hello.mp3")
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ....events import AudioEvent, ErrorEvent
from ...access.keys import Principal
from ...bodies import check_speech_options, speech_voice
from ...http.bodies import OpenAIErrorResponse, read_body, validate_body
from ...http.errors import error_responses, json_body
from ...http.problems import Problem
from ...http.sse import event_source
from ...state import ServerState, get_principal, get_state
from .._protocol import given_options
from .protocol import OPENAI_PCM_RATE, AudioSpeechRequest
from .serving import SpeechEvents

router = APIRouter()


def _spec(body: type, audio: bool) -> dict[str, Any]:
    """The route's OpenAPI: its body and what a 200 carries (its refusals: `error_responses`)."""
    content = ({"audio/mpeg": {}, "audio/wav": {}, "audio/pcm": {}, "audio/flac": {}, "audio/ogg": {},
                "audio/aac": {}, "text/event-stream": {}} if audio else {"text/event-stream": {}})
    return {**json_body(body), "responses": {"200": {"description": "the audio as it is made", "content": content}}}


def _speech_model(state: ServerState) -> Any:
    return state.model_for("speech")


@router.post("/v1/audio/speech", summary="OpenAI speech", tags=["openai"],
             openapi_extra=_spec(AudioSpeechRequest, audio=True), responses=error_responses(OpenAIErrorResponse),
             description="OpenAI's text-to-speech: the audio bytes as they are made, or `speech.audio.*` SSE events.")
async def audio_speech(request: Request, state: ServerState = Depends(get_state),
                       principal: Principal = Depends(get_principal)) -> Response:
    body = validate_body(AudioSpeechRequest, await read_body(request, state), "POST /v1/audio/speech")
    model = _speech_model(state)
    state.check_model_name("speech", body.model)
    if body.instructions:
        raise Problem(400, "unsupported_parameter", "this speech model cannot follow `instructions` (it has no "
                      "style control); leave `instructions` out", param="instructions")
    voice = speech_voice(model, body.voice)
    options = given_options(body, ("speed",))  # left out or null: the spec's default
    check_speech_options(body.input, text_param="input", voice=voice, priority=body.priority, **options)
    kwargs = {"text": body.input, "voice": voice, **options}
    record = await state.open_stream("speech", kwargs, priority=body.priority, request=request, resumable=False,
                                     principal=principal)
    from ....speech import AudioEncoder

    rate = int(getattr(model, "sample_rate", 22050))
    encoder = AudioEncoder(body.response_format, rate, OPENAI_PCM_RATE if body.response_format == "pcm" else None)
    headers = {"X-Stream-Id": record.stream_id, "Cache-Control": "no-store"}

    async def encoded() -> AsyncIterator[tuple[bytes, AudioEvent | ErrorEvent | None]]:
        async for ev in record.subscribe():
            if isinstance(ev, ErrorEvent):
                yield await asyncio.to_thread(encoder.flush), ev
                return
            assert isinstance(ev, AudioEvent)
            if ev.is_final:
                yield await asyncio.to_thread(encoder.flush), ev
                return
            yield await asyncio.to_thread(encoder.feed, ev.data), None

    if body.stream_format == "audio":
        async def chunks() -> AsyncIterator[bytes]:
            async for data, _ in encoded():
                if data:
                    yield data

        return StreamingResponse(chunks(), media_type=encoder.mime, headers=headers)

    sse = SpeechEvents(len(body.input))

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for data, end in encoded():
            for name, payload in sse.payloads(data, end):
                yield ServerSentEvent(data=json.dumps(payload), event=name)

    return event_source(events(), state.settings, record.stream_id)
