"""The live view of a stream, shared by every renderer: the notebook (``ms.show``) and the demo.

A :class:`LiveView` folds a stream's events into what is on screen so far (text placed at each
event's ``offset``, the newest frame per image, the final event or the error); a
:class:`Throttle` says when the next redraw is due. Both are I/O-free: the caller gives the
events and the time. :func:`throttled_views` is the thin async loop over them that the demo uses;
``ms.show`` runs the same two in a plain ``for`` loop.

Example:
    >>> from multistream.events import TextEvent
    >>> view = LiveView()
    >>> view.apply(TextEvent(stream_id="s", seq=0, t=0.1, delta="Hello", token_ids=[1], index=0))
    >>> view.apply(TextEvent(stream_id="s", seq=1, t=0.2, delta=" there", token_ids=[2], index=1, offset=5))
    >>> view.text(0), view.length
    ('Hello there', 11)
"""

from __future__ import annotations

import asyncio
import html
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..events import AudioEvent, ErrorEvent, Event, ImageEvent, TextEvent, VideoEvent
from ..stream import Stream

__all__ = ["CONFIDENCE_CSS", "Frame", "LiveView", "Throttle", "TokenSpan", "confidence_color", "confidence_html",
           "audio_summary", "ending_words", "eta_words", "markdown_safe_escape", "split_delta", "throttled_views"]


class Throttle:
    """Lets an update through at most once per ``interval`` seconds. I/O-free: the caller gives the time.

    Example:
        >>> throttle = Throttle(max_fps=10)
        >>> throttle.due(0.0)
        True
        >>> throttle.mark(0.0)
        >>> throttle.due(0.05), round(throttle.remaining(0.05), 3), throttle.due(0.1)
        (False, 0.05, True)
    """

    def __init__(self, max_fps: float) -> None:
        self.interval = 1.0 / max_fps
        self._last = -float("inf")

    def due(self, now: float) -> bool:
        """True when an update at ``now`` is allowed."""
        return now - self._last >= self.interval

    def mark(self, now: float) -> None:
        """Record that an update went out at ``now``."""
        self._last = now

    def remaining(self, now: float) -> float:
        """Seconds from ``now`` until the next update is due (0.0 when it already is)."""
        return max(0.0, self.interval - (now - self._last))


@dataclass
class TokenSpan:
    """One answer token as shown: where its text starts (a character offset of the answer), its
    text, and its logprob entry (``token_id``, ``logprob``, ``top_logprobs``...)."""

    start: int
    text: str
    entry: dict[str, Any]

    @property
    def probability(self) -> float:
        return math.exp(float(self.entry.get("logprob", 0.0)))


def split_delta(delta: str, entries: list[dict[str, Any]]) -> list[str]:
    """``delta`` cut into one piece per logprob entry by the tokens' UTF-8 bytes (a token that only
    starts a character gets "", the one that completes it the character); the pieces join to ``delta``.

    Example:
        >>> split_delta("Hi there", [{"bytes": [72, 105]}, {"bytes": [32, 116, 104, 101, 114, 101]}])
        ['Hi', ' there']
        >>> split_delta("😀", [{"bytes": [240, 159]}, {"bytes": [152, 128]}])
        ['', '😀']
    """
    pieces: list[str] = []
    raw, done = b"", 0
    for e in entries:
        raw += bytes(e.get("bytes") or [])
        now = min(len(raw.decode("utf-8", errors="ignore")), len(delta))
        pieces.append(delta[done:now])
        done = max(done, now)
    if pieces and done < len(delta):
        pieces[-1] += delta[done:]  # text the bytes did not account for (held back earlier) goes last
    return pieces


def confidence_color(p: float) -> str:
    """A background for a token of probability ``p``: red (unsure) through amber to green (sure).

    Example:
        >>> confidence_color(1.0), confidence_color(0.0)
        ('hsla(120, 75%, 62%, 0.45)', 'hsla(0, 75%, 62%, 0.45)')
    """
    return f"hsla({round(120 * max(0.0, min(1.0, p)))}, 75%, 62%, 0.45)"


