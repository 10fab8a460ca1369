"""Server-Sent Events for a stream: ``id:`` = seq, ``event:`` = type, ``data:`` = the wire JSON.

A connection is one subscriber of the stream's log, so ``Last-Event-ID`` (or ``?after=SEQ``)
resumes exactly after that event. Idle connections get heartbeat comments; a client that stops
reading is dropped after the send timeout (the stream itself keeps running for the grace period).

Example (what a client sees):
    id: 0
    event: text
    data: {"type":"text","stream_id":"9f...","seq":0,"t":0.05,"is_final":false,"delta":"Hi",...}
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse, ServerSentEvent

from .registry import StreamRecord
from .settings import ServerSettings

__all__ = ["sse_response"]


def sse_response(record: StreamRecord, settings: ServerSettings, after: int = -1) -> EventSourceResponse:
    """An SSE response that replays ``record`` after ``after`` and then follows it live."""

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for ev in record.subscribe(after):
            yield ServerSentEvent(data=record.json(ev.seq), event=ev.type, id=str(ev.seq))

    return EventSourceResponse(
        events(),
        headers={"X-Stream-Id": record.stream_id, "Cache-Control": "no-store"},
        ping=settings.heartbeat_s,
        send_timeout=settings.send_timeout_s or None,
        # Our own drain ends the streams on SIGTERM; sse-starlette must not cut them first.
        shutdown_grace_period=settings.shutdown_deadline_s + settings.cancel_timeout_s + 5,
    )
