"""The Stream object: one producer thread runs the model; sync or async consumers read events.

Adapters do not build events themselves. They get a `StreamWriter` and call ``writer.text(...)``
(deltas) or the generic ``writer.emit(EventClass, **fields)`` (``finish_text``, ``image`` and
``finish_audio`` are short forms of it); the stream assigns ``seq`` when the consumer
takes an event, so merging under backpressure never leaves a gap in the sequence.

Backpressure: the model never waits for the consumer. Undelivered text deltas merge into one
(nothing is lost); an undelivered preview frame is replaced by the newer one for the same image or clip;
the final event is never dropped. So the buffer stays small however slow the consumer is.

Example:
    >>> from multistream.stream import Stream
    >>> def producer(w):
    ...     w.text("Hello", [1], 0)
    ...     w.finish_text("", [], 1, finish_reason="stop", text="Hello",
    ...                   usage={"prompt_tokens": 1, "completion_tokens": 1}, metrics={})
    >>> [ev.delta for ev in Stream(producer)]
    ['Hello', '']
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .errors import StreamConsumedError
from .events import AudioEvent, ErrorEvent, Event, ImageEvent, TextEvent, VideoEvent

__all__ = ["MergeKey", "Stream", "StreamWriter"]

logger = logging.getLogger("multistream")

_NEW, _ITERATING, _DONE, _CLOSED = "new", "iterating", "done", "closed"

# A stream id handed out before the model's `.stream()` runs (a server tells a queued client its
# stream's id before the model is called): the next `Stream` made in this context takes it.
_RESERVED_ID: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("multistream_reserved_id",
                                                                                default=None)


@contextlib.contextmanager
def reserved_stream_id(stream_id: str) -> Iterator[None]:
    """The first `Stream` created inside the block (in this thread or task) gets ``stream_id``.

    Example:
        >>> with reserved_stream_id("abc"):
        ...     s = Stream(lambda w: None)
        >>> s.stream_id
        'abc'
    """
    token = _RESERVED_ID.set([stream_id])
    try:
        yield
    finally:
        _RESERVED_ID.reset(token)


@dataclasses.dataclass(frozen=True)
class MergeKey:
    """How an undelivered event may be folded under backpressure: ``kind`` ``"text"`` (deltas merge
    into one, nothing is lost) or ``"preview"`` (a newer preview of the same ``family`` and
    ``index`` replaces it). Events without a key (finals, audio chunks) are always kept.

    Example:
        >>> MergeKey.preview("video", 0) == MergeKey("preview", "video", 0)
        True
    """

    kind: str
    family: str = ""
    index: int = 0

    @classmethod
    def preview(cls, family: str, index: int = 0) -> MergeKey:
        return cls("preview", family, index)

    @property
    def is_preview(self) -> bool:
        return self.kind == "preview"


TEXT_KEY = MergeKey("text")

# The preview family of each event class whose non-final events are previews (`_merge_key`); a
# new family with previews adds one entry here, not a method.
_PREVIEW_TYPES = {ImageEvent: "image", VideoEvent: "video"}


class _Pending:
    """An event waiting for its consumer; ``seq`` is given when it is taken."""

    __slots__ = ("cls", "fields", "merge_key")

    def __init__(self, cls: type, fields: dict[str, Any], merge_key: MergeKey | None) -> None:
        self.cls = cls
        self.fields = fields
        self.merge_key = merge_key


class _Channel:
    """The thread-safe buffer between the producer thread and the consumer.

    Kept apart from `Stream` so the producer thread holds no reference to the Stream: when the
    user drops the Stream, garbage collection finalizes it and cancels the model.
    """

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.started_at = time.perf_counter()
        self.cancel_requested = threading.Event()
        self.finish_early_requested = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[_Pending] = deque()
        self._final_put = False
        self._next_seq = 0
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._cancel_callbacks: list[Callable[[], Any]] = []
        self.final_queued = threading.Event()
        self.exception: BaseException | None = None  # what ended the stream with an error event
        self.text_length = 0  # characters of answer so far (after edits); offsets come from it
        self.revision = 0
        self.command_handler: Callable[[str, tuple[Any, ...], dict[str, Any]], Any] | None = None

    # -- cancellation --------------------------------------------------------------------------

    def request_cancel(self) -> None:
        """Set the cancel flag (the producer checks it each step) and run the cancel callbacks once."""
        with self._cond:
            if self.cancel_requested.is_set():
                return
            self.cancel_requested.set()
            callbacks, self._cancel_callbacks = self._cancel_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one failing callback must not block the others
                logger.exception("a cancel callback of stream %s failed", self.stream_id)

    def request_finish_early(self) -> None:
        """Set the finish-early flag; the producer checks it each step, as it does the cancel flag."""
        self.finish_early_requested.set()

    def add_cancel_callback(self, callback: Callable[[], Any]) -> None:
        with self._cond:
            if not self.cancel_requested.is_set():
                self._cancel_callbacks.append(callback)
                return
        callback()  # already cancelled: run it now

    # -- producer side -------------------------------------------------------------------------

    def put(self, cls: type, fields: dict[str, Any], merge_key: MergeKey | None = None) -> bool:
        """Queue an event; returns False (and drops it) if the final event was already queued."""
        fields["t"] = time.perf_counter() - self.started_at
        with self._cond:
            if self._final_put:
                return False
            if cls is TextEvent:
                # Offsets are the stream's business: a producer says "replace from here" only
                # after a rewind (by passing offset); otherwise the delta appends.
                fields.setdefault("offset", self.text_length)
                fields.setdefault("revision", self.revision)
                self.text_length = fields["offset"] + len(fields["delta"])
                # Without beams everything sent is settled; a beam search says how much is.
                fields.setdefault("committed", self.text_length)
            text_target = self._undelivered_text() if merge_key == TEXT_KEY else None
            if text_target is not None:
                _merge_into(text_target, fields)
                # The merged delta now carries the newest time; moving it behind any preview it
                # overtook keeps `t` non-decreasing in delivery order (previews are replaceable,
                # so their relative order to text carries no meaning).
                if self._pending[-1] is not text_target:
                    self._pending.remove(text_target)
                    self._pending.append(text_target)
            elif merge_key is not None and merge_key.is_preview:
                # Only the newest preview of each image (or clip) is worth showing to a slow consumer.
                stale = next((p for p in self._pending if p.merge_key == merge_key), None)
                if stale is not None:
                    self._pending.remove(stale)
                self._pending.append(_Pending(cls, fields, merge_key))
            else:
                self._pending.append(_Pending(cls, fields, merge_key))
            if fields.get("is_final"):
                self._final_put = True
                self.final_queued.set()
            waiters, self._async_waiters = self._async_waiters, []
            self._cond.notify_all()
        for loop, fut in waiters:
            _LoopWaker.of(loop).wake(fut)
        return True

    def _undelivered_text(self) -> _Pending | None:
        """The newest undelivered text delta, looking back past previews only (which are replaced,
        not kept, so in a text+image stream the buffer stays at one text item and one preview)."""
        for item in reversed(self._pending):
            if item.merge_key == TEXT_KEY:
                return item
            if item.merge_key is None or not item.merge_key.is_preview:
                return None
        return None

    @property
    def final_put(self) -> bool:
        return self._final_put

    # -- consumer side -------------------------------------------------------------------------

    def _pop(self) -> Event:
        item = self._pending.popleft()
        seq = self._next_seq
        self._next_seq += 1
        return item.cls(stream_id=self.stream_id, seq=seq, **item.fields)  # type: ignore[no-any-return]

    def take(self, timeout: float | None = None) -> Event | None:
        """Block until an event is ready (or the timeout passes: then None)."""
        with self._cond:
            if not self._pending and not self._cond.wait_for(lambda: bool(self._pending), timeout):
                return None
            return self._pop()

    def take_or_register(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> Event | None:
        """Take an event if one is ready, else register ``fut`` to be woken by the next put."""
        with self._cond:
            if self._pending:
                return self._pop()
            self._async_waiters.append((loop, fut))
            return None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _LoopWaker:
    """Wakes a loop's waiting consumers from producer threads with one cross-thread call per
    batch: an engine step that emits an event on every row of a batch writes the loop's wake-up
    pipe once, not once per row (each write is a syscall that also hands the GIL around)."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._futures: list[asyncio.Future[None]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopWaker:
        waker = cls._by_loop.get(loop)
        if waker is None:
            with cls._registry_lock:
                waker = cls._by_loop.get(loop)
                if waker is None:
                    waker = cls._by_loop[loop] = cls(loop)
        return waker

    def wake(self, fut: asyncio.Future[None]) -> None:
        with self._lock:
            self._futures.append(fut)
            if len(self._futures) > 1:
                return  # a drain is already scheduled and has not run yet: it takes this one too
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the consumer's loop is closed; nobody is waiting any more
            with self._lock:
                self._futures.clear()

    def _drain(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for fut in futures:
            _wake(fut)


def _merge_into(last: _Pending, new: dict[str, Any]) -> None:
    """Fold a newer text delta into an undelivered one.

    Appends concatenate (deltas and token ids). A newer delta that replaces from an earlier
    offset (a rewind) cuts the undelivered one there, or replaces it whole if it starts before it.
    """
    old = last.fields
    end = old["offset"] + len(old["delta"])
    if new["offset"] == end:
        old["delta"] += new["delta"]
        old["token_ids"] = list(old["token_ids"]) + list(new["token_ids"])
        if "logprobs" in old or "logprobs" in new:  # one entry per token id, so they merge alike
            old["logprobs"] = list(old.get("logprobs") or []) + list(new.get("logprobs") or [])
    elif new["offset"] >= old["offset"]:
        old["delta"] = old["delta"][: new["offset"] - old["offset"]] + new["delta"]
        old["token_ids"] = list(new["token_ids"])  # ids no longer line up with a cut delta
        old["index"] = new["index"]
        _replace_logprobs(old, new)
    else:
        old.update(delta=new["delta"], token_ids=list(new["token_ids"]), offset=new["offset"], index=new["index"])
        _replace_logprobs(old, new)
    old["revision"] = new["revision"]
    old["committed"] = max(old.get("committed", 0), new.get("committed", 0))
    old["t"] = new["t"]


def _replace_logprobs(old: dict[str, Any], new: dict[str, Any]) -> None:
    if "logprobs" in new:
        old["logprobs"] = list(new["logprobs"])
    else:
        old.pop("logprobs", None)


class StreamWriter:
    """The producer's handle: what adapters call to emit events. Thread-safe.

    Example (inside an adapter's producer function):
        >>> def producer(writer: StreamWriter) -> None:
        ...     for i, piece in enumerate(["a", "b"]):
        ...         if writer.cancelled:
        ...             break
        ...         writer.text(piece, [i], i)
    """

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel

    @property
    def stream_id(self) -> str:
        return self._channel.stream_id

    @property
    def cancelled(self) -> bool:
        """True once the consumer asked to stop; check it every model step."""
        return self._channel.cancel_requested.is_set()

    @property
    def finish_early_requested(self) -> bool:
        """True once the consumer asked to stop now and keep the result (`Stream.finish_early`)."""
        return self._channel.finish_early_requested.is_set()

    @property
    def finished(self) -> bool:
        """True once the final event was queued; later events are dropped."""
        return self._channel.final_put

    def on_cancel(self, callback: Callable[[], Any]) -> None:
        """Run ``callback()`` as soon as the consumer cancels (at once if it already has).

        For producers that block on something other than a model step (e.g. reading sub-streams),
        so they can pass the cancel on without polling ``cancelled``.
        """
        self._channel.add_cancel_callback(callback)

    def elapsed(self) -> float:
        """Seconds since the stream started (the clock of every event's ``t``)."""
        return time.perf_counter() - self._channel.started_at

    def text(self, delta: str, token_ids: list[int], index: int, *, offset: int | None = None,
             logprobs: list[dict[str, Any]] | None = None, committed: int | None = None) -> None:
        """Emit new text. Merges with an undelivered delta if the consumer is behind.

        ``offset`` (default: the end of the text so far) says where ``delta`` begins; a smaller
        one replaces the text from there (after a rewind, or a beam search's better hypothesis).
        ``logprobs``: one entry per token id. ``committed`` (default: the text's length after this
        event) is how many characters can no longer change.
        """
        fields: dict[str, Any] = {"delta": delta, "token_ids": list(token_ids), "index": index}
        if logprobs is not None:
            fields["logprobs"] = list(logprobs)
        if committed is not None:
            fields["committed"] = committed
        if offset is not None:
            fields["offset"] = offset
        elif not delta:
            return  # the protocol promises no empty non-final deltas
        self._channel.put(TextEvent, fields, TEXT_KEY)

    @property
    def text_length(self) -> int:
        """Characters of answer sent so far (after edits)."""
        return self._channel.text_length

    def continue_text(self, length: int) -> None:
        """The answer already has ``length`` characters (sent by an earlier run of the same
        generation, e.g. before a failover): later deltas append after them."""
        self._channel.text_length = length

    def new_revision(self) -> int:
        """Start the next revision (a steer or a rewind); later text events carry it."""
        self._channel.revision += 1
        return self._channel.revision

    def on_command(self, handler: Callable[[str, tuple[Any, ...], dict[str, Any]], Any]) -> None:
        """Accept edits (``steer``, ``rewind``) from the consumer: ``handler(name, args, kwargs)``
        runs on the caller's thread, checks them (raising `MultistreamError` for bad input) and
        queues them for the model's next step."""
        self._channel.command_handler = handler

    def finish_text(
        self,
        delta: str,
        token_ids: list[int],
        index: int,
        *,
        finish_reason: str,
        text: str,
        usage: dict[str, int],
        metrics: dict[str, float],
        revisions: list[dict[str, Any]] | None = None,
        offset: int | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> None:
        """Emit the final text event (once; it is never dropped or merged)."""
        fields: dict[str, Any] = {
            "delta": delta,
            "token_ids": list(token_ids),
            "index": index,
            "is_final": True,
            "finish_reason": finish_reason,
            "text": text,
            "usage": dict(usage),
            "metrics": dict(metrics),
        }
        if revisions:
            fields["revisions"] = [dict(r) for r in revisions]
        if offset is not None:
            fields["offset"] = offset
        if logprobs is not None:
            fields["logprobs"] = list(logprobs)
        if tool_calls is not None:
            fields["tool_calls"] = [dict(c) for c in tool_calls]
        self.emit(TextEvent, **fields)

    def image(
        self,
        *,
        step: int,
        total_steps: int,
        width: int,
        height: int,
        mime: str,
        data: bytes,
        index: int = 0,
        is_final: bool = False,
        finish_reason: str | None = None,
        metrics: dict[str, float] | None = None,
        eta_s: float | None = None,
    ) -> None:
        """Emit a preview frame, or a finished image (``finish_reason`` set; ``is_final`` for the last).

        An undelivered preview of the same ``index`` is replaced; finished images are never dropped.
        ``eta_s``: the estimated seconds left (None: unknown).
        """
        fields: dict[str, Any] = {
            "step": step,
            "total_steps": total_steps,
            "width": width,
            "height": height,
            "mime": mime,
            "data": data,
            "index": index,
            "eta_s": eta_s,
        }
        if is_final or finish_reason is not None:
            # A finished image (the stream's last, or one of a batch) is never merged or dropped.
            fields.update(is_final=is_final, finish_reason=finish_reason or "stop", metrics=dict(metrics or {}))
        self.emit(ImageEvent, **fields)

    def audio(self, *, data: bytes, sample_rate: int, sample_offset: int, num_samples: int,
              text_span: tuple[int, int], mime: str) -> None:
        """Emit a chunk of speech. Chunks are never merged or dropped (each is audio to play)."""
        self.emit(AudioEvent, data=data, sample_rate=sample_rate, sample_offset=sample_offset, num_samples=num_samples,
                  text_span=tuple(text_span), mime=mime)

    def finish_audio(self, *, sample_rate: int, sample_offset: int, text_span: tuple[int, int], mime: str,
                     audio: bytes, duration_s: float, finish_reason: str, usage: dict[str, Any],
                     metrics: dict[str, float], text: str | None = None) -> None:
        """Emit the final audio event: no samples of its own, the whole utterance as ``audio`` (WAV),
        and ``text``, the input as it was spoken."""
        self.emit(AudioEvent, data=b"", sample_rate=sample_rate, sample_offset=sample_offset, num_samples=0,
                  text_span=tuple(text_span), mime=mime, is_final=True, audio=audio, duration_s=duration_s,
                  finish_reason=finish_reason, usage=dict(usage), metrics=dict(metrics), text=text)

    def forward(self, ev: Event, *, is_final: bool | None = None) -> None:
        """Re-emit an event from another stream as part of this one (for composed streams).

        ``stream_id``, ``seq`` and ``t`` become this stream's; ``is_final`` can be overridden, so a
        sub-stream's final event can become an ordinary event of the composed stream.
        """
        fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name not in ("stream_id", "seq", "t")}
        if isinstance(ev, TextEvent):
            # Offsets and revisions are this stream's own: a forwarded delta appends here.
            fields.pop("offset", None)
            fields.pop("revision", None)
            fields.pop("committed", None)
        if is_final is not None:
            fields["is_final"] = is_final
        self._channel.put(type(ev), fields, _merge_key(type(ev), fields))

    def emit(self, cls: type[Event], **fields: Any) -> None:
        """Emit an event of any type: ``cls`` (an event class of `multistream.events`) with ``fields``
        (all but ``stream_id``, ``seq`` and ``t``, which the stream sets).

        A family needs no method of its own here. Under backpressure a non-final text delta merges
        with an undelivered one; a non-final image or video event (a preview: no ``finish_reason``)
        replaces the undelivered preview of the same ``index``; anything else, finals included, is
        never dropped.

        Example:
            >>> from multistream.events import VideoEvent
            >>> def producer(w):
            ...     w.emit(VideoEvent, step=1, total_steps=1, num_frames=1, fps=8.0, width=1, height=1,
            ...            mime="video/webm", data=b"", is_final=True, finish_reason="stop", metrics={})
            >>> [ev.finish_reason for ev in Stream(producer)]
            ['stop']
        """
        self._channel.put(cls, dict(fields), _merge_key(cls, fields))

    def fail(self, exc: BaseException) -> None:
        """End the stream with an ``error`` event describing ``exc`` (kept as ``stream.exception``)."""
        if self._channel.final_put:
            return
        self._channel.exception = exc
        message = str(exc) or repr(exc)
        self._channel.put(ErrorEvent, {"is_final": True, "error": {"type": type(exc).__name__, "message": message}})


def _merge_key(cls: type, fields: dict[str, Any]) -> MergeKey | None:
    """The backpressure key of an event about to be queued (see `MergeKey`); None: keep it."""
    if fields.get("is_final") or fields.get("finish_reason") is not None:
        return None
    if cls is TextEvent:
        return TEXT_KEY
    family = _PREVIEW_TYPES.get(cls)
    return MergeKey.preview(family, int(fields.get("index", 0))) if family is not None else None


class Stream:
    """A live stream of events from one generation; iterate it with ``for`` or ``async for``.

    The model starts at once (on its engine, or in a producer thread). A stream is its own
    iterator (``iter(s) is s``), like a file: ``next(s)`` and a later ``for ev in s`` continue the
    same events, which are read once. ``cancel()`` stops the model within one step and the stream
    ends with ``finish_reason="cancelled"``; ``close()``, leaving a ``with llm.stream(...) as s:``
    block, or dropping the stream (a ``for`` loop left early over a stream nothing else holds)
    also stop it. An exception in the model ends the stream with an ``error`` event (and is kept in
    ``stream.exception``).

    Example:
        >>> import multistream as ms
        >>> llm = ms.load_text_model()                                  # doctest: +SKIP
        >>> for ev in llm.stream("Write a haiku", max_new_tokens=32):   # doctest: +SKIP
        ...     print(ev.delta, end="", flush=True)
        >>> with llm.stream("Write a long story") as s:                 # doctest: +SKIP
        ...     first = next(s)                  # the rest is cancelled when the block ends
    """

    def __init__(
        self,
        producer: Callable[[StreamWriter], None] | None = None,
        *,
        kind: str = "text",
        stream_id: str | None = None,
        name: str | None = None,
        submit: Callable[[StreamWriter], None] | None = None,
    ) -> None:
        if (producer is None) == (submit is None):
            raise TypeError("Stream needs exactly one of producer= (runs in its own thread) or submit= (an engine)")
        reserved = _RESERVED_ID.get() if stream_id is None else None
        self.stream_id = stream_id or (reserved.pop() if reserved else uuid.uuid4().hex)
        self.kind = kind
        self.final: Event | None = None
        self.exception: BaseException | None = None
        self._channel = _Channel(self.stream_id)
        self._state = _NEW
        self._state_lock = threading.Lock()
        self._taking = False  # a consumer is inside __next__/__anext__
        self._thread: threading.Thread | None = None
        writer = StreamWriter(self._channel)
        if submit is not None:
            # A model engine runs the generation on its own thread; nothing to start here.
            submit(writer)
            return
        self._thread = threading.Thread(
            target=run_producer,
            args=(producer, writer),
            name=name or f"multistream-{kind}-{self.stream_id[:8]}",
            daemon=True,
        )
        self._thread.start()

    # -- control -------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Ask the model to stop; it does so within one step. The stream then ends with a final
        event whose ``finish_reason`` is ``"cancelled"`` (unless it had already finished)."""
        self._channel.request_cancel()

    @property
    def cancelled(self) -> bool:
        return self._channel.cancel_requested.is_set()

    def close(self) -> None:
        """Cancel the model if it is still running and mark the stream as no longer iterable."""
        with self._state_lock:
            if self._state != _DONE:
                self._state = _CLOSED
        if not self._channel.final_put:
            self.cancel()

    def finish_early(self) -> None:
        """Stop now and keep what there is: a chosen end, not an abort.

        An image stream stops denoising at the next step and its final event is the current
        estimate of the clean image through the full VAE; a text stream ends at once. Either way
        the final event has ``finish_reason="finished_early"``. No effect once the stream ended.

        Example:
            >>> s = sd.stream("a red circle on a blue background", steps=40)   # doctest: +SKIP
            >>> for ev in s:                                                   # doctest: +SKIP
            ...     if ev.step == 10:
            ...         s.finish_early()          # keep this picture, full quality
        """
        self._channel.request_finish_early()

    def steer(self, instruction: str | None = None, **changes: Any) -> None:
        """Change the generation while it runs; takes effect at the model's next step.

        Text: ``steer("make it shorter")`` inserts a new instruction and the answer goes on in
        that direction (what was written stays). Image: ``steer(prompt=..., negative_prompt=...,
        guidance_scale=...)`` conditions the following denoising steps on the new values.
        Raises `MultistreamError` at once for a finished stream or bad input.

        Example:
            >>> s = llm.stream("Write a long story about a fox")   # doctest: +SKIP
            >>> s.steer("make it about a cat instead")             # doctest: +SKIP
        """
        self._command("steer", (instruction,) if instruction is not None else (), changes)

    def rewind(self, offset: int, instruction: str | None = None, *, token_id: int | None = None,
               **options: Any) -> None:
        """Text: drop the answer from character ``offset`` on (snapped back to a token boundary)
        and regenerate from there, optionally under a new ``instruction`` and sampling options.
        ``token_id``: the first regenerated token, e.g. an alternative from an event's
        ``logprobs`` (a branch; greedy, the rest equals greedy decoding after it).

        Example:
            >>> s.rewind(120, instruction="less formal")   # doctest: +SKIP
            >>> s.rewind(ev.offset, token_id=ev.logprobs[0]["top_logprobs"][1]["token_id"])  # doctest: +SKIP
        """
        if token_id is not None:
            options["token_id"] = token_id
        self._command("rewind", (offset,), {"instruction": instruction, **options})

    def _command(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from .errors import InvalidArgumentError, StreamFinishedError

        if self._channel.final_put or self._channel.cancel_requested.is_set():
            raise StreamFinishedError(
                f"stream {self.stream_id} has already ended (or was cancelled), so it cannot {name}; "
                + ("use model.revise(final_event, offset) to regenerate part of a finished answer"
                   if self.kind == "text" else "start a new stream")
            )
        handler = self._channel.command_handler
        if handler is None:
            raise InvalidArgumentError(f"this {self.kind} stream does not support {name}()")
        handler(name, args, kwargs)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the model is done with this stream; True if it was within ``timeout``."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return self._channel.final_queued.wait(timeout)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self) -> None:
        """`close`, for async code (``contextlib.aclosing``, ``async with``)."""
        self.close()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._channel.final_put:
                self._channel.request_cancel()
        except AttributeError:  # __init__ failed half-way
            pass

    # -- consumption ---------------------------------------------------------------------------

    def _check_iterable(self) -> None:
        """``iter(stream)``: fine while the stream has events left; a clear error once it has none."""
        with self._state_lock:
            state = self._state
        if state == _DONE:
            raise StreamConsumedError(
                f"stream {self.stream_id} was already consumed to its final event; a stream can be "
                "iterated once. Keep the events as you read them, or use stream.final for the last one, "
                "or start a new stream."
            )
        if state == _CLOSED:
            raise StreamConsumedError(
                f"stream {self.stream_id} was closed (close()/cancel() ran, or a `with` block was left) "
                "before its end; start a new stream to generate again."
            )

    def _begin_take(self) -> bool:
        """Mark one consumer as taking the next event; False when the stream has no events left."""
        with self._state_lock:
            if self._state in (_DONE, _CLOSED):
                return False
            if self._taking:
                raise StreamConsumedError(
                    f"stream {self.stream_id} is already being iterated (by another thread or async task); "
                    "a stream has one consumer. Fan out the events yourself (e.g. keep a list) if several "
                    "places need them."
                )
            self._taking = True
            self._state = _ITERATING
            return True

    def _end_take(self, ev: Event | None) -> None:
        if ev is not None and ev.is_final:
            self.final = ev
            self.exception = self._channel.exception
        with self._state_lock:
            self._taking = False
            if ev is not None and ev.is_final:
                self._state = _DONE

    def __iter__(self) -> Stream:
        """A stream is its own iterator, as files and generators are: ``next(iter(s))`` and then
        ``for ev in s`` read one stream, in order, once."""
        self._check_iterable()
        return self

    def __next__(self) -> Event:
        if not self._begin_take():
            raise StopIteration
        ev = None
        try:
            ev = self._channel.take()
            assert ev is not None
            if ev.is_final:
                # The producer returns right after queuing the final event; waiting for that
                # keeps a script that exits after its loop from killing a thread mid-cleanup.
                self.join(timeout=2.0)
            return ev
        finally:
            self._end_take(ev)

    def __aiter__(self) -> Stream:
        self._check_iterable()
        return self

    async def __anext__(self) -> Event:
        if not self._begin_take():
            raise StopAsyncIteration
        loop = asyncio.get_running_loop()
        ev = None
        try:
            while ev is None:
                fut: asyncio.Future[None] = loop.create_future()
                ev = self._channel.take_or_register(loop, fut)
                if ev is None:
                    await fut
            return ev
        finally:
            self._end_take(ev)

    def wait(self, on_event: Callable[[Event], Any] | None = None) -> Event:
        """Consume the whole stream, calling ``on_event`` for each event; return the final event.

        Example:
            >>> final = llm.stream("hi").wait(on_event=print)   # doctest: +SKIP
        """
        for ev in self:
            if on_event is not None:
                on_event(ev)
        assert self.final is not None
        return self.final

    async def await_final(self, on_event: Callable[[Event], Any] | None = None) -> Event:
        """The async twin of `wait`."""
        async for ev in self:
            if on_event is not None:
                on_event(ev)
        assert self.final is not None
        return self.final

    def __repr__(self) -> str:
        return f"<Stream {self.kind} id={self.stream_id} state={self._state}>"


def run_producer(producer: Callable[[StreamWriter], None], writer: StreamWriter) -> None:
    """The producer thread: run the model; turn any exception into the stream's error event."""
    try:
        producer(writer)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
        producer_ended(writer, exc)
    else:
        producer_ended(writer)


def producer_ended(writer: StreamWriter, exc: BaseException | None = None) -> None:
    """A producer stopped: its exception becomes the stream's error event, and so does ending
    without a final event (a bug in the adapter). For schedulers that run producers themselves
    (`multistream.testing`'s one-thread clock) as well as `run_producer`."""
    if exc is not None:
        logger.error("stream %s failed", writer.stream_id, exc_info=exc)
        writer.fail(exc)
    elif not writer.finished:
        writer.fail(RuntimeError("the model ended without a final event (a bug in the adapter)"))
