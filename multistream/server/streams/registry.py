"""Live and finished streams on the server: an append-only event log per stream, fanned out.

One pump task per stream consumes the model's `Stream` into the record's log and wakes the
subscribers; every connection (SSE, WebSocket, OpenAI route) is a subscriber reading the log from
its own cursor, so a reconnect replays exactly what came after its last event and then continues
live: no gap, no duplicate. The server re-numbers nothing unless it must (a content filter that
drops an event, or a final event it emits itself), and then ``seq`` stays 0, 1, 2, ... without gaps.

A live image stream keeps only the newest preview per image in its log (an older one becomes a
hole that readers skip; a resume gets the newest preview, then what follows), so a long stream's
log stays small; live and finished logs together are bounded by ``max_retained_bytes``.

Each stream has an owner (the key, or the client address on an open server) and a resume token
handed out at creation; `StreamRecord.allows` decides who may read, resume or cancel it.

A stream whose last subscriber left keeps running for the grace period, then is cancelled, unless a
client reads it through the shared event log on another server (`durable`: its reads mark it). A
finished stream stays replayable for the retention window, bounded in count and bytes.

Example (inside a running event loop):
    >>> import asyncio
    >>> from multistream.testing import ScriptedTextModel
    >>> from multistream.server import Metrics, ServerSettings
    >>> async def demo():
    ...     reg = Registry(ServerSettings(), Metrics())
    ...     rec = reg.start(ScriptedTextModel(["a", "b"]).stream("hi"), kind="text")
    ...     return "".join([ev.delta async for ev in rec.subscribe(after=-1)])
    >>> asyncio.run(demo())
    'ab'
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from ... import errors as error_types
from ...events import AudioEvent, ErrorEvent, Event, ImageEvent, TextEvent, VideoEvent
from ...stream import Stream
from ..access.metrics import Metrics
from ..families import family
from ..settings import ServerSettings
from .filtering import STOP, ContentFilter, OutputFilter
from .view import SharedAccess

__all__ = ["STOP", "ContentFilter", "Registry", "StreamRecord"]  # STOP, ContentFilter: from .filtering

logger = logging.getLogger("multistream.server")
_FIRST_READER_S = 5.0  # how long a new stream waits for its first reader, whatever the grace period


def new_token() -> str:
    """A resume token: what lets a client on an open server read, resume or cancel its stream."""
    return secrets.token_urlsafe(18)


class StreamRecord(SharedAccess):
    """One stream on the server: its event log, subscribers, grace timer and pump task."""

    def __init__(self, stream: Stream, *, kind: str, settings: ServerSettings, metrics: Metrics,
                 on_done: Callable[[StreamRecord], None], resumable: bool = True, model_name: str = "",
                 content_filter: ContentFilter | None = None, arrived_at: float | None = None,
                 count_prompt_tokens: Callable[[], int] | None = None, owner: str | None = None,
                 owner_keyed: bool = False, token: str | None = None) -> None:
        self.stream = stream
        self.owner = owner
        self.owner_keyed = owner_keyed
        self.token = token or new_token()
        self.stream_id = stream.stream_id
        self.kind = kind
        self.model_name = model_name
        self.resumable = resumable
        self.events: list[Event | None] = []  # None: a preview a newer one replaced
        self.done = False
        self.finish_reason: str | None = None
        self.subscribers = 0
        self.interrupted = False
        self.bytes = 0
        self.created = time.time()
        self.finished_at: float | None = None  # time.monotonic()
        self._settings = settings
        self._metrics = metrics
        # Counted per event: the labelled children looked up once.
        self._inter_token = metrics.inter_token.child(kind=kind)
        self._events_sent = metrics.events_sent.child(kind=kind)
        self._on_done = on_done
        self._filter = OutputFilter(content_filter, settings.filter_holdback_chars) if content_filter else None
        self._pending_ids: list[int] = []
        self._newest_preview: dict[int, int] = {}
        self._first_preview_seen = False
        self._arrived = arrived_at if arrived_at is not None else time.perf_counter()
        self._started = time.perf_counter()
        # Only needed when the server writes a final itself (rare), so the prompt is not tokenized
        # a second time for every request.
        self._count_prompt_tokens = count_prompt_tokens
        self._json: list[str | None] = []
        # Subscribers waiting for the next event: one future each, woken by `_wake` (cheaper per
        # event than an `asyncio.Event` made anew after every set).
        self._waiters: list[asyncio.Future[None]] = []
        self._loop = asyncio.get_running_loop()
        self._grace: asyncio.TimerHandle | None = None
        self._force: asyncio.TimerHandle | None = None
        self._deadline = self._loop.call_later(settings.request_timeout_s, self.cancel)
        self._drop_epoch = 0
        self.request: dict[str, Any] = {}  # the model's arguments (after the content filter), when known
        # The content filter over input text (text -> text, None or STOP), for the edits' new
        # instructions and prompts (`edits.apply_parsed_edit`); set by `ServerState.open_stream`.
        self.input_filter: Callable[[str], Any] | None = None
        self._text = ""          # text as sent (after the filter), for finals the server writes
        self._n_tokens = 0
        self._last_text_at: float | None = None
        self._force_reason = "cancelled"
        self._log: Any = None  # the shared event log's writer (`durable.event_log`), when one is configured
        # With a shared log, subscribers see an event once it is in the log (`durable` events so
        # far): a client never holds an event that a server killed right after would not have
        # logged, so the server that continues the stream after a crash (`durable.continuation`) starts
        # exactly after the client's Last-Event-ID. A log that fails stops holding them back.
        self.durable = 0
        # With a durable log: another process can continue this stream (its request is kept with
        # the log: `continuation.remember_request`); on SIGTERM it is handed off, not ended.
        self.continuable = False
        self.handed_off = False
        self.checkpoints: Any = None  # an image stream's checkpoint writer (`durable.checkpoints`)
        self._done_callbacks: list[Callable[[StreamRecord], None]] = []
        # Nobody attached yet: if nobody ever does, the grace period still ends the generation.
        # (The full period even for non-resumable streams, and at least _FIRST_READER_S: their one
        # reader attaches a moment later, so grace_period_s=0 cancels at a disconnect, not at birth.)
        self._arm_grace(on_start=True)
        self.task = self._loop.create_task(self._pump(), name=f"multistream-pump-{self.stream_id[:8]}")

    # -- reading -------------------------------------------------------------------------------

    @property
    def max_followers(self) -> int:
        return self._settings.max_followers

    def json(self, seq: int) -> str:
        """The wire JSON of event ``seq``, encoded once however many subscribers read it."""
        cached = self._json[seq]
        if cached is None:
            ev = self.events[seq]
            assert ev is not None
            cached = self._json[seq] = ev.to_json()
        return cached

    @property
    def final(self) -> Event | None:
        return self.events[-1] if self.done else None

    async def subscribe(self, after: int = -1) -> AsyncIterator[Event]:
        """Events with ``seq > after``: the replay, then live ones, up to and including the final.
        Previews a newer one replaced are skipped."""
        self._attach()
        epoch = self._drop_epoch
        cursor = max(after + 1, 0)
        got_final = False
        try:
            while True:
                while cursor < self._visible():
                    ev = self.events[cursor]
                    cursor += 1
                    if ev is None:
                        continue
                    got_final = ev.is_final
                    yield ev
                    if got_final:
                        return
                if (self.done and cursor >= len(self.events)) or self._drop_epoch != epoch:
                    return
                waiter = self._loop.create_future()
                self._waiters.append(waiter)
                await waiter
        finally:
            self._detach(got_final or self.done and cursor >= len(self.events))

    def _visible(self) -> int:
        log = self._log
        if log is None or log.failed:
            return len(self.events)
        return min(self.durable, len(self.events))

    def logged(self, upto: int) -> None:
        """The shared log holds events ``0 .. upto - 1`` (its writer calls this): show them."""
        if upto > self.durable:
            self.durable = upto
            self._wake()

    # -- control -------------------------------------------------------------------------------

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the model; if it does not end its stream within ``cancel_timeout_s``, the server
        ends it with a final event of its own."""
        if self.done:
            return
        self._force_reason = reason
        self.stream.cancel()
        if self._force is None:
            self._force = self._loop.call_later(self._settings.cancel_timeout_s, self.force_finish)

    def hand_off(self) -> None:
        """Stop the model without ending the stream, for another process to continue it from the
        shared log (`continuation.hand_off`, on SIGTERM): the final event the model makes now is
        neither kept nor logged, and the readers here are let go without one (they resume on the
        next server, which continues the stream after the last logged event)."""
        if self.done:
            return
        self.handed_off = True
        self.stream.cancel()
        self.drop_subscribers()
        if self._force is None:
            self._force = self._loop.call_later(self._settings.cancel_timeout_s, self.force_finish)

    def when_done(self, callback: Callable[[StreamRecord], None]) -> None:
        """Call ``callback(record)`` once the stream has ended here (at once if it has)."""
        if self.finished_at is not None:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    def end_now(self, reason: str = "cancelled") -> None:
        """Stop the model and end the stream at once with a server-written final event, without
        waiting for the model to end it (the server is stopping now: a second Ctrl-C)."""
        if self.done:
            return
        self._force_reason = reason
        self.stream.cancel()
        self.task.cancel()  # the pump appends the final: `_pump`'s CancelledError branch

    def force_finish(self) -> None:
        """End the stream now with a server-written final event (the model did not stop in time)."""
        if not self.done:
            logger.warning("stream %s: the model did not end after cancel; ending it on the server", self.stream_id)
            self.task.cancel()

    def drop_subscribers(self) -> None:
        """Test hook: end every current subscription without its final event (like a dropped link)."""
        self._drop_epoch += 1
        self._wake()

    # -- subscribers and grace -----------------------------------------------------------------

    def _attach(self) -> None:
        self.subscribers += 1
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _detach(self, completed: bool) -> None:
        self.subscribers -= 1
        if not completed and not self.done:
            if not self.interrupted:
                self.interrupted = True
                self._metrics.interrupted.inc(kind=self.kind)
            if self.subscribers == 0:
                self._arm_grace()

    def _arm_grace(self, on_start: bool = False) -> None:
        if self.done:
            return
        grace = self._settings.grace_period_s if self.resumable or on_start else 0.0
        if on_start:  # the request that made it is about to read it: never cancelled before it can
            grace = max(grace, _FIRST_READER_S)
        if self._grace is not None:
            self._grace.cancel()
        self._grace = self._loop.call_later(grace, self._grace_expired)

    def _grace_expired(self) -> None:
        self._grace = None
        if self.subscribers or self.done:
            return
        if self._log is not None:
            # A client that resumed on another server reads this stream through the shared log,
            # not as a subscriber here: ask the log before ending a stream someone still reads.
            self._loop.create_task(self._grace_expired_unless_read_elsewhere())
            return
        self._cancel_after_grace()

    async def _grace_expired_unless_read_elsewhere(self) -> None:
        read_elsewhere = await self._log.remote_readers()
        if self.subscribers or self.done or self._grace is not None:
            return
        if read_elsewhere:
            self._grace = self._loop.call_later(max(self._settings.grace_period_s, 1.0), self._grace_expired)
        else:
            self._cancel_after_grace()

    def _cancel_after_grace(self) -> None:
        logger.info("stream %s: no client came back within the grace period; cancelling", self.stream_id)
        self._metrics.grace_cancelled.inc(kind=self.kind)
        self.cancel()

    # -- the pump ------------------------------------------------------------------------------

    async def _pump(self) -> None:
        try:
            async for ev in self.stream:
                if isinstance(ev, TextEvent):
                    ev, stopped = self._filter_text(ev)
                    if stopped:
                        self._append(self._server_final("content_filter"))
                        break
                    if ev is None:
                        continue
                elif isinstance(ev, ErrorEvent):
                    ev = self._safe_error(ev)
                self._append(ev)
                if ev.is_final:
                    break
        except asyncio.CancelledError:
            if not self.done:
                self._append(self._server_final(self._force_reason))
        except Exception as exc:  # noqa: BLE001 - a broken stream must not take the server down
            logger.exception("stream %s: pump failed", self.stream_id)
            if not self.done:
                self._append(self._safe_error(ErrorEvent(
                    stream_id=self.stream_id, seq=len(self.events), t=self._t(),
                    error={"type": type(exc).__name__, "message": str(exc)})))
        finally:
            self.stream.close()  # cancels the model if it is still running (content filter, force)
            if not self.done:  # pragma: no cover - defensive: every path above appends a final
                self._append(self._server_final("cancelled"))
            self._finish()

    def _filter_text(self, ev: TextEvent) -> tuple[TextEvent | None, bool]:
        """Run the content filter over the text so far (holding back its window); an event whose
        text changed loses its token ids, which no longer match it."""
        self._n_tokens += len(ev.token_ids)
        if self._filter is None:
            self._text = self._text[: ev.offset] + ev.delta  # offset < len after a rewind
            return ev, False
        cut = None
        if ev.offset < len(self._filter.raw):
            # A rewind: the filter forgets the cut text too, and the client cuts where it has text.
            cut = self._filter.rewind(ev.offset)
            self._text = self._text[:cut]
            self._pending_ids = []
        start = len(self._text)
        delta, stopped = self._filter.feed(ev.delta, final=ev.is_final)
        if stopped:
            return None, True
        self._text += delta
        if cut is not None:
            changed = {"delta": delta, "offset": start, "token_ids": [] if delta != ev.delta else ev.token_ids}
            if ev.is_final:
                changed["text"] = self._text
            return dataclasses.replace(ev, **changed), False
        if delta == ev.delta and not self._pending_ids:
            return (dataclasses.replace(ev, text=self._text) if ev.is_final and ev.text != self._text else ev), False
        # Held back or changed: the ids ride with the text only when it is exactly what the model wrote.
        ids = self._pending_ids + list(ev.token_ids)
        if not delta and not ev.is_final:
            self._pending_ids = ids if len(ids) < 4096 else []
            return None, False  # all held back: the protocol has no empty non-final deltas
        self._pending_ids = []
        changed = {"delta": delta, "token_ids": [], "index": ev.index, "offset": start}
        if ev.is_final:
            changed["text"] = self._text
        return dataclasses.replace(ev, **changed), False

    def _safe_error(self, ev: ErrorEvent) -> ErrorEvent:
        """Errors of our own kind (bad arguments) keep their message; anything else is an internal
        failure whose text may show internals: the client gets a generic message and an id."""
        kind = ev.error.get("type", "")
        if isinstance(getattr(error_types, kind, None), type):
            return ev
        logger.error("stream %s failed: %s: %s", self.stream_id, kind, ev.error.get("message"))
        return dataclasses.replace(ev, error={"type": "internal_error", "message": "the generation failed on the "
                                              f"server; the server log has the details under stream {self.stream_id}"})

    def _t(self) -> float:
        last = self.events[-1].t if self.events else 0.0
        return max(last, time.perf_counter() - self._started)

    @property
    def sent_text(self) -> str:
        """A text stream's answer as its clients got it (after the content filter and any rewind)."""
        return self._text

    @property
    def tokens_sent(self) -> int:
        """Tokens of the answer the model generated so far."""
        return self._n_tokens

    def continue_text(self, n_tokens: int, text: str) -> None:
        """A text stream continued after a restart: ``text`` (``n_tokens`` tokens) was sent
        already, after the content filter, which goes on from there."""
        self._n_tokens, self._text = n_tokens, text
        if self._filter is not None:
            self._filter.raw = self._filter.emitted = text

    def prompt_tokens(self) -> int:
        """The prompt's token count, counted only when asked (a final the server writes)."""
        if self._count_prompt_tokens is None:
            return 0
        try:
            return int(self._count_prompt_tokens())
        except Exception:  # noqa: BLE001 - a usage figure must not stop the final event
            return 0

    def _server_final(self, reason: str) -> Event:
        """The final the server writes itself: what the stream's family makes of what was sent."""
        return family(self.kind).server_final(self, reason, len(self.events), self._t())

    def _append(self, ev: Event) -> None:
        if self.handed_off and ev.is_final:
            # Handed off: the stream goes on elsewhere, so this final (a cancel's) is not its end.
            self.done = True
            self.finish_reason = "handed_off"
            self._wake()
            return
        if ev.seq != len(self.events):
            ev = dataclasses.replace(ev, seq=len(self.events))
        if self.checkpoints is not None and ev.is_final and isinstance(ev, (ImageEvent, VideoEvent)):
            # What keeping its checkpoints in the log cost (as a Ray image replica reports it).
            ev = dataclasses.replace(ev, metrics={**(ev.metrics or {}), **self.checkpoints.metrics()})
        now = time.perf_counter()
        if not self.events:
            self._metrics.ttft.observe(now - self._arrived, kind=self.kind)
        if isinstance(ev, TextEvent):
            if self._last_text_at is not None and ev.delta:
                self._inter_token.observe(now - self._last_text_at)
            self._last_text_at = now
            self.bytes += len(ev.delta) * 2 + 200
        elif isinstance(ev, ImageEvent):
            self.bytes += len(ev.data) * 2 + 300  # raw bytes + cached base64 JSON
            if not ev.is_final and ev.finish_reason is None:
                self._metrics.preview_bytes.observe(len(ev.data), kind=self.kind)
                if not self._first_preview_seen:
                    self._first_preview_seen = True
                    self._metrics.first_preview.observe(now - self._arrived, kind=self.kind)
                older = self._newest_preview.get(ev.index)
                if older is not None:
                    self._drop_preview(older)
                self._newest_preview[ev.index] = len(self.events)
            else:
                self._newest_preview.pop(ev.index, None)
        elif isinstance(ev, AudioEvent):
            self.bytes += (len(ev.data) + len(ev.audio or b"")) * 2 + 300  # raw bytes + cached base64 JSON
        else:
            self.bytes += 300
        self.events.append(ev)
        self._json.append(None)
        if self._log is not None:
            self._log.append(ev, self.json(ev.seq))
        self._events_sent.inc()
        if ev.is_final:
            self.done = True
            self.finish_reason = "error" if isinstance(ev, ErrorEvent) else (getattr(ev, "finish_reason", None) or "stop")
            if isinstance(ev, TextEvent) and ev.metrics and ev.metrics.get("repetition_loops"):
                self._metrics.repetition_loops.inc(kind=self.kind)
            if isinstance(ev, TextEvent) and ev.metrics and ev.metrics.get("drafted_tokens"):
                self._metrics.drafted_tokens.inc(ev.metrics["drafted_tokens"], kind=self.kind)
                self._metrics.accepted_tokens.inc(ev.metrics.get("accepted_tokens") or 0.0, kind=self.kind)
            if isinstance(ev, TextEvent) and ev.metrics and ev.metrics.get("cached_prompt_tokens"):
                self._metrics.prefix_cache_hit_tokens.inc(ev.metrics["cached_prompt_tokens"], kind=self.kind)
        self._wake()

    def _drop_preview(self, seq: int) -> None:
        old = self.events[seq]
        if isinstance(old, ImageEvent):
            self.events[seq] = None
            self._json[seq] = None
            self.bytes -= len(old.data) * 2 + 300
            self._metrics.dropped_frames.inc(kind=self.kind)

    def _wake(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():  # a subscriber cancelled while it waited
                    waiter.set_result(None)

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        for handle in (self._grace, self._force, self._deadline):
            if handle is not None:
                handle.cancel()
        self._grace = self._force = None
        self._metrics.finished.inc(kind=self.kind, finish_reason=self.finish_reason or "unknown")
        for callback in (self._on_done, *self._done_callbacks):
            try:
                callback(self)
            except Exception:  # noqa: BLE001
                logger.exception("stream %s: on_done callback failed", self.stream_id)


class Registry:
    """All streams the server knows: live ones, and finished ones within the retention window."""

    def __init__(self, settings: ServerSettings, metrics: Metrics, log: Any = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.log = log  # a shared event log (`RedisEventLog`), or None: memory only
        self.remote: OrderedDict[str, Any] = OrderedDict()  # streams read from the log (`RemoteRecord`)
        self.live: dict[str, StreamRecord] = {}
        self.finished: OrderedDict[str, StreamRecord] = OrderedDict()
        self.retained_bytes = 0
        self._done_callbacks: dict[str, Callable[[StreamRecord], None]] = {}
        self._last_activity = time.monotonic()  # a stream started or ended (`idle_for`)

    def start(self, stream: Stream, *, kind: str, on_done: Callable[[StreamRecord], None] | None = None,
              **options: Any) -> StreamRecord:
        """Register a model stream and start pumping it. ``options`` go to `StreamRecord`."""
        def done(record: StreamRecord) -> None:
            self._finished(record)
            if on_done is not None:
                on_done(record)

        record = StreamRecord(stream, kind=kind, settings=self.settings, metrics=self.metrics, on_done=done, **options)
        if self.log is not None and record.resumable:
            record._log = self.log.writer(record)  # before the pump's first event
        self.live[record.stream_id] = record
        self._last_activity = time.monotonic()
        return record

    def idle_for(self, seconds: float) -> bool:
        """No stream runs, and none started or ended in the last ``seconds`` (safe from any thread:
        a heuristic for background work, such as building the demo page, that should not slow clients)."""
        return not self.live and time.monotonic() - self._last_activity >= seconds

    async def check_log(self) -> None:
        """With a shared event log: raise a 503 `Problem` when it is down (before admitting a stream)."""
        if self.log is not None:
            await self.log.check()

    async def fetch(self, stream_id: str) -> Any:
        """`get`, falling back to the shared event log for a stream another process runs (or ran)."""
        record = self.get(stream_id)
        if record is not None and self.log is not None and getattr(record, "remote", False) and not record.done:
            await self.log.refresh(record)  # read while it ran on: what it held then is stale now
            return record
        if record is not None or self.log is None:
            return record
        remote = await self.log.load(stream_id)
        if remote is not None:
            self.remote[stream_id] = remote
            self.remote.move_to_end(stream_id)
            while len(self.remote) > 256:
                self.remote.popitem(last=False)
        return remote

    def cancel_remote_request(self, stream_id: str) -> None:
        """A cancel published by another process: cancel the stream if it runs here."""
        record = self.live.get(stream_id)
        if record is not None:
            record.cancel()

    def live_bytes(self) -> int:
        return sum(r.bytes for r in self.live.values())

    def get(self, stream_id: str) -> StreamRecord | None:
        self.evict()
        return self.live.get(stream_id) or self.finished.get(stream_id) or self.remote.get(stream_id)

    def active(self, kind: str | None = None) -> int:
        return sum(1 for r in self.live.values() if kind is None or r.kind == kind)

    def cancel_all(self, reason: str = "cancelled") -> None:
        for record in list(self.live.values()):
            record.cancel(reason)

    def end_all_now(self, reason: str = "cancelled") -> int:
        """`StreamRecord.end_now` for every live stream; how many there were."""
        records = list(self.live.values())
        for record in records:
            record.end_now(reason)
        return len(records)

    def drop_connections(self) -> int:
        for record in self.live.values():
            record.drop_subscribers()
        return len(self.live)

    def _finished(self, record: StreamRecord) -> None:
        self.live.pop(record.stream_id, None)
        self._last_activity = time.monotonic()
        if record.resumable and not record.handed_off:  # a handed-off one is read from the log
            self.finished[record.stream_id] = record
            self.retained_bytes += record.bytes
        self.evict()

    def evict(self) -> None:
        """Drop finished streams past the retention window or beyond the count/byte bounds."""
        s = self.settings
        now = time.monotonic()
        live: int | None = None  # summed over the live streams at most once a call (a call per request)
        while self.finished:
            oldest = next(iter(self.finished.values()))
            expired = oldest.finished_at is not None and now - oldest.finished_at > s.retention_s
            if not (expired or len(self.finished) > s.max_retained_streams):
                live = self.live_bytes() if live is None else live
                if self.retained_bytes + live <= s.max_retained_bytes:
                    break
            self.finished.popitem(last=False)
            self.retained_bytes -= oldest.bytes
