"""The output side of one text request (vLLM v1's ``OutputProcessor``): tokens in, events out.

`TextOutput` owns the request's `StreamWriter` and everything between a token id and an event:
the incremental detokenizer, stop strings, chunking into events (`chunk_tokens`, `chunk_ms`),
logprob entries, timing metrics and the final event. It runs on the engine thread.

Example (what `TextRequest.accept` does with each token):
    >>> out = TextOutput(writer, tokenizer, options, table)   # doctest: +SKIP
    >>> stopped = out.feed(token, logprob)                    # doctest: +SKIP
    >>> out.send_if_ready()                                   # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from typing import Any

from ..stream import StreamWriter
from ._detokenizer import IncrementalDetokenizer
from ._options import TextOptions
from ._stop_strings import StopMatcher
from ._tools import parse_tool_calls, tools_active

__all__ = ["TextOutput"]


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
        self.logprobs: list[dict[str, Any]] = []  # one entry per id, when the stream asked for them
        self.index = 0  # output position of the first pending token
        self.last_emit = time.perf_counter()

    def add(self, delta: str, token_id: int | None, logprob: dict[str, Any] | None = None) -> None:
        if token_id is not None:
            self.ids.append(token_id)
            if logprob is not None:
                self.logprobs.append(logprob)
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

    def take_logprobs(self) -> list[dict[str, Any]]:
        """The entries of the ids `take` just returned (call right after it)."""
        taken, self.logprobs = self.logprobs, []
        return taken


class TextOutput:
    """One request's events: what its answer's tokens become on the wire."""

    def __init__(self, writer: StreamWriter, tokenizer: Any, options: TextOptions, token_table: Any = None) -> None:
        self.writer = writer
        self.tokenizer = tokenizer
        self.options = options
        self.token_table = token_table  # a `TokenTable`, when the stream asked for logprobs
        self.top_logprobs = options.top_logprobs if options.wants_logprobs else -1
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(list(options.stop))
        self._chunker = _Chunker(options.chunk_tokens, options.chunk_ms)
        self.text = ""  # the answer as sent (deltas applied)
        self._token_times: list[float] = []
        self._first_text_at: float | None = None
        # One logprob entry per answer token (None where unknown), when the stream asked for them.
        self.answer_logprobs: list[dict[str, Any] | None] = []
        self.revisions: list[dict[str, Any]] = []

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs >= 0

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` as the stream writes it."""
        return self._detok._decode(ids)

    # -- an answer that exists already ----------------------------------------------------------

    def resume(self, answer_ids: list[int], known_logprobs: Any, *, echo: bool) -> None:
        """Start after ``answer_ids``: sent again as the first delta (``echo``, revise) or taken as
        already sent (failover)."""
        kept = self._detok.prime(answer_ids)
        self._chunker.index = len(answer_ids)
        self.answer_logprobs = list(known_logprobs) if known_logprobs is not None \
            and len(known_logprobs) == len(answer_ids) else [None] * len(answer_ids)
        if echo:
            if kept:
                lps = self.answer_logprobs if self.top_logprobs >= 0 and all(self.answer_logprobs) else None
                self.writer.text(kept, list(answer_ids), 0, logprobs=lps)  # type: ignore[arg-type]
                self._first_text_at = self.writer.elapsed()
        else:
            self.writer.continue_text(len(kept))
        self.text = kept

    def restart(self, answer_ids: list[int]) -> int:
        """A rewind kept ``answer_ids``: the held-back text is dropped, the client is told to replace
        from the kept text's end (returned)."""
        del self.answer_logprobs[len(answer_ids):]
        self._detok = IncrementalDetokenizer(self.tokenizer)
        kept = self._detok.prime(answer_ids)
        self._stops = StopMatcher(list(self.options.stop))
        self._chunker = _Chunker(self.options.chunk_tokens, self.options.chunk_ms)
        self._chunker.index = len(answer_ids)
        self.text = kept
        self.writer.text("", [], len(answer_ids), offset=len(kept))  # "replace from here"
        return len(kept)

    # -- tokens in, events out ------------------------------------------------------------------

    def tick(self) -> None:
        """The model generated a token (its time, for the metrics)."""
        self._token_times.append(self.writer.elapsed())

    def feed(self, token: int, logprob: dict[str, Any] | None) -> bool:
        """An answer token (EOS excluded) and its logprob entry; True if a stop string ended it."""
        self.answer_logprobs.append(logprob)
        safe, stopped = self._stops.feed(self._detok.feed(token))
        self._chunker.add(safe, token, logprob)
        return stopped

    def send_if_ready(self) -> None:
        if self._chunker.ready():
            self._send()

    def _send(self) -> None:
        delta, ids, index = self._chunker.take()
        lps = self._chunker.take_logprobs()
        self.text += delta
        if self._first_text_at is None:
            self._first_text_at = self.writer.elapsed()
        self.writer.text(delta, ids, index, logprobs=lps if self.wants_logprobs else None)

    def flush_held_back(self) -> None:
        """Send the text held back (partial characters, a possible stop string): a steer."""
        tail, _ = self._stops.feed(self._detok.flush())
        self._chunker.add(tail + self._stops.flush(), None)
        if self._chunker.text:
            self._send()
        self._stops = StopMatcher(list(self.options.stop))

    def send_beams(self, beams: Any, *, final: bool) -> tuple[str, list[int], int, int] | None:
        """A beam search's best hypothesis: sent now, or returned for the final event (``final``)."""
        update = beams.update(self._detok._decode, final=final)
        if update is None:
            return None
        delta, ids, index, offset, committed = update
        self.text = self.text[:offset] + delta
        if final:
            return delta, ids, index, offset
        if self._first_text_at is None and self.text:
            self._first_text_at = self.writer.elapsed()
        self.writer.text(delta, ids, index, offset=offset, committed=committed)
        return None

    # -- the end --------------------------------------------------------------------------------

    def finish(self, reason: str, *, usage: dict[str, int], metrics: dict[str, float]) -> str:
        """Flush held-back text and send the final event; returns the finish reason (a stop string
        found in the held-back text makes it ``stop_sequence``)."""
        if reason != "stop_sequence":
            tail, stopped = self._stops.feed(self._detok.flush())
            self._chunker.add(tail + self._stops.flush(), None)
            if stopped:
                reason = "stop_sequence"
        delta, ids, index = self._chunker.take()
        lps = self._chunker.take_logprobs()
        self.text += delta
        if self._first_text_at is None and delta:
            self._first_text_at = self.writer.elapsed()
        self.final_event(reason, delta, ids, index, offset=None, usage=usage, metrics=metrics,
                         logprobs=lps if self.wants_logprobs else None)
        return reason

    def finish_beams(self, beams: Any, reason: str, *, usage: dict[str, int], metrics: dict[str, float]) -> None:
        """The final event of a beam search: its best hypothesis, whole."""
        delta, ids, index, offset = self.send_beams(beams, final=True)  # type: ignore[misc]
        if self._first_text_at is None and self.text:
            self._first_text_at = self.writer.elapsed()
        self.final_event(reason, delta, ids, index, offset=offset, usage=usage, metrics=metrics)

    def final_event(self, reason: str, delta: str, ids: list[int], index: int, *, offset: int | None,
                    usage: dict[str, int], metrics: dict[str, float],
                    logprobs: list[dict[str, Any]] | None = None) -> None:
        """The final event: timing metrics (then ``metrics``, the request's own), usage, revisions."""
        duration = self.writer.elapsed()
        times = self._token_times
        gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
        decode_span = times[-1] - times[0] if len(times) > 1 else 0.0
        timing = {
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
            text=self.text,
            usage=usage,
            metrics={**timing, **metrics},
            revisions=self.revisions or None,
            offset=offset,
            logprobs=logprobs,
            tool_calls=self._tool_calls(),
        )

    def _tool_calls(self) -> list[dict[str, Any]] | None:
        """The calls in the answer, when tools were offered (else None: no ``tool_calls`` field)."""
        if not tools_active(self.options.tools, self.options.tool_choice):
            return None
        return parse_tool_calls(self.text, self.writer.stream_id)[1]
