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
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..events import AudioEvent, ErrorEvent
from ..speech import MAX_INPUT_CHARACTERS
from .access.security import Principal
from .bodies import OPENAI_VOICES, SpeechBody, check_speech_options, parse_speech_body, speech_voice
from .families import family
from .http.bodies import LAX_BODY, OpenAIErrorResponse, read_body, validate_body
from .http.errors import error_responses, json_body
from .http.problems import Problem
from .http.sse import DONE, json_event
from .state import ServerState, get_principal, get_state

__all__ = ["AudioSpeechRequest", "OPENAI_SPEECH_MODELS", "OPENAI_VOICES", "SpeechBody", "chat_with_audio", "router",
           "parse_speech_body", "speech_voice", "wants_audio"]

router = APIRouter()


def _spec(body: type, audio: bool) -> dict[str, Any]:
    """The route's OpenAPI: its body and what a 200 carries (its refusals: `error_responses`)."""
    content = ({"audio/mpeg": {}, "audio/wav": {}, "audio/pcm": {}, "audio/flac": {}, "audio/ogg": {},
                "audio/aac": {}, "text/event-stream": {}} if audio else {"text/event-stream": {}})
    return {**json_body(body), "responses": {"200": {"description": "the audio as it is made", "content": content}}}

#: OpenAI's speech model names: each means the served speech model (the family table's entry).
OPENAI_SPEECH_MODELS = family("speech").openai_models
_OPENAI_PCM_RATE = 24000


class AudioSpeechRequest(BaseModel):
    """OpenAI's ``POST /v1/audio/speech`` body (unknown fields are ignored, as OpenAI's SDK may send more)."""

    model_config = LAX_BODY
    model: str = Field(description="tts-1, tts-1-hd, gpt-4o-mini-tts (all mean the served model) or its own name")
    input: str = Field(description=f"the text to speak, at most {MAX_INPUT_CHARACTERS} characters")
    voice: str = Field(default="alloy", description="an OpenAI voice name (the default voice) or one of the model's")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = Field(
        default="mp3", description="pcm is 24 kHz 16-bit mono little-endian, as OpenAI's")
    speed: float = Field(default=1.0, description="0.25 to 4 (1 is normal)")
    instructions: Optional[str] = Field(default=None, description="not supported by these voices: leave it out")
    stream_format: Literal["audio", "sse"] = Field(default="audio", description="audio: the bytes; sse: events")
    priority: int = Field(default=0, description="extension: higher is synthesized first")


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
    check_speech_options(body.input, voice=voice, speed=body.speed)
    kwargs = {"text": body.input, "voice": voice, "speed": body.speed}
    record = await state.open_stream("speech", kwargs, priority=body.priority, request=request, resumable=False,
                                     principal=principal)
    from ..speech import AudioEncoder

    rate = int(getattr(model, "sample_rate", 22050))
    encoder = AudioEncoder(body.response_format, rate, _OPENAI_PCM_RATE if body.response_format == "pcm" else None)
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

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for data, end in encoded():
            if data:
                yield ServerSentEvent(data=json.dumps({"type": "speech.audio.delta",
                                                       "audio": base64.b64encode(data).decode("ascii")}),
                                      event="speech.audio.delta")
            if isinstance(end, ErrorEvent):
                yield ServerSentEvent(data=json.dumps({"type": "error", "error": end.error}), event="error")
            elif end is not None:
                chars = len(body.input)
                usage = {"input_tokens": chars, "output_tokens": int(round((end.duration_s or 0) * 1000 / 20)),
                         "total_tokens": chars + int(round((end.duration_s or 0) * 1000 / 20)),
                         "input_characters": chars, "audio_seconds": (end.usage or {}).get("audio_seconds")}
                yield ServerSentEvent(data=json.dumps({"type": "speech.audio.done", "usage": usage}),
                                      event="speech.audio.done")

    return EventSourceResponse(events(), headers=headers, ping=state.settings.heartbeat_s)


# -- chat completions with modalities=["text", "audio"] -------------------------------------------

_CHAT_AUDIO_FORMATS = {"pcm16": "pcm", "wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac"}


def wants_audio(body: Any) -> bool:
    """A chat body that asks for spoken answers (``modalities`` with ``"audio"``)."""
    return isinstance(body, dict) and isinstance(body.get("modalities"), list) and "audio" in body["modalities"]


