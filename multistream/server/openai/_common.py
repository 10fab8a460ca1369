"""What every OpenAI endpoint shares: its refusals' table, the finish-reason map, an error event's
body, the SSE response of one or more streams, and collecting a whole answer for ``stream: false``.

Example:
    >>> openai_finish("cancelled"), openai_finish("length"), openai_finish(None)
    ('stop', 'length', 'stop')
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from sse_starlette import EventSourceResponse

from ...events import ErrorEvent
from ..http.bodies import OpenAIErrorResponse
from ..http.disconnect import until_done_or_gone
from ..http.errors import error_responses
from ..http.sse import event_source
from ..settings import ServerSettings
from ..streams.view import StreamView

__all__ = ["ERRORS", "FINISH", "collect_events", "error_body", "openai_finish", "sse_of"]

ERRORS = error_responses(OpenAIErrorResponse)

# Our finish reasons in OpenAI's words: OpenAI has no "cancelled" or "finished_early" (a stream
# stopped early ends as "stop"), and a stop sequence is a "stop".
FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "content_filter": "content_filter",
          "cancelled": "stop", "finished_early": "stop"}


def openai_finish(reason: str | None) -> str:
    """OpenAI's ``finish_reason`` for ours (``None``: the stream ended normally, "stop")."""
    return FINISH.get(reason or "stop", "stop")


def error_body(ev: ErrorEvent) -> dict[str, Any]:
    """An error event in OpenAI's error shape (its message was already made safe by the registry)."""
    return {"error": {"message": ev.error.get("message", "generation failed"), "type": "server_error",
                      "param": None, "code": ev.error.get("type")}}


def sse_of(records: Sequence[StreamView], settings: ServerSettings, events: AsyncIterator[Any]) -> EventSourceResponse:
    """An SSE response of ``events``, naming every stream it reads in ``X-Stream-Id`` (comma-separated)."""
    return event_source(events, settings, ",".join(r.stream_id for r in records))


async def collect_events(record: StreamView, request: Any) -> list[Any]:
    """Every event of a stream, for the non-streaming routes; a client that goes away meanwhile
    (an SDK timeout, say) cancels the generation instead of leaving it running to the end."""

    async def collect() -> list[Any]:
        return [ev async for ev in record.subscribe()]

    return await until_done_or_gone(collect(), request, on_gone=record.cancel)
