"""``WS /v1/ws``: several streams on one WebSocket, image frames as binary messages.

Client -> server (JSON text messages):

- ``{"type": "text", "id": "c1", "prompt": "hi", "max_new_tokens": 32, ...}``: start a text
  stream (the body of ``POST /v1/text``; ``id`` is an optional client tag echoed back).
- ``{"type": "image", "id": "c2", "prompt": "...", "steps": 20, ...}``: start an image stream.
- ``{"type": "cancel", "stream_id": "..."}``: cancel a stream (it ends with ``finish_reason="cancelled"``).
- ``{"type": "resume", "stream_id": "...", "after": 12}``: follow an existing stream from seq 13.

Server -> client:

- ``{"type": "accepted", "id": "c1", "stream_id": "..."}`` once a stream is admitted; then its
  events: ``text`` and ``error`` events as JSON text messages in the wire form.
- ``image`` events as **binary** messages, no base64::

      [4 bytes: N, big-endian unsigned][N bytes: UTF-8 JSON header][image bytes]

  The header is the event's wire form without ``data`` (``mime`` says how to decode the bytes).
- ``{"type": "rejected", "id": "c1", "status": 400, "error": {"type", "message"}}`` when a
  request is refused (bad arguments, queue full: 429, ...). The socket stays open.

Example (Python, with the ``websockets`` package):
    >>> import json, websockets                                            # doctest: +SKIP
    >>> async with websockets.connect("ws://127.0.0.1:8000/v1/ws") as ws:   # doctest: +SKIP
    ...     await ws.send(json.dumps({"type": "text", "prompt": "hi"}))
    ...     async for msg in ws:
    ...         ev = decode_message(msg)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import struct
from typing import Any

from fastapi import FastAPI
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..events import Event, ImageEvent, event_from_dict
from .problems import Problem, problem_from_exception
from .registry import StreamRecord
from .requests import parse_image_body, parse_json_object, parse_text_body
from .settings import ServerSettings

__all__ = ["decode_message", "encode_image_frame"]

logger = logging.getLogger("multistream.server")


def encode_image_frame(ev: ImageEvent) -> bytes:
    """An image event as one binary message: 4-byte header length, JSON header, raw bytes."""
    header = ev.to_dict()
    header.pop("data", None)
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return struct.pack(">I", len(raw)) + raw + ev.data


def decode_message(message: str | bytes) -> dict[str, Any] | Event:
    """Client side: a binary frame or an event message -> an `Event`; control messages -> dict.

    Example:
        >>> from multistream.events import ImageEvent
        >>> ev = ImageEvent(stream_id="s", seq=0, t=0.0, step=1, total_steps=2, width=1, height=1,
        ...                 mime="image/png", data=b"PNG")
        >>> decode_message(encode_image_frame(ev)) == ev
        True
    """
    if isinstance(message, (bytes, bytearray)):
        (n,) = struct.unpack(">I", message[:4])
        header = json.loads(message[4:4 + n].decode("utf-8"))
        ev = event_from_dict({**header, "data": ""})
        return dataclasses.replace(ev, data=bytes(message[4 + n:]))  # type: ignore[type-var]
    payload = json.loads(message)
    if payload.get("type") in ("text", "image", "error"):
        return event_from_dict(payload)
    return payload  # type: ignore[no-any-return]


class _Connection:
    def __init__(self, ws: WebSocket, settings: ServerSettings) -> None:
        self.ws = ws
        self.settings = settings
        self.state: Any = ws.app.state.multistream
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    async def send(self, message: str | bytes) -> None:
        async with self.lock:
            if self.closed:
                raise WebSocketDisconnect(1006)
            coro = self.ws.send_bytes(message) if isinstance(message, bytes) else self.ws.send_text(message)
            try:
                await asyncio.wait_for(coro, self.settings.send_timeout_s or None)
            except asyncio.TimeoutError:
                # The client stopped reading: drop it (its streams get the grace period).
                self.closed = True
                await self.ws.close(code=1008, reason="send timeout")
                raise WebSocketDisconnect(1008) from None

    async def reject(self, tag: Any, problem: Problem) -> None:
        self.state.metrics.rejected.inc(status=str(problem.status), reason=problem.type)
        await self.send(json.dumps({"type": "rejected", "id": tag, "status": problem.status, **problem.body()}))

    async def run(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    await self.reject(None, Problem(400, "invalid_message", "send JSON text messages, not binary"))
                    continue
                self.handle(text)
        finally:
            self.closed = True
            for task in self.tasks:
                task.cancel()

    def handle(self, text: str) -> None:
        tag = None
        try:
            if len(text) > self.settings.max_body_bytes:
                raise Problem(413, "body_too_large", f"the message has {len(text)} characters; at most "
                              f"{self.settings.max_body_bytes} (max_body_bytes)")
            body = parse_json_object(text)
            tag = body.pop("id", None)
            kind = body.pop("type", None)
            if kind == "cancel":
                record = self.state.registry.get(str(body.get("stream_id")))
                if record is None:
                    raise Problem(404, "stream_not_found", f"no stream {body.get('stream_id')!r} here")
                record.cancel()
                return
            if kind == "resume":
                record = self.state.registry.get(str(body.get("stream_id")))
                if record is None or not record.resumable:
                    raise Problem(404, "stream_not_found", f"no stream {body.get('stream_id')!r} here")
                after = body.get("after", -1)
                if not isinstance(after, int) or isinstance(after, bool):
                    raise Problem(400, "invalid_type", "'after' must be an integer seq")
                self._spawn(self._follow(tag, record, after))
                return
            if kind == "text":
                kwargs, priority = parse_text_body(body, self.settings)
            elif kind == "image":
                kwargs, priority = parse_image_body(body, self.settings)
            else:
                raise Problem(400, "invalid_message",
                              f"'type' must be 'text', 'image', 'cancel' or 'resume', got {kind!r}")
            self._spawn(self._start(tag, kind, kwargs, priority))
        except Problem as problem:
            self._spawn(self.reject(tag, problem))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start(self, tag: Any, kind: str, kwargs: dict[str, Any], priority: int) -> None:
        try:
            record = await self.state.open_stream(kind, kwargs, priority=priority)
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the client
            try:
                await self.reject(tag, problem_from_exception(exc))
            except WebSocketDisconnect:
                pass
            return
        await self._follow(tag, record, -1)

    async def _follow(self, tag: Any, record: StreamRecord, after: int) -> None:
        try:
            await self.send(json.dumps({"type": "accepted", "id": tag, "stream_id": record.stream_id}))
            async for ev in record.subscribe(after):
                if isinstance(ev, ImageEvent):
                    await self.send(encode_image_frame(ev))
                else:
                    await self.send(record.json(ev.seq))
        except (WebSocketDisconnect, RuntimeError):
            pass  # the socket went away: the stream gets its grace period


def add_websocket_route(app: FastAPI, settings: ServerSettings) -> None:
    @app.websocket("/v1/ws")
    async def ws_endpoint(ws: WebSocket) -> None:
        state = ws.app.state.multistream
        if state.draining:
            await ws.close(code=1013, reason="the server is shutting down")
            return
        await ws.accept()
        try:
            await _Connection(ws, settings).run()
        except WebSocketDisconnect:
            pass
