"""The engine backend of a speech model: one sentence of one request per engine step.

Each request holds the spans of its text that are ready to speak (a whole text is segmented a
little at a time, as it is spoken; a text fed while it is written, as by `multistream.speak`,
gets its spans from the feeder). A step synthesizes one span of the request that comes first:
highest ``priority``, then the one served least recently, then arrival. So concurrent requests
take turns sentence by sentence, a higher priority takes the very next step, and ``cancel()``
takes effect within one chunk.

Example (what `SpeechModel` does):
    >>> scheduler = SpeechScheduler(synth)                       # doctest: +SKIP
    >>> engine = Engine(scheduler, name="speech-joe")            # doctest: +SKIP
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import numpy as np

from ..stream import StreamWriter
from ._audio import pcm_mime, wav_bytes
from ._splitter import SentenceSplitter

__all__ = ["SpeechRequest", "SpeechScheduler"]

logger = logging.getLogger("multistream")

SENTENCE_GAP_S = 0.2  # silence before a sentence that follows another
CLAUSE_GAP_S = 0.08  # silence after a first clause sent early (the sentence goes on)
_FADE_S = 0.002  # edges of each piece ramp over 2 ms: no click where pieces meet
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f\u2026][\"')\]\u201d\u2019]*\s*$")


class SpeechRequest:
    """One speech stream: its text, the spans ready to speak, and what it has made so far.

    With ``text`` given the text is whole; with ``text=None`` it arrives through `feed` and
    `end` (thread-safe; they wake the engine).
    """

    def __init__(self, writer: StreamWriter, text: str | None, *, voice: str | None, speed: float,
                 priority: int, first_clause_after: int | None = 48) -> None:
        self.writer = writer
        self.voice = voice
        self.speed = speed
        self.priority = priority
        self.order = 0
        self.last_served = -1
        self.spans: deque[tuple[int, int]] = deque()
        self._splitter = SentenceSplitter(first_clause_after=first_clause_after)
        self._lock = threading.Lock()
        self.whole = text is not None
        self.ended = text is not None  # no more text will come
        if text is not None:
            self._splitter.text = text
        self.wake: Any = None  # set by the scheduler: wakes the engine after a feed
        # what was made
        self.chunks: list[bytes] = []
        self.sample_offset = 0
        self.spoken_end = 0
        self.synth_s = 0.0
        self.ttfa_s: float | None = None

    @property
    def text(self) -> str:
        return self._splitter.text

    # -- the feeder's side (any thread) -----------------------------------------------------------

    def feed(self, delta: str) -> None:
        with self._lock:
            self.spans.extend(self._splitter.feed(delta))
        self._notify()

    def end(self) -> None:
        with self._lock:
            self.spans.extend(self._splitter.flush())
            self.ended = True
        self._notify()

    def fail(self, exc: BaseException) -> None:
        """The request could not start (the engine's admit failed): end it with an error event."""
        self.writer.fail(exc)

    def _notify(self) -> None:
        if self.wake is not None:
            self.wake()

    # -- the engine's side ---------------------------------------------------------------------

    def ready(self) -> bool:
        """Has a span to speak, or is done (text ended and spoken, or cancelled)."""
        return bool(self.spans) or self.ended or self.writer.cancelled

    def next_span(self) -> tuple[int, int] | None:
        if not self.spans and self.whole:
            self.spans.extend(self._splitter.next_spans())
        with self._lock:
            return self.spans.popleft() if self.spans else None


class SpeechScheduler:
    """The engine backend (see the module docstring)."""

    def __init__(self, synth: Any) -> None:
        self.synth = synth
        self.requests: list[SpeechRequest] = []
        self._arrivals = count()
        self._tick = 0
        self.wake: Any = None  # the engine's wake, set by the model
        self.trace: list[tuple[int, int]] | None = None  # (request order, span start); tests switch it on

    def admit(self, req: SpeechRequest) -> None:
        req.order = next(self._arrivals)
        req.wake = self.wake
        self.requests.append(req)
        if self.wake is not None:
            # A request waiting for text (an idle engine) must still end at once when cancelled.
            req.writer.on_cancel(self.wake)

    def has_work(self) -> bool:
        return any(r.ready() for r in self.requests)

    def step(self) -> None:
        for req in [r for r in self.requests if r.writer.cancelled]:
            self._finish(req, "cancelled")
        ready = [r for r in self.requests if r.ready()]
        if not ready:
            return
        req = min(ready, key=lambda r: (-r.priority, r.last_served, r.order))
        span = req.next_span()
        if span is None:
            if req.ended:
                self._finish(req, "stop")
            return
        self._tick += 1
        req.last_served = self._tick
        if self.trace is not None:
            self.trace.append((req.order, span[0]))
        try:
            self._speak(req, span)
        except Exception as exc:  # noqa: BLE001 - one request's fault ends that request only
            logger.error("speech stream failed", exc_info=exc)
            self.requests.remove(req)
            req.writer.fail(exc)
            return
        if req.whole and not req.spans and req._splitter.done:
            self._finish(req, "stop")

    def _speak(self, req: SpeechRequest, span: tuple[int, int]) -> None:
        text = req.text[span[0]:span[1]]
        started = time.perf_counter()
        samples = self.synth.synthesize(text, req.voice, req.speed)
        req.synth_s += time.perf_counter() - started
        sr = self.synth.sample_rate
        samples = _fade(samples, int(sr * _FADE_S))
        if req.chunks:  # a pause before every piece but the first
            before = req.text[:span[0]]
            gap = SENTENCE_GAP_S if _SENTENCE_END.search(before) else CLAUSE_GAP_S
            samples = np.concatenate([np.zeros(int(sr * gap / req.speed), dtype="<i2"), samples])
        data = samples.astype("<i2").tobytes()
        if req.writer.cancelled:
            return  # cancelled while this piece was made: it is not sent (the next step ends it)
        req.writer.audio(data=data, sample_rate=sr, sample_offset=req.sample_offset, num_samples=len(samples),
                         text_span=span, mime=pcm_mime(sr))
        if req.ttfa_s is None:
            req.ttfa_s = req.writer.elapsed()
        req.chunks.append(data)
        req.sample_offset += len(samples)
        req.spoken_end = span[1]

    def _finish(self, req: SpeechRequest, reason: str) -> None:
        if req in self.requests:
            self.requests.remove(req)
        if req.writer.finished:
            return
        sr = self.synth.sample_rate
        pcm = b"".join(req.chunks)
        duration = req.sample_offset / sr
        elapsed = req.writer.elapsed()
        metrics = {
            "ttfa_ms": round(req.ttfa_s * 1000, 3) if req.ttfa_s is not None else None,
            "rtf": round(req.synth_s / duration, 4) if duration else None,
            "synthesis_ms": round(req.synth_s * 1000, 3),
            "duration_ms": round(elapsed * 1000, 3),
            "chunks": len(req.chunks),
        }
        req.writer.finish_audio(
            sample_rate=sr, sample_offset=req.sample_offset, text_span=(0, req.spoken_end), mime=pcm_mime(sr),
            audio=wav_bytes(pcm, sr), duration_s=duration, finish_reason=reason,
            usage={"input_characters": len(req.text), "audio_seconds": round(duration, 4)},
            metrics=metrics,  # type: ignore[arg-type]
            text=req.text,  # what was spoken (on a server: after its content filter), for captions
        )

    def fail_all(self, exc: BaseException) -> None:
        for req in list(self.requests):
            self.requests.remove(req)
            req.writer.fail(exc)

    def shutdown(self) -> None:
        for req in list(self.requests):
            self._finish(req, "cancelled")
        self.requests.clear()


def _fade(samples: np.ndarray, n: int) -> np.ndarray:
    if n < 2 or len(samples) < 4 * n:
        return samples
    out = samples.astype(np.float32)
    ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
    out[:n] *= ramp
    out[-n:] *= ramp[::-1]
    return out.astype("<i2")
