"""Composed streams: run streams one after another (`chain`) or side by side (`merge`) as ONE stream.

A composed stream is an ordinary `Stream`: its own ``stream_id``, a gap-free ``seq``, and exactly
one final event, the last one. The sub-streams' final events become ordinary (non-final) events
of the composed stream, so a consumer still sees each part's ``finish_reason``, ``text``,
``usage`` and ``metrics``. Cancelling the composed stream cancels the running sub-streams; an
error in a sub-stream ends the composed stream with that error.

Example (an LLM writes an image prompt, then the image model draws it; one stream):
    >>> import multistream as ms
    >>> llm, sd = ms.load_text_model(), ms.load_image_model()          # doctest: +SKIP
    >>> s = ms.chain(llm.stream("Describe a sunset in 8 words", max_new_tokens=16),
    ...              lambda final: sd.stream(final.text, steps=20))     # doctest: +SKIP
    >>> for ev in s:                                                    # doctest: +SKIP
    ...     print(ev.type, ev.seq, ev.is_final)
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Union

from .errors import InvalidArgumentError
from .events import AudioEvent, ErrorEvent, Event, ImageEvent, TextEvent, VideoEvent
from .stream import Stream, StreamWriter

__all__ = ["chain", "merge"]

StreamSource = Union[Stream, Callable[[], Stream]]
"""A stream, or a zero-argument callable that starts one (so it starts only when its turn comes)."""

class _CancelRelay:
    """Passes a cancel of the composed stream on to the sub-streams that are running.

    The producer thread blocks while it reads a sub-stream, so it cannot look at
    ``writer.cancelled`` itself; the writer's cancel callback does the passing on.
    """

    def __init__(self, writer: StreamWriter) -> None:
        self._writer = writer
        self._subs: list[Stream] = []
        self._lock = threading.Lock()
        writer.on_cancel(self.cancel_all)

    def add(self, stream: Stream) -> None:
        with self._lock:
            self._subs.append(stream)
        if self._writer.cancelled:  # cancelled while the sub-stream was being started
            stream.cancel()

    def cancel_all(self) -> None:
        with self._lock:
            subs = list(self._subs)
        for s in subs:
            s.cancel()


def _start(source: StreamSource, what: str) -> Stream:
    stream = source() if callable(source) and not isinstance(source, Stream) else source
    if not isinstance(stream, Stream):
        raise InvalidArgumentError(
            f"{what} must be a multistream Stream or a callable returning one, got {type(stream).__name__}; "
            "pass e.g. model.stream(...) or lambda: model.stream(...)"
        )
    return stream


def _as_cancelled(ev: Event) -> Event:
    """The event re-labelled as cancelled (for a part that finished just as the user cancelled)."""
    if isinstance(ev, (TextEvent, ImageEvent, AudioEvent, VideoEvent)) and ev.finish_reason not in (None, "cancelled"):
        return dataclasses.replace(ev, finish_reason="cancelled")
    return ev


def chain(first: StreamSource, *then: Callable[[Event], Stream | None]) -> Stream:
    """Run streams one after another as one stream; each next one is built from the previous final.

    ``first`` is a stream (or a callable starting one). Each function in ``then`` receives the
    previous part's final event (e.g. the LLM's final `TextEvent`, whose ``.text`` is the whole
    output) and returns the next stream, or ``None`` to end there. The composed stream's final
    event is the last part's final event (for text, its ``text`` is all text of the chain, so the
    deltas still add up to it); earlier finals arrive as non-final events. A part that
    fails or is cancelled ends the whole chain (its final becomes the chain's final).

    Example:
        >>> s = ms.chain(lambda: llm.stream("Name a color", max_new_tokens=4),
        ...              lambda final: sd.stream(f"a {final.text.strip()} circle"))  # doctest: +SKIP
        >>> ms.show(s)                                                               # doctest: +SKIP
    """
    if not (isinstance(first, Stream) or callable(first)):
        raise InvalidArgumentError(
            f"chain() needs a Stream or a callable returning one as its first argument, got {type(first).__name__}"
        )
    for i, fn in enumerate(then):
        if not callable(fn):
            raise InvalidArgumentError(
                f"chain() argument {i + 2} must be a callable taking the previous final event and returning "
                f"a Stream (or None), got {type(fn).__name__}; e.g. lambda final: model.stream(final.text)"
            )
    kinds: list[str] = [first.kind] if isinstance(first, Stream) else []

    def producer(writer: StreamWriter) -> None:
        relay = _CancelRelay(writer)
        streamed: list[str] = []  # every text delta sent so far, across parts

        def send(ev: Event, is_final: bool | None = None) -> None:
            if isinstance(ev, TextEvent):
                if is_final and ev.text is not None:
                    # The chain's final text is all of its text, so deltas still add up to it.
                    ev = dataclasses.replace(ev, text="".join(streamed) + ev.delta)
                streamed.append(ev.delta)
            writer.forward(ev, is_final=is_final)

        try:
            current: Stream | None = _start(first, "chain()'s first argument")
            steps = list(then)
            while current is not None:
                relay.add(current)
                final: Event | None = None
                for ev in current:
                    if ev.is_final:
                        final = ev
                    else:
                        send(ev)
                assert final is not None
                if isinstance(final, ErrorEvent) or not steps:
                    send(final, is_final=True)
                    return
                if getattr(final, "finish_reason", None) == "cancelled" or writer.cancelled:
                    send(_as_cancelled(final), is_final=True)
                    return
                # Build the next part before passing this final on, so that a step returning
                # None can end the chain with this very event as the one final.
                nxt = steps.pop(0)(final)
                if nxt is None:
                    send(final, is_final=True)
                    return
                nxt_stream = _start(nxt, "the stream returned by a chain() step")
                send(final, is_final=False)
                current = nxt_stream
        finally:
            relay.cancel_all()  # a failure here must not leave a model running

    return Stream(producer, kind=kinds[0] if kinds and not then else "mixed")


def merge(*streams: StreamSource) -> Stream:
    """Interleave several running streams into one, events in the order they arrive.

    Each sub-stream's final event arrives as a non-final event, except the one that ends last:
    it is the merged stream's final. An error in any sub-stream cancels the others and ends the
    merged stream with that error. Images keep apart: each (stream, image index) pair gets its
    own ``index`` in the merged stream, numbered in order of first appearance; clips likewise
    (numbered apart from the images). At most one text
    stream can be merged, since text events carry no name of the stream they came from.

    Example:
        >>> s = ms.merge(llm.stream("Describe a red circle"), sd.stream("a red circle on a blue background"))  # doctest: +SKIP
        >>> for ev in s:                                                                                   # doctest: +SKIP
        ...     print(ev.type, getattr(ev, "step", ""), ev.is_final)
    """
    if not streams:
        raise InvalidArgumentError("merge() needs at least one stream, e.g. ms.merge(llm.stream(...), sd.stream(...))")
    started: list[Stream] = []
    try:
        for i, src in enumerate(streams):
            started.append(_start(src, f"merge() argument {i + 1}"))
    except BaseException:
        for s in started:
            s.cancel()
        raise
    texts = [s for s in started if s.kind == "text"]
    if len(texts) > 1:
        for s in started:
            s.cancel()
        raise InvalidArgumentError(
            f"merge() got {len(texts)} text streams; their deltas could not be told apart in one stream. "
            "Merge at most one text stream (with any number of image streams), or consume them separately."
        )
    kinds = {s.kind for s in started}
    kind = kinds.pop() if len(kinds) == 1 else "mixed"

    def producer(writer: StreamWriter) -> None:
        relay = _CancelRelay(writer)
        lock = threading.Lock()
        remaining = [len(started)]
        # Per kind ("image", "video"): (sub-stream, its index) -> the index in the merged stream.
        indices: dict[str, dict[tuple[int, int], int]] = {"image": {}, "video": {}}

        def pump(pos: int, stream: Stream) -> None:
            try:
                for ev in stream:
                    if isinstance(ev, (ImageEvent, VideoEvent)):
                        with lock:
                            table = indices[ev.type]
                            idx = table.setdefault((pos, ev.index), len(table))
                        if idx != ev.index:
                            ev = dataclasses.replace(ev, index=idx)
                    if not ev.is_final:
                        writer.forward(ev)
                        continue
                    if isinstance(ev, ErrorEvent):
                        writer.forward(ev, is_final=True)
                        relay.cancel_all()
                        continue
                    with lock:
                        remaining[0] -= 1
                        last = remaining[0] == 0
                        if last and writer.cancelled:
                            ev = _as_cancelled(ev)  # other parts were cut short
                        # Forward inside the lock so no later sub-stream final can overtake the last.
                        writer.forward(ev, is_final=last)
            except BaseException as exc:  # noqa: BLE001 - a reader failure must still end the stream
                writer.fail(exc)
                relay.cancel_all()

        for s in started:
            relay.add(s)
        threads = [
            threading.Thread(target=pump, args=(i, s), name=f"multistream-merge-{writer.stream_id[:8]}-{i}", daemon=True)
            for i, s in enumerate(started)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            relay.cancel_all()

    return Stream(producer, kind=kind)