CONFIDENCE_CSS = """
.ms-conf { white-space: pre-wrap; line-height: 1.7; }
.ms-tok { position: relative; border-radius: 3px; cursor: default; }
.ms-tok .ms-tip { display: none; position: absolute; left: 0; top: 1.6em; z-index: 50; background: #fff;
  color: #222; border: 1px solid #bbb; border-radius: 6px; padding: 4px; min-width: 12em; white-space: nowrap;
  box-shadow: 0 2px 8px rgba(0,0,0,.2); font-size: 0.85em; line-height: 1.4; }
.ms-tok:hover .ms-tip, .ms-tok.ms-open .ms-tip { display: block; }
.ms-alt { display: block; width: 100%; text-align: left; border: 0; background: none; padding: 2px 4px;
  cursor: pointer; font: inherit; color: inherit; }
.ms-alt:hover { background: #e8f0fe; }
.ms-alt.ms-chosen { font-weight: 600; }
"""


# Characters that Markdown (and a chat's LaTeX) would read as markup, as numeric entities; a
# newline too, since a blank line would end the HTML block and the rest be parsed as Markdown.
_MARKDOWN_ENTITIES = {c: f"&#{ord(c)};" for c in "\n\\`*_{}[]()#+-.!|~$"}


def markdown_safe_escape(text: str) -> str:
    """``text`` escaped for HTML that Markdown will render: shown exactly, never read as markup.

    Example:
        >>> markdown_safe_escape("# <b>1. *x*</b>")
        '&#35; &lt;b&gt;1&#46; &#42;x&#42;&lt;/b&gt;'
    """
    # One character at a time: html.escape's own entities contain "#", which must stay as it is.
    return "".join(_MARKDOWN_ENTITIES.get(c) or html.escape(c) for c in text)


def _escape(text: str, markdown_safe: bool) -> str:
    return markdown_safe_escape(text) if markdown_safe else html.escape(text)


def confidence_html(view: LiveView, *, markdown_safe: bool = False) -> str:
    """The answer's tokens as HTML: each coloured by its probability, hovering shows its top
    alternatives as buttons (``data-offset``: where the token starts, ``data-token``: the
    alternative's id; also as the classes ``ms-o<offset>`` and ``ms-t<id>``, which survive a chat's
    HTML sanitizer where data attributes do not) that a page turns into ``rewind(offset, token_id=...)``. Everything is escaped;
    ``markdown_safe`` also writes Markdown's own characters as entities, so the HTML can go where
    Markdown is rendered (a chat bubble) and show the tokens exactly.

    Example:
        >>> v = LiveView()
        >>> v.tokens = [TokenSpan(0, "Hi", {"token_id": 5, "logprob": 0.0, "top_logprobs": []})]
        >>> "Hi" in confidence_html(v) and "hsla(120" in confidence_html(v)
        True
        >>> v.tokens = [TokenSpan(0, "**a'**", {"token_id": 5, "logprob": 0.0})]
        >>> "&#42;&#42;a&#x27;&#42;&#42;" in confidence_html(v, markdown_safe=True)
        True
    """
    def esc(text: str) -> str:
        return _escape(text, markdown_safe)

    out = ['<div class="ms-conf">']
    for span in view.tokens:
        e = span.entry
        alts = []
        for alt in e.get("top_logprobs") or []:
            chosen = " ms-chosen" if alt.get("token_id") == e.get("token_id") else ""
            alts.append(
                f'<button class="ms-alt{chosen} ms-o{span.start} ms-t{int(alt["token_id"])}" '
                f'data-offset="{span.start}" data-token="{int(alt["token_id"])}">'
                f'{esc(repr(alt.get("token", "")))} {100 * math.exp(float(alt["logprob"])):.1f}%</button>')
        tip = (f'<span class="ms-tip">{esc(repr(e.get("token", "")))} {100 * span.probability:.1f}%'
               + "".join(alts) + "</span>")
        out.append(f'<span class="ms-tok" style="background:{confidence_color(span.probability)}" '
                   f'data-offset="{span.start}" data-p="{span.probability:.4f}">{esc(span.text)}{tip}</span>')
    out.append("</div>")
    return "".join(out)


