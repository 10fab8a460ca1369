"""Server-sent-event helpers shared by every streaming route: the response and one JSON frame.

Example:
    >>> json_event({"a": 1}).data
    '{"a":1}'
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from sse_starlette import ServerSentEvent

from .event_stream import EventStream

if TYPE_CHECKING:
    from ..settings import ServerSettings

__all__ = ["DONE", "event_source", "json_event"]

DONE = "[DONE]"  # the OpenAI streams' last data line


def event_source(events: AsyncIterator[Any], settings: ServerSettings, stream_id: str,
                 headers: dict[str, str] | None = None) -> EventStream:
    """An SSE response of ``events`` (frames as bytes, or `ServerSentEvent` objects) that names its
    stream(s) in ``X-Stream-Id``, with the settings' heartbeat and send timeout: every streaming
    route's (`EventStream`)."""
    return EventStream(events, headers={"X-Stream-Id": stream_id, **(headers or {})},
                       heartbeat_s=settings.heartbeat_s, send_timeout_s=settings.send_timeout_s)


def json_event(obj: Any, event: str | None = None, id: str | None = None) -> ServerSentEvent:  # noqa: A002
    """One SSE frame whose ``data`` is ``obj`` as compact JSON (non-ASCII kept as is)."""
    return ServerSentEvent(data=json.dumps(obj, ensure_ascii=False, separators=(",", ":")), event=event, id=id)
