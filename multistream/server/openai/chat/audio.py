"""OpenAI's audio chat: ``POST /v1/chat/completions`` with ``modalities=["text", "audio"]``, the
answer spoken while it is written (the text model admitted as for any chat, its sentences spoken on
the speech model as soon as the text has them).

Example:
    >>> client.chat.completions.create(model="default", modalities=["text", "audio"],   # doctest: +SKIP
    ...     audio={"voice": "alloy", "format": "pcm16"}, messages=[{"role": "user", "content": "hi"}], stream=True)
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....events import AudioEvent, ErrorEvent
from ...access.keys import Principal
from ...bodies import speech_voice
from ...http.problems import Problem
from ...http.sse import DONE, event_source, json_event
from ...state import ServerState
from ..audio.protocol import OPENAI_PCM_RATE

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
    from ....events import TextEvent
    from .protocol import chat_kwargs

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
    tts = state.model_for("speech")
    voice = speech_voice(tts, audio_opts["voice"])
    text_body = {k: v for k, v in body.items() if k not in ("modalities", "audio")}
    kwargs, priority, _, include_usage = chat_kwargs(text_body, state.settings)
    record = await state.open_stream("text", kwargs, priority=priority, request=request, resumable=False,
                                     principal=principal)
    audio_stream, feed = tts.open_stream(voice=voice, priority=priority)
    cid, created, model = f"chatcmpl-{record.stream_id}", int(time.time()), record.model_name
    audio_id = f"audio_{record.stream_id}"
    headers = {"X-Stream-Id": f"{record.stream_id},{audio_stream.stream_id}"}
    from ....speech import AudioEncoder

    rate = int(getattr(tts, "sample_rate", 22050))
    encoder = AudioEncoder(_CHAT_AUDIO_FORMATS[fmt], rate, OPENAI_PCM_RATE if fmt == "pcm16" else None)
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

    return event_source(events(), state.settings, headers["X-Stream-Id"])
