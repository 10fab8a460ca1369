"""What every OpenAI endpoint shares: its refusals' table, reading a body whose ``model`` must name
the served model, who may read a stored object (a response, a video job), the finish-reason map, an error event's body, the SSE response of one or more
streams and of a translator's chunks, and collecting a whole answer for ``stream: false``.

Example:
    >>> openai_finish("cancelled"), openai_finish("length"), openai_finish(None)
    ('stop', 'length', 'stop')
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sse_starlette import ServerSentEvent

from ...errors import InvalidArgumentError
from ...events import ErrorEvent, Event
from ..http.bodies import OpenAIErrorResponse, read_body
from ..http.disconnect import until_done_or_gone
from ..http.errors import error_responses
from ..http.event_stream import EventStream
from ..http.problems import Problem
from ..http.sse import DONE, event_source, json_event
from ..settings import ServerSettings
from ..streams.view import StreamView

if TYPE_CHECKING:
    from starlette.requests import Request

    from ..state import ServerState

__all__ = ["ERRORS", "FINISH", "ChunkTranslator", "chunk_events", "collect_events", "error_body", "openai_finish",
           "openai_size", "owner_allows", "read_model_body", "sse_of"]

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


def sse_of(records: Sequence[StreamView], settings: ServerSettings, events: AsyncIterator[Any]) -> EventStream:
    """An SSE response of ``events``, naming every stream it reads in ``X-Stream-Id`` (comma-separated)."""
    return event_source(events, settings, ",".join(r.stream_id for r in records))


async def collect_events(record: StreamView, request: Any) -> list[Any]:
    """Every event of a stream, for the non-streaming routes; a client that goes away meanwhile
    (an SDK timeout, say) cancels the generation instead of leaving it running to the end."""

    async def collect() -> list[Any]:
        return [ev async for ev in record.subscribe()]

    return await until_done_or_gone(collect(), request, on_gone=record.cancel)


def openai_size(size: str, sizes: Any, noun: str) -> tuple[int, int]:
    """OpenAI's ``size`` ("WIDTHxHEIGHT") as ``(width, height)``, checked against the served
    model's ``sizes`` (`ImageSizes`, or None: the model checks) so that a bad one is a 400 about
    ``size``, in the client's own terms, naming the sizes the ``noun`` model makes.

    Example:
        >>> from multistream.diffusion._sizes import EMBEDDED_IMAGE_SIZES
        >>> openai_size("96x64", EMBEDDED_IMAGE_SIZES, "image")
        (96, 64)
    """
    w, sep, h = size.partition("x")
    if not (sep and all(v.isascii() and v.isdigit() and 0 < len(v) <= 5 for v in (w, h))):
        raise Problem(400, "invalid_argument", f"size must look like '64x64' (WIDTHxHEIGHT in ASCII digits) or "
                      f"'auto', got {size[:20]!r}", param="size")
    width, height = int(w), int(h)
    if sizes is not None:
        try:
            sizes.check(height, width)
        except InvalidArgumentError:
            native = getattr(sizes, "native", None)
            example = f"; e.g. size='{native[1]}x{native[0]}' (its native size)" if native else ""
            raise Problem(400, "invalid_argument", f"size {size!r} is not one this {noun} model makes: it makes "
                          f"{sizes.describe()} (WIDTHxHEIGHT){example}", param="size") from None
    return width, height


async def read_model_body(request: Request, state: ServerState, family: str) -> Any:
    """The JSON body of an OpenAI route of ``family``; its ``model`` (when given) must name the
    served model, else 404 ``model_not_found``."""
    body = await read_body(request, state)
    state.check_model_name(family, body.get("model") if isinstance(body, dict) else None)
    return body


class ChunkTranslator(Protocol):
    """A `serving` translator of choices' events into chunks (`ChatChunks`, `CompletionChunks`)."""

    failed: bool

    def opening(self) -> list[dict[str, Any]]: ...

    def feed(self, i: int, ev: Event) -> list[dict[str, Any]]: ...

    def closing(self) -> list[dict[str, Any]]: ...


async def chunk_events(chunks: ChunkTranslator, events: AsyncIterator[tuple[int, Event]]
                       ) -> AsyncIterator[ServerSentEvent]:
    """The SSE frames of a streamed answer: the translator's chunks for ``events`` (choice index,
    event), then ``[DONE]``; an error event's chunk ends it (no ``[DONE]``)."""
    for chunk in chunks.opening():
        yield json_event(chunk)
    async for i, ev in events:
        for chunk in chunks.feed(i, ev):
            yield json_event(chunk)
        if chunks.failed:
            return
    for chunk in chunks.closing():
        yield json_event(chunk)
    yield ServerSentEvent(data=DONE)


class _Owned(Protocol):
    token: str
    owner: str | None
    owner_keyed: bool


def owner_allows(item: _Owned, request: Any, principal: Any, keyed_server: bool) -> bool:
    """May ``principal`` read ``item`` (a stored response, a video job)? Whoever sends its resume
    token (``X-Resume-Token``); with API keys the key that created it; on an open server
    (``keyed_server`` False) the client address that made it: an id alone is not a credential."""
    token = request.headers.get("x-resume-token")
    if token and item.token and secrets.compare_digest(token.encode(), item.token.encode()):
        return True
    if item.owner_keyed:
        return bool(principal.id == item.owner)
    return not keyed_server and principal.id == item.owner
