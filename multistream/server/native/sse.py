"""Server-Sent Events for a stream: ``id:`` = seq, ``event:`` = type, ``data:`` = the wire JSON.

A connection is one subscriber of the stream's log, so ``Last-Event-ID`` (or ``?after=SEQ``)
resumes exactly after that event. Idle connections get heartbeat comments; a client that stops
reading is dropped after the send timeout (the stream itself keeps running for the grace period).

A new native stream (``POST /v1/text``, ``/v1/image``, ``/v1/speech``) that has to wait for a slot
answers at once (200, with ``X-Stream-Id`` and ``X-Resume-Token``) and tells the client where it
stands: ``event: queued`` with ``{"position": N, "queued": M}`` (position 1 = next; M waiting in
all) when it joins the queue and each time it moves; then the stream's events as usual. A queued
event is not a protocol event: it has no ``id:`` (so an EventSource's Last-Event-ID is untouched)
and no ``seq``, and it is not in the stream's event log, so a resume never replays it. A request
refused while it waited (queue timeout, shutdown, a prompt the model refuses) ends with one
``error`` event (seq 0) carrying the refusal's ``type`` and ``message``.

Example (what a client sees):
    event: queued
    data: {"position":2,"queued":3}

    id: 0
    event: text
    data: {"type":"text","stream_id":"9f...","seq":0,"t":0.05,"is_final":false,"delta":"Hi",...}
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sse_starlette import ServerSentEvent

from ...events import ErrorEvent
from ..http.event_stream import EventStream
from ..http.problems import Problem, problem_from_exception
from ..http.sse import event_source
from ..settings import ServerSettings
from ..streams.registry import StreamRecord, new_token
from ..streams.view import StreamView
from ..streams.waiting import WaitingStream

if TYPE_CHECKING:
    from starlette.requests import Request

    from ..access.keys import Principal
    from ..state import ServerState

__all__ = ["QueuePosition", "new_stream_sse", "queued_sse_response", "sse_response"]


async def _events(record: StreamView, after: int) -> AsyncIterator[bytes]:
    # The frame written out directly (what `ServerSentEvent.encode` makes, byte for byte): the
    # wire JSON is one line, so the regex splitting and StringIO of `encode` buy nothing per event.
    async for ev in record.subscribe(after):
        yield f"id: {ev.seq}\r\nevent: {ev.type}\r\ndata: {record.json(ev.seq)}\r\n\r\n".encode()


def sse_response(record: StreamView, settings: ServerSettings, after: int = -1) -> EventStream:
    """An SSE response that replays ``record`` after ``after`` and then follows it live."""
    return event_source(_events(record, after), settings, record.stream_id)


class QueuePosition:
    """Where a waiting request stands: the newest ``(position, queued)`` (an ``on_move`` callback
    for `Admission.acquire`), coalesced: a slow reader gets the newest, not a backlog.

    Example:
        >>> where = QueuePosition()
        >>> where(2, 3); where(1, 2)
        >>> where.take()
        (1, 2)
    """

    def __init__(self) -> None:
        self._newest: tuple[int, int] | None = None
        self._changed = asyncio.Event()

    def __call__(self, position: int, queued: int) -> None:
        self._newest = (position, queued)
        self._changed.set()

    def take(self) -> tuple[int, int] | None:
        """The position not told yet (None if it did not change since)."""
        newest, self._newest = self._newest, None
        self._changed.clear()
        return newest

    async def changed(self) -> None:
        await self._changed.wait()


async def admit_or_queue(start: Callable[[QueuePosition], Awaitable[StreamRecord]],
                         ) -> tuple[StreamRecord | None, asyncio.Task[StreamRecord], QueuePosition]:
    """Run ``start(on_queued)`` (`ServerState.open_stream`) until it is admitted or queued:
    (the record, ...) when it ran at once (its refusals raise here, as HTTP errors), or (None, the
    task that goes on waiting, its `QueuePosition`) when it joined the queue."""
    where = QueuePosition()
    task = asyncio.ensure_future(start(where))
    queued = asyncio.ensure_future(where.changed())
    try:
        await asyncio.wait({task, queued}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        queued.cancel()
    if task.done():
        return task.result(), task, where
    return None, task, where


def queued_sse_response(task: asyncio.Task[StreamRecord], where: QueuePosition, stream_id: str, token: str,
                        settings: ServerSettings, on_refused: Callable[[Problem], None] | None = None,
                        waiting: WaitingStream | None = None) -> EventStream:
    """The SSE response of a request waiting in the queue (see the module's docstring): queued
    events while ``task`` (the admission) waits, then the stream's events. The client going away
    cancels the wait (its place in the queue is given up); so does ``DELETE /v1/streams/{id}``
    (``waiting``, `streams.waiting`), which ends the response with one ``error`` event of type
    ``cancelled``."""

    async def events() -> AsyncIterator[ServerSentEvent | bytes]:
        try:
            while not task.done():
                told = where.take()
                if told is not None:
                    yield ServerSentEvent(data=json.dumps({"position": told[0], "queued": told[1]}),
                                          event="queued")
                moved = asyncio.ensure_future(where.changed())
                try:
                    await asyncio.wait({task, moved}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    moved.cancel()
            if task.cancelled() and waiting is not None and waiting.cancelled:
                error = ErrorEvent(stream_id=stream_id, seq=0, t=0.0, error={
                    "type": "cancelled", "message": "cancelled while waiting in the queue (DELETE /v1/streams/{id})"})
                yield ServerSentEvent(data=error.to_json(), event=error.type, id="0")
                return
            try:
                record = task.result()
            except Exception as exc:  # noqa: BLE001 - a refusal after the 200: the stream's one event
                problem = problem_from_exception(exc)
                if on_refused is not None:
                    on_refused(problem)
                error = ErrorEvent(stream_id=stream_id, seq=0, t=0.0,
                                   error={"type": problem.type, "message": problem.message})
                yield ServerSentEvent(data=error.to_json(), event=error.type, id="0")
                return
            async for frame in _events(record, -1):
                yield frame
        finally:
            if not task.done():
                task.cancel()

    return event_source(events(), settings, stream_id, {"X-Resume-Token": token})


async def new_stream_sse(state: ServerState, kind: str, kwargs: dict[str, Any], *, priority: int,
                         request: Request, arrived_at: float, principal: Principal,
                         ) -> EventStream:
    """A native route's new stream as SSE: admitted at once, its events (``X-Stream-Id``,
    ``X-Resume-Token``); queued, the queued events first (`queued_sse_response`); refused before
    the response starts (a full queue, a bad prompt), the `Problem` raised here.

    Example (inside a route):
        >>> return await new_stream_sse(state, "text", kwargs, priority=0, request=request,
        ...                             arrived_at=arrived, principal=principal)  # doctest: +SKIP
    """
    gate = state.gates.get(kind)
    if gate is None or not gate.would_wait():
        # A free slot: admitted without a suspension (no task, no queue bookkeeping on the hot path).
        record = await state.open_stream(kind, kwargs, priority=priority, request=request, arrived_at=arrived_at,
                                         principal=principal)
        return _created(record, state.settings)
    stream_id, token = uuid.uuid4().hex, new_token()
    record, task, where = await admit_or_queue(lambda on_queued: state.open_stream(
        kind, kwargs, priority=priority, arrived_at=arrived_at, principal=principal, on_queued=on_queued,
        reserved=(stream_id, token)))
    if record is not None:  # a slot came free meanwhile
        return _created(record, state.settings)

    def refused(problem: Problem) -> None:
        state.metrics.rejected.inc(status=str(problem.status), reason=problem.type)

    # Its client holds the id now: DELETE /v1/streams/{id} cancels the wait.
    waiting = state.waiting.add(stream_id, token, owner=principal.id if principal is not None else None,
                                owner_keyed=bool(principal is not None and principal.keyed), cancel=task.cancel)
    task.add_done_callback(lambda _: state.waiting.remove(stream_id))
    return queued_sse_response(task, where, stream_id, token, state.settings, on_refused=refused, waiting=waiting)


def _created(record: StreamRecord, settings: ServerSettings) -> EventStream:
    response = sse_response(record, settings)
    response.headers["X-Resume-Token"] = record.token
    return response