# How a stream ended, in the words the web client uses too (multistream/static/app.js, ENDINGS):
# a bare "stop" in a status line reads as "stopped" to people, for a run that finished.
_ENDINGS = {"stop": "done", "length": "done (reached the token limit)", "stop_sequence": "done (stop sequence)",
            "cancelled": "cancelled", "finished_early": "stopped early",
            "repetition": "stopped: it was repeating itself", "content_filter": "stopped by the content filter"}


def ending_words(finish_reason: str | None) -> str:
    """A final event's ``finish_reason`` for people, as the demo, the notebook and the web client say it.

    Example:
        >>> ending_words("stop"), ending_words("length"), ending_words("cancelled")
        ('done', 'done (reached the token limit)', 'cancelled')
    """
    return _ENDINGS.get(finish_reason or "stop", str(finish_reason))


def audio_summary(ev: AudioEvent) -> str:
    """A final audio event in one line, as the demo's Speech tab and ``ms.show()`` print it.

    Example:
        >>> audio_summary(AudioEvent(stream_id="s", seq=3, t=0.9, is_final=True, data=b"", sample_rate=22050,
        ...                          sample_offset=0, num_samples=0, text_span=(0, 3),
        ...                          finish_reason="stop", duration_s=0.71, metrics={"ttfa_ms": 159, "rtf": 0.22}))
        'done · 0.71 s of audio · first audio 159 ms · real-time factor 0.22'
    """
    m = ev.metrics or {}
    return (f"{ending_words(ev.finish_reason)} · {ev.duration_s or 0:.2f} s of audio · first audio {m.get('ttfa_ms')} ms · "
            f"real-time factor {m.get('rtf')}")


def eta_words(eta_s: float | None) -> str:
    """An image or video event's ``eta_s`` for people: "about 3 s left", "estimating time left" while
    unknown (before the second step).

    Example:
        >>> eta_words(None), eta_words(0.4), eta_words(12.3), eta_words(95)
        ('estimating time left', 'about 0.4 s left', 'about 12 s left', 'about 1 min 35 s left')
    """
    if eta_s is None:
        return "estimating time left"
    if eta_s < 10:
        return f"about {eta_s:.1f} s left"
    if eta_s < 60:
        return f"about {eta_s:.0f} s left"
    minutes, seconds = divmod(round(eta_s), 60)
    return f"about {minutes} min {seconds} s left"


@dataclass
class Frame:
    """The newest frame of one image in the batch (or the newest preview of one clip: every frame
    as one animated picture or contact sheet); ``final`` once it is the full-quality result.

    Example:
        >>> LiveView().images.get(0) is None     # no frame yet
        True
    """

    ev: ImageEvent | VideoEvent
    final: bool = False


