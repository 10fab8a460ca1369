"""One text request inside the engine: its tokens, its sampler, and what its stream has seen.

Everything here is per request and runs on the engine thread: the incremental detokenizer, stop
strings, chunking into events, timing metrics and the final event. The batcher only decides when
the request's next token is computed; `TextRequest.accept` turns that token into events.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..detokenizer import IncrementalDetokenizer
from ..stop_strings import StopMatcher
from ..stream import StreamWriter
from ..text_options import TextOptions
from ..text_sampling import RowSampler

__all__ = ["TextRequest"]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class _Chunker:
    """Groups deltas into events: every ``tokens`` tokens and/or every ``ms`` milliseconds."""

    def __init__(self, tokens: int | None, ms: float | None) -> None:
        self.tokens = tokens if tokens is not None else (None if ms is not None else 1)
        self.seconds = None if ms is None else ms / 1000.0
        self.text = ""
        self.ids: list[int] = []
        self.index = 0  # output position of the first pending token
        self.last_emit = time.perf_counter()

    def add(self, delta: str, token_id: int | None) -> None:
        if token_id is not None:
            self.ids.append(token_id)
        self.text += delta

    def ready(self) -> bool:
        if not self.text:
            return False
        if self.tokens is not None and len(self.ids) >= self.tokens:
            return True
        return self.seconds is not None and time.perf_counter() - self.last_emit >= self.seconds

    def take(self) -> tuple[str, list[int], int]:
        taken = (self.text, self.ids, self.index)
        self.index += len(self.ids)
        self.text, self.ids = "", []
        self.last_emit = time.perf_counter()
        return taken


@dataclass(eq=False)
class TextRequest:
    """A text generation from submission to its final event (engine-thread state)."""

    writer: StreamWriter
    prompt_ids: list[int]
    options: TextOptions
    sampler: RowSampler
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    priority: int = 0
    order: int = 0  # arrival order, the tie-break after priority
    # Engine bookkeeping: how much of the prompt is in the row's cache, the row's own cache while
    # it is not part of the batch (prefill, or paused by a higher priority), the next input token.
    prefilled: int = 0
    own_cache: Any = None
    next_token: int | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._stops = StopMatcher(list(self.options.stop))
        self._chunker = _Chunker(self.options.chunk_tokens, self.options.chunk_ms)
        self._emitted: list[str] = []
        self._token_times: list[float] = []
        self._first_text_at: float | None = None

    # -- state ----------------------------------------------------------------------------------

    @property
    def sequence(self) -> list[int]:
        """Every token the model has seen or made for this request, in order."""
        return self.prompt_ids + self.generated

    @property
    def cached_length(self) -> int:
        """Tokens of this request in its KV cache (the newest generated token is not yet)."""
        return self.prefilled + max(0, len(self.generated) - 1)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def check_flags(self) -> bool:
        """Apply cancel / finish-early from the consumer; True if the request just ended."""
        if self.done:
            return True
        if self.writer.cancelled:
            self.finish("cancelled")
            return True
        if self.writer.finish_early_requested:
            self.finish("finished_early")
            return True
        return False

    # -- tokens in, events out ------------------------------------------------------------------

    def accept(self, token: int) -> bool:
        """Take the next generated token; emit what is ready. True if the request has ended."""
        self.generated.append(token)
        self._token_times.append(self.writer.elapsed())
        if token in self.eos_token_ids:
            self.finish("stop")
            return True
        safe, stopped = self._stops.feed(self._detok.feed(token))
        self._chunker.add(safe, token)
        if stopped:
            self.finish("stop_sequence")
            return True
        if self._chunker.ready():
            self._send()
        if len(self.generated) >= self.max_new_tokens:
            self.finish("length")
            return True
        self.next_token = token
        return False

    def _send(self) -> None:
        delta, ids, index = self._chunker.take()
        self._emitted.append(delta)
        if self._first_text_at is None:
            self._first_text_at = self.writer.elapsed()
        self.writer.text(delta, ids, index)

    def finish(self, reason: str) -> None:
        """Flush held-back text and emit the final event (once)."""
        if self.done:
            return
        self.finish_reason = reason
        self.own_cache = None
        if reason != "stop_sequence":
            tail, stopped = self._stops.feed(self._detok.flush())
            self._chunker.add(tail + self._stops.flush(), None)
            if stopped:
                self.finish_reason = reason = "stop_sequence"
        delta, ids, index = self._chunker.take()
        self._emitted.append(delta)
        if self._first_text_at is None and delta:
            self._first_text_at = self.writer.elapsed()
        duration = self.writer.elapsed()
        times = self._token_times
        gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
        decode_span = times[-1] - times[0] if len(times) > 1 else 0.0
        metrics = {
            "ttft_ms": round((self._first_text_at if self._first_text_at is not None else duration) * 1000, 3),
            "itl_ms_p50": round(_percentile(gaps, 0.5), 3),
            "itl_ms_p95": round(_percentile(gaps, 0.95), 3),
            "duration_ms": round(duration * 1000, 3),
            # Decode speed: tokens after the first over the time they took (prefill excluded).
            "tokens_per_s": round((len(times) - 1) / decode_span, 3) if decode_span > 0 else 0.0,
        }
        self.writer.finish_text(
            delta,
            ids,
            index,
            finish_reason=reason,
            text="".join(self._emitted),
            # Every generated token counts, EOS included, as model.generate reports it.
            usage={"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.generated)},
            metrics=metrics,
        )

    def fail(self, exc: BaseException) -> None:
        """End with an error event (a fault of the model on this request)."""
        if not self.done:
            self.finish_reason = "error"
            self.own_cache = None
            self.writer.fail(exc)
