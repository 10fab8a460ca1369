"""``WS /v1/ws``: several streams on one WebSocket, image frames as binary messages.

Client -> server (JSON text messages):

- ``{"type": "text", "id": "c1", "prompt": "hi", "max_new_tokens": 32, ...}``: start a text
  stream (the body of ``POST /v1/text``; ``id`` is an optional client tag echoed back).
- ``{"type": "image", "id": "c2", "prompt": "...", "steps": 20, ...}``: start an image stream.
- ``{"type": "speech", "id": "c3", "text": "Hello there.", "speed": 1.0, ...}``: start a speech
  stream (the body of ``POST /v1/speech``); ``{"type": "video", ...}`` likewise a video stream
  (the body of ``POST /v1/video``).
- ``{"type": "cancel", "stream_id": "...", "token": "..."}``: cancel a stream (it ends with
  ``finish_reason="cancelled"``).
- ``{"type": "resume", "stream_id": "...", "after": 12, "token": "..."}``: follow an existing
  stream from seq 13.
- ``{"type": "finish", "stream_id": "...", "token": "..."}``: stop now and keep the result
  (``finish_reason="finished_early"``).
- ``{"type": "steer", "stream_id": "...", "instruction": "..."}`` (text) or ``{"type": "steer",
  "stream_id": "...", "prompt": "...", "negative_prompt": ..., "guidance_scale": ...}`` (image):
  change the generation from the model's next step.
- ``{"type": "rewind", "stream_id": "...", "offset": 120, "instruction": null, "token_id": null}`` (text):
  regenerate from character ``offset`` (starting with token ``token_id``, when given: a branch).
- ``{"type": "auth", "api_key": "..."}``: on a keyed server, the first message when the key did
  not come in the ``Authorization`` header or as a ``bearer.KEY`` subprotocol.

Streams this socket started need no ``token``; others need the one their creation returned (or,
with API keys, the same key). A socket follows or starts at most ``ws_max_streams`` streams at
once; messages are at most ``max_body_bytes`` bytes.

Server -> client:

- ``{"type": "queued", "id": "c1", "position": 2, "queued": 3}`` while a new stream waits for a
  slot: when it joins the queue and each time it moves (position 1 = next; ``queued`` waiting in
  all). Not a protocol event (no ``seq``; never replayed by a resume).
- ``{"type": "accepted", "id": "c1", "stream_id": "...", "resume_token": "..."}`` once a stream is
  admitted; then its
  events: ``text`` and ``error`` events as JSON text messages in the wire form.
- ``image`` and ``video`` events as **binary** messages, no base64::

      [4 bytes: N, big-endian unsigned][N bytes: UTF-8 JSON header][image bytes]

  The header is the event's wire form without ``data`` (``mime`` says how to decode the bytes).
- ``audio`` events as **binary** messages of the same shape: the header is the wire form without
  ``data`` and ``audio``, plus ``"binary": [len(data), len(audio)]``; the bytes are the chunk's PCM,
  then (on the final event) the whole utterance's WAV.
- ``{"type": "rejected", "id": "c1", "status": 400, "error": {"type", "message"}}`` when a
  request is refused (bad arguments, queue full: 429, an edit of an ended stream: 409, ...).
  The socket stays open.
- ``{"type": "edited", "id": "c3", "stream_id": "...", "command": "steer", "accepted": true}``
  when a ``finish``/``steer``/``rewind`` was queued (its effect shows in the stream's events);
  with ``"pending": true`` and a ``note`` when the stream runs in another process that did not
  confirm in time (see ``edits.apply_edit``).

- ``{"type": "handed_off", "id": "c1", "stream_id": "...", "after": 41, "resume_token": "..."}``
  when this server shut down (SIGTERM) with a Redis log and handed the stream to the next server
  (``continuation.hand_off``): send ``{"type": "resume", "stream_id": ..., "after": 41, "token":
  ...}`` to a server on the same log for the rest, with no gap or duplicate.

With a shared event log (``event_log="redis://..."``), ``cancel``, ``resume`` and the edits also
reach streams that another server process (or Ray ingress replica) runs.

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

from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ...events import AudioEvent, Event, ImageEvent, VideoEvent, event_from_dict
from ..access.keys import Principal
from ..families import FAMILIES, find_family
from ..http.bodies import parse_json_object
from ..http.problems import Problem, problem_from_exception
from ..streams.edits import apply_edit
from ..streams.view import StreamView

__all__ = ["decode_message", "encode_image_frame", "router"]

logger = logging.getLogger("multistream.server")

def encode_image_frame(ev: ImageEvent | VideoEvent) -> bytes:
    """An image or video event as one binary message: 4-byte header length, JSON header, raw bytes."""
    header = ev.to_dict()
    header.pop("data", None)
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return struct.pack(">I", len(raw)) + raw + ev.data


def encode_audio_frame(ev: AudioEvent) -> bytes:
    """An audio event as one binary message: 4-byte header length, JSON header, PCM (+ WAV)."""
    header = ev.to_dict()
    header.pop("data", None)
    header.pop("audio", None)
    audio = ev.audio or b""
    header["binary"] = [len(ev.data), len(audio)]
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return struct.pack(">I", len(raw)) + raw + ev.data + audio


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
        payload = bytes(message[4 + n:])
        sizes = header.pop("binary", None)
        ev = event_from_dict({**header, "data": ""})
        if sizes is not None:  # an audio event: its PCM, then (final) its WAV
            audio = payload[sizes[0]:sizes[0] + sizes[1]] if sizes[1] else None
            return dataclasses.replace(ev, data=payload[:sizes[0]], audio=audio)  # type: ignore[type-var]
        return dataclasses.replace(ev, data=payload)  # type: ignore[type-var]
    payload = json.loads(message)
    if payload.get("type") in ("text", "image", "audio", "video", "error"):
        return event_from_dict(payload)
    return payload  # type: ignore[no-any-return]


class _Connection:
    def __init__(self, ws: WebSocket, principal: Principal | None) -> None:
        self.ws = ws
        self.state: Any = ws.app.state.multistream
        self.settings = self.state.settings
        self.principal = principal
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.notices: set[asyncio.Task[None]] = set()  # queued notices on their way
        self.mine: set[str] = set()  # streams this socket started
        self.closed = False

    async def send(self, message: str | bytes | Event, record: StreamView | None = None) -> None:
        """Send a control message or an event; events are encoded only once the lock is ours, so
        a slow client holds at most one encoded frame per stream, not a queue of copies."""
        async with self.lock:
            if self.closed:
                raise WebSocketDisconnect(1006)
            if isinstance(message, (ImageEvent, VideoEvent)):
                message = encode_image_frame(message)
            elif isinstance(message, AudioEvent):
                message = encode_audio_frame(message)
            elif not isinstance(message, (str, bytes)):
                message = record.json(message.seq) if record is not None else message.to_json()
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
        try:
            await self.send(json.dumps({"type": "rejected", "id": tag, "status": problem.status, **problem.body()}))
        except (WebSocketDisconnect, RuntimeError):
            pass

    async def authenticate(self) -> bool:
        """Keyed server, no key in the handshake: the first message must be ``{"type": "auth"}``."""
        try:
            message = await asyncio.wait_for(self.ws.receive(), self.settings.header_timeout_s or None)
        except asyncio.TimeoutError:
            message = {"type": "websocket.disconnect"}
        key = None
        text = message.get("text")
        if text is not None and len(text) < 4096:
            try:
                body = json.loads(text)
                if isinstance(body, dict) and body.get("type") == "auth" and isinstance(body.get("api_key"), str):
                    key = self.state.keyring.find(body["api_key"])
            except ValueError:
                pass
        if key is None:
            if message["type"] != "websocket.disconnect":
                await self.reject(None, Problem(401, "unauthorized", 'missing or wrong API key: send it in the '
                                  'Authorization header, as a "bearer.KEY" subprotocol, or first {"type": "auth", '
                                  '"api_key": KEY}'))
                await self.ws.close(code=1008, reason="unauthorized")
            return False
        client = self.ws.client
        self.principal = self.state.keyring.principal(key, client.host if client else None)
        await self.send(json.dumps({"type": "authenticated"}))
        return True

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
                try:
                    self.handle(text)
                except Exception as exc:  # noqa: BLE001 - one bad message must not close the socket
                    problem = problem_from_exception(exc)
                    if problem.status >= 500:
                        logger.exception("websocket message failed")
                    self._spawn(self.reject(None, problem))
        finally:
            self.closed = True
            for task in self.tasks:
                task.cancel()

    async def _record(self, body: dict[str, Any]) -> Any:
        """The stream (held here, or another process's from the shared event log), if this socket
        may touch it; a 404 `Problem` otherwise."""
        stream_id = body.get("stream_id")
        record = await self.state.registry.fetch(stream_id) if isinstance(stream_id, str) else None
        token = body.get("token") if isinstance(body.get("token"), str) else None
        if record is None or not (record.stream_id in self.mine or record.allows(self.principal, token)):
            raise Problem(404, "stream_not_found", f"no stream {str(stream_id)[:64]!r} here for you (send the "
                          "'token' its creation returned, or use the key that created it)")
        return record

    def handle(self, text: str) -> None:
        tag = None
        try:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > self.settings.max_body_bytes:
                raise Problem(413, "body_too_large", f"the message has {size} bytes; at most "
                              f"{self.settings.max_body_bytes} (max_body_bytes)")
            body = parse_json_object(text)
            tag = body.pop("id", None)
            if not (tag is None or isinstance(tag, (str, int)) and len(str(tag)) <= 128):
                tag = None
                raise Problem(400, "invalid_type", "'id' must be a short string or an integer (echoed back)")
            kind = body.pop("type", None)
            if kind in ("cancel", "finish", "steer", "rewind", "resume"):
                if kind == "resume":
                    after = body.get("after", -1)
                    if not isinstance(after, int) or isinstance(after, bool) or after < -1:
                        raise Problem(400, "invalid_type", "'after' must be an integer seq >= -1")
                    self._check_room()
                # Async: a stream another process runs is looked up in the shared event log first.
                # (A local one is found without suspending, so messages keep their order.)
                self._spawn(self._control(tag, kind, body))
                return
            fam = find_family(kind)  # a new stream of a family (its older spellings too: "audio")
            if fam is None:
                if kind == "auth":
                    raise Problem(400, "invalid_message", "already authenticated")
                names = ", ".join(f"'{f.name}'" for f in FAMILIES)
                raise Problem(400, "invalid_message", f"'type' must be {names}, 'cancel', 'resume', 'finish', 'steer' "
                              f"or 'rewind', got {str(kind)[:40]!r}")
            kwargs, priority = fam.parse(body, self.settings)
            self._check_room()
            self._spawn(self._start(tag, fam.name, kwargs, priority))
        except Problem as problem:
            self._spawn(self.reject(tag, problem))

    async def _control(self, tag: Any, kind: str, body: dict[str, Any]) -> None:
        try:
            record = await self._record(body)
            if kind == "cancel":
                record.cancel()
            elif kind == "resume":
                if not record.resumable:
                    raise Problem(404, "stream_not_found", "that stream cannot be resumed")
                record.check_follower_room()
                await self._follow(tag, record, body.get("after", -1))
            else:
                body.pop("stream_id", None)
                body.pop("token", None)
                status, result = await apply_edit(record, kind, body, self.state.settings, self.state.registry.log)
                await self._send_quietly(json.dumps({"type": "edited", "id": tag, **result}))
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the client
            problem = problem_from_exception(exc)
            if problem.status >= 500 and not isinstance(exc, Problem):
                logger.exception("websocket %s failed", kind)
            await self.reject(tag, problem)

    async def _send_quietly(self, message: str) -> None:
        try:
            await self.send(message)
        except (WebSocketDisconnect, RuntimeError):
            pass

    def _tell(self, message: str) -> None:
        """Send a notice soon, from a synchronous callback (in order: the send lock is fair).
        Not one of ``tasks``, which count the streams in flight."""
        task = asyncio.get_running_loop().create_task(self._send_quietly(message))
        self.notices.add(task)
        task.add_done_callback(self.notices.discard)

    def _check_room(self) -> None:
        if len(self.tasks) >= self.settings.ws_max_streams:
            raise Problem(429, "too_many_streams", f"this socket already has {len(self.tasks)} streams in flight "
                          f"(ws_max_streams); wait for one to end or open another socket")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start(self, tag: Any, kind: str, kwargs: dict[str, Any], priority: int) -> None:
        try:
            record = await self.state.open_stream(kind, kwargs, priority=priority, principal=self.principal,
                                                  on_queued=lambda position, queued: self._tell(json.dumps(
                                                      {"type": "queued", "id": tag, "position": position,
                                                       "queued": queued})))
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the client
            await self.reject(tag, problem_from_exception(exc))
            return
        self.mine.add(record.stream_id)
        await self._follow(tag, record, -1)

    async def _follow(self, tag: Any, record: StreamView, after: int) -> None:
        try:
            await self.send(json.dumps({"type": "accepted", "id": tag, "stream_id": record.stream_id,
                                        "resume_token": record.token}))
            last = after
            async for ev in record.subscribe(after):
                await self.send(ev, record)
                last = ev.seq
            if record.handed_off:
                # Redeploy (SIGTERM with a Redis log): the stream goes on in the next server. Say so,
                # with what a `resume` there needs, instead of going quiet.
                await self.send(json.dumps({"type": "handed_off", "id": tag, "stream_id": record.stream_id,
                                            "after": last, "resume_token": record.token}))
        except (WebSocketDisconnect, RuntimeError):
            pass  # the socket went away: the stream gets its grace period


router = APIRouter()


@router.websocket("/v1/ws")
async def ws_endpoint(ws: WebSocket) -> None:
    state = ws.app.state.multistream
    if state.draining:
        await ws.close(code=1013, reason="the server is shutting down")
        return
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    # A browser offered protocols must get one back; never echo the key-bearing one when another fits.
    subprotocol = next((p for p in offered if not p.startswith("bearer.")), offered[0] if offered else None)
    await ws.accept(subprotocol=subprotocol)
    conn = _Connection(ws, getattr(ws.state, "principal", None))
    try:
        if getattr(ws.state, "auth_pending", False) and not await conn.authenticate():
            return
        await conn.run()
    except WebSocketDisconnect:
        pass
    finally:
        if ws.client_state == WebSocketState.CONNECTED and ws.application_state == WebSocketState.CONNECTED:
            try:
                await ws.close()
            except RuntimeError:
                pass