@dataclass
class LiveView:
    """What a stream has shown so far, folded from its events (shared by every renderer).

    Text follows each event's ``offset`` (``text = text[:offset] + delta``), so after a rewind the
    cut part is gone; a composed stream (``ms.chain``) can hold several text parts, each closed by
    an event with a ``finish_reason``. ``images`` keeps the newest frame per image index, ``videos``
    the newest preview per clip (then the clip itself).

    Example:
        >>> view = LiveView.starting_with("Hello ")    # a revised answer keeps its first part
        >>> view.text(0), view.events
        ('Hello ', 0)
    """

    # Text parts: a composed stream can hold several (each closed by an event with a finish_reason).
    texts: list[list[str]] = field(default_factory=list)
    text_done: list[TextEvent | None] = field(default_factory=list)
    images: dict[int, Frame] = field(default_factory=dict)
    videos: dict[int, Frame] = field(default_factory=dict)
    final: Event | None = None
    error: dict[str, str] | None = None
    events: int = 0
    t: float = 0.0
    first_text_t: float | None = None  # when the first text arrived: the live time-to-first-token
    text_tokens: int = 0
    frames: int = 0  # preview frames seen (after the stream's own coalescing)
    revision: int = 0  # the newest text revision (+1 per steer or rewind)
    # Where each text part starts in the stream's text (offsets count over the whole stream).
    starts: list[int] = field(default_factory=list)
    length: int = 0  # characters of text in the stream so far (after edits)
    # With logprobs: each answer token's place in the text, its text and its entry (by token index).
    tokens: list[TokenSpan] = field(default_factory=list)
    # Characters of the stream's text that can no longer change (a beam search's settled prefix;
    # everything sent, otherwise). Renderers show the rest faded.
    committed: int = 0
    # Speech: seconds of audio so far, when the first chunk came, and the final audio event.
    audio_seconds: float = 0.0
    first_audio_t: float | None = None
    audio_final: AudioEvent | None = None
    # While the request waits for a slot on a server: (position, waiting in all), position 1 = next
    # (the stream's ``queue_position``, see `throttled_views`); None once it runs.
    queued: tuple[int, int] | None = None
    _part_tokens_from: int = 0  # text_tokens when the current text part began

    @classmethod
    def starting_with(cls, text: str) -> LiveView:
        """A view whose first text part already holds ``text`` (no events, no first token yet).

        For a stream that continues an answer, e.g. ``llm.revise(final, offset)``, whose events
        place new text after the kept part.
        """
        return cls(texts=[[text] if text else []], text_done=[None], starts=[0], length=len(text))

    def apply(self, ev: Event) -> None:
        """Fold one event into the view."""
        self.events += 1
        self.queued = None
        self.t = ev.t
        if isinstance(ev, TextEvent):
            if not self.texts or self.text_done[-1] is not None:
                self.texts.append([])
                self.text_done.append(None)
                self.starts.append(self.length)
                self._part_tokens_from = self.text_tokens
            # A beam search's better hypothesis replaces the tail within the same revision.
            replaces = ev.offset < self.length and ev.revision == self.revision
            self.revision = max(self.revision, ev.revision)
            offset = ev.offset
            if ev.logprobs is not None or offset < self.length:
                # Token spans follow the token index: a rewind (or a revised answer's echo) cuts there.
                self.tokens = self.tokens[: ev.index]
                at = offset
                for piece, entry in zip(split_delta(ev.delta, ev.logprobs or []), ev.logprobs or []):
                    self.tokens.append(TokenSpan(at, piece, entry))
                    at += len(piece)
            if offset < self.length:
                # A rewind: keep the part's text up to the offset, then the new delta.
                start = self.starts[-1]
                kept = self.text(len(self.texts) - 1)[: max(0, offset - start)]
                self.texts[-1][:] = [kept] if kept else []
                self.length = start + len(kept)
            if ev.delta:
                self.texts[-1].append(ev.delta)
                self.length += len(ev.delta)
                if self.first_text_t is None:
                    self.first_text_t = ev.t
            if replaces:
                # Its tokens are the hypothesis's from `index` on: count the hypothesis, not resends.
                self.text_tokens = self._part_tokens_from + ev.index + len(ev.token_ids)
            else:
                self.text_tokens += len(ev.token_ids)
            # Each event says how much is settled (after a rewind, possibly less than before).
            self.committed = min(ev.committed, self.length)
            if ev.finish_reason is not None:
                self.text_done[-1] = ev
        elif isinstance(ev, ImageEvent):
            self.images[ev.index] = Frame(ev, final=ev.finish_reason is not None)
            if ev.finish_reason is None:
                self.frames += 1
        elif isinstance(ev, VideoEvent):
            self.videos[ev.index] = Frame(ev, final=ev.finish_reason is not None)
            if ev.finish_reason is None:
                self.frames += 1
        elif isinstance(ev, AudioEvent):
            if ev.audio is not None:
                self.audio_final = ev
            elif ev.num_samples:
                self.audio_seconds += ev.num_samples / ev.sample_rate
                if self.first_audio_t is None:
                    self.first_audio_t = ev.t
        elif isinstance(ev, ErrorEvent):
            self.error = dict(ev.error)
        if ev.is_final:
            self.final = ev

    def queue_note(self) -> str:
        """"waiting: N ahead" while the request waits in a server's queue, else "".

        Example:
            >>> LiveView(queued=(3, 5)).queue_note(), LiveView(queued=(1, 1)).queue_note()
            ('waiting: 2 ahead', 'waiting: next in line')
        """
        if self.queued is None:
            return ""
        ahead = max(0, self.queued[0] - 1)
        return f"waiting: {ahead} ahead" if ahead else "waiting: next in line"

    def text(self, part: int) -> str:
        """The text of one text part so far."""
        return "".join(self.texts[part])

    def settled(self, part: int) -> tuple[str, str]:
        """One text part as ``(committed, provisional)``: the text that can no longer change, and
        the rest (a beam search's best hypothesis now, which a later event may replace).

        Example:
            >>> view = LiveView()
            >>> view.apply(TextEvent(stream_id="s", seq=0, t=0.1, delta="The cat", committed=3))
            >>> view.settled(0)
            ('The', ' cat')
        """
        text = self.text(part)
        start = self.starts[part] if part < len(self.starts) else 0
        cut = max(0, min(len(text), self.committed - start))
        if part < len(self.text_done) and self.text_done[part] is not None:
            cut = len(text)
        return text[:cut], text[cut:]


