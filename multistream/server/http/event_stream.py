"""`EventStream`: the SSE response of a stream's events, with one helper task per connection.

sse-starlette's `EventSourceResponse` starts four tasks in an anyio task group for every
response (the stream, the heartbeat, the disconnect listener, the exit-signal listener) and
enters an anyio cancel scope for every send. At 200 concurrent clients of `benchmarks/sse_anchor.py`
(after the wire JSON was compiled, `multistream._event_wire`) the server took 1.95-2.05 ms of CPU
a stream with sse-starlette's response and 1.75-1.85 ms with this one (separate runs on the same
machine). Every streaming route takes it (`http.sse.event_source`); it does the same job with less:

- the frames are written from the request's own task, and each send only notes the time;
- one task waits for the client's ``http.disconnect`` and then cancels the writing (so the
  stream's subscription ends at once and its grace period starts);
- one timer keeps the clock: a heartbeat comment (``: ping - <time>``, as sse-starlette writes
  it) after ``heartbeat_s`` without a write, and the end of the connection when one write has
  not been taken within ``send_timeout_s`` (a client that stopped reading);
- no exit-signal listener: on shutdown the server's drain ends the streams (`runner`), and
  uvicorn's graceful-shutdown timeout ends any connection left.

Example (inside a route):
    >>> return EventStream(frames(), headers={"X-Stream-Id": sid}, heartbeat_s=15.0,
    ...                    send_timeout_s=30.0)   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from datetime import datetime, timezone
from typing import Any

from sse_starlette.sse import ensure_bytes
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

__all__ = ["EventStream"]


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response of ``frames`` (bytes, each one or more whole SSE frames, or
    `ServerSentEvent` objects, encoded as sse-starlette encodes them):
    heartbeats, a send timeout and the client's disconnect handled as the module docstring says.
    ``heartbeat_s`` 0 sends none; ``send_timeout_s`` None or 0 waits for a slow client forever."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[Any], *, headers: Mapping[str, str] | None = None,
                 heartbeat_s: float = 15.0, send_timeout_s: float | None = None) -> None:
        merged = {"Cache-Control": "no-store", **(headers or {}), "Connection": "keep-alive",
                  "X-Accel-Buffering": "no"}
        super().__init__(frames, headers=merged, media_type=self.media_type)
        self.heartbeat_s = float(heartbeat_s or 0.0)
        self.send_timeout_s = float(send_timeout_s) if send_timeout_s else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._pinging: asyncio.Task[None] | None = None
        self._send: Send | None = None
        self._last_write = 0.0
        self._writing_since: float | None = None  # a frame write the client has not taken yet
        self._pinging_since: float | None = None  # the same for a heartbeat
        self._ended_here = False  # the writer was cancelled by this response (disconnect, timeout)
        self._closing = False  # past the writing: nothing may cancel the request's task any more

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._writer = asyncio.current_task()
        self._send = send
        listener = loop.create_task(self._until_disconnect(receive))
        self._last_write = loop.time()
        self._arm()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if chunk.__class__ is not bytes:  # a ServerSentEvent (or what sse-starlette takes)
                    chunk = ensure_bytes(chunk, "\r\n")
                self._writing_since = self._last_write = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._writing_since = None
            await self._stop_clock()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            uncancel = getattr(self._writer, "uncancel", None)  # Python 3.11+: cancellations are counted
            if not (self._ended_here and (uncancel is None or uncancel() == 0)):
                raise  # cancelled from outside (uvicorn's shutdown): not ours to swallow
        except OSError:
            pass  # the client went away mid-write (uvicorn's ClientDisconnected)
        finally:
            self._closing = True
            listener.cancel()
            if self._timer is not None:
                self._timer.cancel()
            if self._pinging is not None:
                self._pinging.cancel()
            # The frames' own cleanup (the stream's subscription: its grace period) runs now,
            # not whenever the event loop's async-generator finalizer gets to it.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    # -- the client ---------------------------------------------------------------------------

    async def _until_disconnect(self, receive: Receive) -> None:
        try:
            while True:
                message: Message = await receive()
                if message["type"] == "http.disconnect":
                    break
        except Exception:  # noqa: BLE001 - a connection that cannot be read is gone too
            pass
        self._end_here()

    def _end_here(self) -> None:
        """Stop the writing (the client is gone or stopped reading): cancel the request's task
        at its current wait, which `__call__` catches. Never once the writing is over: the task
        goes on to run the middleware's code then."""
        if self._writer is None or self._closing or self._ended_here:
            return
        self._ended_here = True
        self._writer.cancel()

    # -- the clock: heartbeats and the send timeout -------------------------------------------

    def _in_flight_since(self) -> float | None:
        """When the oldest write the client has not taken yet began (None: nothing waits)."""
        return min((t for t in (self._writing_since, self._pinging_since) if t is not None), default=None)

    def _arm(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        waiting = self._in_flight_since()
        deadlines = []
        if self.heartbeat_s > 0:
            due = self._last_write + self.heartbeat_s
            # Due while a write is still in flight: no heartbeat is needed then; look again later.
            deadlines.append(due if due > now else now + self.heartbeat_s)
        if self.send_timeout_s is not None:
            # Nothing in flight: a write that starts meanwhile is looked at by then, and gets
            # its full timeout from its own start.
            deadlines.append(waiting + self.send_timeout_s if waiting is not None else now + self.send_timeout_s)
        if deadlines:
            self._timer = self._loop.call_at(min(deadlines), self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self._timer = None
        if self._ended_here:
            return
        now = self._loop.time()
        oldest = self._in_flight_since()
        if self.send_timeout_s is not None and oldest is not None and now - oldest >= self.send_timeout_s:
            self._end_here()  # a client that stopped reading: drop the connection
            return
        if self.heartbeat_s > 0 and oldest is None and self._pinging is None \
                and now - self._last_write >= self.heartbeat_s:
            self._pinging = self._loop.create_task(self._ping())
        self._arm()

    async def _ping(self) -> None:
        assert self._loop is not None and self._send is not None  # set by __call__ before the clock starts
        send = self._send
        try:
            self._pinging_since = self._last_write = self._loop.time()
            await send({"type": "http.response.body", "body": f": ping - {datetime.now(timezone.utc)}\r\n\r\n".encode(),
                        "more_body": True})
        except OSError:
            self._end_here()
        finally:
            self._pinging_since = None
            self._pinging = None

    async def _stop_clock(self) -> None:
        """Before the closing write: no heartbeat may follow it. A heartbeat in flight has
        handed its bytes to the transport already (a send awaits only the flow control)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pinging = self._pinging
        if pinging is not None:
            pinging.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pinging