async def chat_with_audio(request: Request, state: ServerState, principal: Principal, body: dict[str, Any]) -> Response:
    """``POST /v1/chat/completions`` with ``modalities=["text", "audio"]`` and ``audio={"voice",
    "format"}``, as OpenAI's audio chat: the answer's text goes out as ``delta.audio.transcript``
    while it is written, and its sentences, spoken as soon as the text has them, as
    ``delta.audio.data`` (base64 16-bit 24 kHz mono PCM, ``format: "pcm16"``, the only streaming
    format, as OpenAI's). Without ``stream`` the message carries ``audio`` (``id``, ``data`` in
    ``format``, ``transcript``). The text model is admitted as for any chat; the speech follows it
    on the speech model's engine."""
    from ..events import TextEvent
    from .openai_protocol import chat_kwargs

    modalities = body.get("modalities")
    if any(not isinstance(m, str) or m not in ("text", "audio") for m in modalities):
        raise Problem(400, "invalid_argument", f"modalities must be ['text', 'audio'] or ['text'], got {modalities!r}",
                      param="modalities")
    audio_opts = body.get("audio")
    if not isinstance(audio_opts, dict) or not isinstance(audio_opts.get("voice"), str):
        raise Problem(400, "invalid_argument", "modalities with 'audio' needs audio={'voice': 'alloy', 'format': "
                      "'pcm16'}", param="audio")
    fmt = audio_opts.get("format", "pcm16")
    if not isinstance(fmt, str) or fmt not in _CHAT_AUDIO_FORMATS:
        raise Problem(400, "invalid_argument", f"audio.format must be one of {sorted(_CHAT_AUDIO_FORMATS)}, got {fmt!r}",
                      param="audio")
    stream = bool(body.get("stream"))
    if stream and fmt != "pcm16":
        raise Problem(400, "invalid_argument", "a streamed audio answer is pcm16 (as OpenAI's); use "
                      "audio.format 'pcm16' or stream: false", param="audio")
    if body.get("n") not in (None, 1):
        raise Problem(400, "invalid_argument", "n must be 1 with audio output", param="n")
    tts = _speech_model(state)
    voice = speech_voice(tts, audio_opts["voice"])
    text_body = {k: v for k, v in body.items() if k not in ("modalities", "audio")}
    kwargs, priority, _, include_usage = chat_kwargs(text_body, state.settings)
    record = await state.open_stream("text", kwargs, priority=priority, request=request, resumable=False,
                                     principal=principal)
    audio_stream, feed = tts.open_stream(voice=voice, priority=priority)
    cid, created, model = f"chatcmpl-{record.stream_id}", int(time.time()), record.model_name
    audio_id = f"audio_{record.stream_id}"
    headers = {"X-Stream-Id": f"{record.stream_id},{audio_stream.stream_id}"}
    from ..speech import AudioEncoder

    rate = int(getattr(tts, "sample_rate", 22050))
    encoder = AudioEncoder(_CHAT_AUDIO_FORMATS[fmt], rate, _OPENAI_PCM_RATE if fmt == "pcm16" else None)
    queue: asyncio.Queue[Any] = asyncio.Queue()  # events of both streams, told apart by their type

    async def read_text() -> None:
        try:
            async for ev in record.subscribe():
                if isinstance(ev, TextEvent) and ev.delta:
                    feed.feed(ev.delta)
                await queue.put(ev)
        finally:
            feed.end()

    async def read_audio() -> None:
        async for ev in audio_stream:
            await queue.put(ev)

    async def merged() -> AsyncIterator[Any]:
        tasks = [asyncio.ensure_future(read_text()), asyncio.ensure_future(read_audio())]
        finals = 0
        try:
            while finals < 2:
                ev = await queue.get()
                if ev.is_final:
                    finals += 1
                    if isinstance(ev, ErrorEvent):
                        yield ev
                        return
                yield ev
        finally:
            for task in tasks:
                task.cancel()
            audio_stream.cancel()
            if not record.done:
                record.cancel()

    def usage(final: Any) -> dict[str, Any]:
        u = (final.usage if final is not None else None) or {"prompt_tokens": 0, "completion_tokens": 0}
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    if not stream:
        text_final, pieces, error = None, [], None
        async for ev in merged():
            if isinstance(ev, ErrorEvent):
                error = ev
            elif isinstance(ev, TextEvent) and ev.is_final:
                text_final = ev
            elif isinstance(ev, AudioEvent) and not ev.is_final:
                pieces.append(await asyncio.to_thread(encoder.feed, ev.data))
        if error is not None or text_final is None:
            message = error.error.get("message") if error is not None else "no final event"
            return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                           "code": error.error.get("type") if error else None}}, status_code=500)
        pieces.append(await asyncio.to_thread(encoder.flush))
        message_body = {"role": "assistant", "content": None, "refusal": None,
                        "audio": {"id": audio_id, "data": base64.b64encode(b"".join(pieces)).decode("ascii"),
                                  "expires_at": int(time.time()) + 3600, "transcript": text_final.text or ""}}
        finish = "length" if text_final.finish_reason == "length" else "stop"
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "system_fingerprint": None, "usage": usage(text_final),
                             "choices": [{"index": 0, "message": message_body, "logprobs": None,
                                          "finish_reason": finish}]}, headers=headers)

    async def events() -> AsyncIterator[ServerSentEvent]:
        yield json_event(chunk({"role": "assistant", "content": None}))
        text_final = None
        async for ev in merged():
            if isinstance(ev, ErrorEvent):
                yield json_event({"error": {"message": ev.error.get("message"), "type": "server_error",
                                           "param": None, "code": ev.error.get("type")}})
                return
            if isinstance(ev, TextEvent):
                if ev.delta:
                    yield json_event(chunk({"audio": {"id": audio_id, "transcript": ev.delta}}))
                if ev.is_final:
                    text_final = ev
            elif not ev.is_final:
                data = await asyncio.to_thread(encoder.feed, ev.data)
                if data:
                    yield json_event(chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}}))
            else:
                data = await asyncio.to_thread(encoder.flush)
                if data:
                    yield json_event(chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}}))
        finish = "length" if text_final is not None and text_final.finish_reason == "length" else "stop"
        yield json_event(chunk({"audio": {"id": audio_id, "expires_at": int(time.time()) + 3600}}, finish))
        if include_usage:
            yield json_event({**chunk({}), "choices": [], "usage": usage(text_final)})
        yield ServerSentEvent(data=DONE)

    return EventSourceResponse(events(), headers=headers, ping=state.settings.heartbeat_s)