_QUEUE_POLL_S = 0.25


async def throttled_views(stream: Stream, max_fps: float, view: LiveView | None = None) -> AsyncIterator[LiveView]:
    """Yield the stream's folded state at most ``max_fps`` times a second, and always at the end.

    Events that arrive between two updates are folded into the state (text placed at its
    ``offset``, the preview replaced), so a slow page receives the newest frame instead of a queue
    of old ones; a view with news is sent once its turn comes even if no newer event arrives.
    Leaving early (the page closed, the task cancelled) cancels the model. ``view`` may start with
    text already there (:meth:`LiveView.starting_with`, a revised answer's kept part).

    Until the first event, a stream that waits in a server's queue (one that has a
    ``queue_position`` attribute: ``(position, waiting in all)`` or None, as the demo's gated
    models keep it) is looked at every ``_QUEUE_POLL_S`` and a view goes out each time it moves,
    so a page can say "waiting: N ahead" (``view.queue_note()``).

    Example:
        >>> async for view in throttled_views(llm.stream("Write a haiku"), max_fps=15):  # doctest: +SKIP
        ...     print(view.text(0))
    """
    view = view if view is not None else LiveView()
    throttle = Throttle(max_fps)
    events = stream.__aiter__()
    next_ev: asyncio.Future[Any] | None = None
    dirty = False
    try:
        while True:
            if next_ev is None:
                next_ev = asyncio.ensure_future(events.__anext__())
            timeout = throttle.remaining(time.monotonic()) if dirty else None
            watch_queue = view.events == 0 and hasattr(stream, "queue_position")
            if watch_queue:
                timeout = _QUEUE_POLL_S if timeout is None else min(timeout, _QUEUE_POLL_S)
            done, _ = await asyncio.wait({next_ev}, timeout=timeout)
            if watch_queue and next_ev not in done:
                place = getattr(stream, "queue_position", None)
                place = (int(place[0]), int(place[1])) if place else None
                if place != view.queued:
                    view.queued = place
                    yield view
                    continue
            if next_ev in done:
                ev = next_ev.result()
                next_ev = None
                view.apply(ev)
                dirty = True
                if ev.is_final:
                    yield view
                    return
            now = time.monotonic()
            if dirty and throttle.due(now):
                throttle.mark(now)
                dirty = False
                yield view
    finally:
        stream.cancel()
        if next_ev is not None and not next_ev.done():
            next_ev.cancel()
            # The cancelled __anext__ must finish before aclose(), or aclose() finds the generator
            # still running and raises.
            await asyncio.gather(next_ev, return_exceptions=True)
        await events.aclose()  # type: ignore[attr-defined]
