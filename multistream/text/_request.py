"""One text request inside the engine: its tokens, its sampler, and what its stream has seen.

Everything here is per request and runs on the engine thread: the incremental detokenizer, stop
strings, chunking into events, timing metrics and the final event. The batcher only decides when
the request's next token is computed; `TextRequest.accept` turns that token into events.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..stream import StreamWriter
from ._detokenizer import IncrementalDetokenizer
from ._lookahead import lookahead_for
from ._options import TextOptions
from ._repetition import RepetitionDetector
from ._sampling import RowSampler
from ._stop_strings import StopMatcher
from ._tools import parse_tool_calls, tools_active

__all__ = ["Edit", "TextRequest"]

logger = logging.getLogger("multistream")


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


@dataclass
class Edit:
    """A steer or rewind waiting for the request's next step."""

    kind: str  # "steer" | "rewind"
    inserted: list[int]  # tokens that carry the instruction into the context ([] for none)
    instruction: str | None = None
    offset: int | None = None  # rewind: character of the answer to cut at (snapped to a token)
    sampler: RowSampler | None = None  # rewind with new sampling options
    token_id: int | None = None  # rewind: the first regenerated token, chosen by the caller (a branch)


@dataclass(eq=False)
class TextRequest:
    """A text generation from submission to its final event (engine-thread state).

    ``context`` is every token the model sees, in order: the prompt, the answer's tokens and the
    tokens of any steering instruction. ``prefilled`` of them are in the KV cache; the rest wait
    for the next forward (after the first token, exactly one: the newest). The answer is
    ``answer_ids`` (EOS excluded); ``answer_pos[k]`` is where answer token ``k`` sits in
    ``context``, so a rewind knows where to cut.
    """

    writer: StreamWriter
    prompt_ids: list[int]
    options: TextOptions
    sampler: RowSampler
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    context_length: int = 1 << 30
    priority: int = 0
    order: int = 0  # arrival order, the tie-break after priority
    is_chat: bool = False  # steering instructions are inserted as chat turns (else as plain text)
    # An answer that exists already: (context, answer_ids, answer_pos) to start from, and whether
    # its text is sent again as the first delta (revise) or taken as already sent (failover).
    history: tuple[list[int], list[int], list[int]] | None = None
    echo_history: bool = False
    on_finish: Any = None  # called with the request once it has ended (the model keeps a few)
    # Called on the engine thread with each edit as it takes effect: its revision dict plus
    # ``revision`` (its number) and ``at`` (answer tokens before its instruction tokens).
    on_edit: Any = None
    # The stream's grammar (`TokenConstraint`: allowed=, json_schema=, tools=), or None.
    constraint: Any = None
    # Engine bookkeeping: how much of the context is in the row's cache, the row's own cache while
    # it is not part of the batch (prefill, or paused by a higher priority or an edit).
    prefilled: int = 0
    own_cache: Any = None
    needs_prefill: bool = True
    generated: int = 0  # tokens the model generated, EOS and rewound ones included (usage)
    finish_reason: str | None = None
    # The next token, chosen by the caller instead of sampled (a branch: rewind(offset, token_id=)).
    forced_token: int | None = None
    # Requests of one prompt that share its prefill (n choices; see `SharedPrompt`).
    share: Any = None
    # Logprob entries of answer tokens from before this run (revise), parallel to the history's answer.
    history_logprobs: list[dict[str, Any]] | None = None
    token_table: Any = None  # a `TokenTable`, when the stream asked for logprobs
    # A beam search (`_beams.BeamSearch`) when ``num_beams`` > 1: the request then takes that many
    # rows of the batch, and its events show the best hypothesis (`accept_beams`).
    beams: Any = None

    def __post_init__(self) -> None:
        self.context: list[int] = list(self.prompt_ids)
        self.answer_ids: list[int] = []
        self.answer_pos: list[int] = []
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._stops = StopMatcher(list(self.options.stop))
        self._chunker = _Chunker(self.options.chunk_tokens, self.options.chunk_ms)
        self._text = ""  # the answer as sent (deltas applied)
        self._token_times: list[float] = []
        self._first_text_at: float | None = None
        self._edits: deque[Edit] = deque()
        self._edits_lock = threading.Lock()
        self.revisions: list[dict[str, Any]] = []
        self.rewinds = 0  # the penalties' counts are redone after a rewind
        self.top_logprobs = self.options.top_logprobs if self.options.wants_logprobs else -1
        # One logprob entry per answer token (None where unknown), when the stream asked for them.
        self.answer_logprobs: list[dict[str, Any] | None] = []
        if self.history is not None:
            context, answer_ids, answer_pos = self.history
            self.context, self.answer_ids, self.answer_pos = list(context), list(answer_ids), list(answer_pos)
            kept = self._detok.prime(self.answer_ids)
            self._chunker.index = len(self.answer_ids)
            self.generated = len(self.answer_ids)
            known = self.history_logprobs
            self.answer_logprobs = list(known) if known is not None and len(known) == len(self.answer_ids) \
                else [None] * len(self.answer_ids)
            if self.echo_history:
                if kept:
                    lps = self.answer_logprobs if self.top_logprobs >= 0 and all(self.answer_logprobs) else None
                    self.writer.text(kept, list(self.answer_ids), 0, logprobs=lps)  # type: ignore[arg-type]
                    self._first_text_at = self.writer.elapsed()
            else:
                self.writer.continue_text(len(kept))
            self._text = kept
        if self.constraint is not None and self.answer_ids:
            self.constraint.reset(self.answer_ids)
        # Exact lookahead (`_lookahead`): this request's drafts and their acceptance; None when off.
        self.lookahead = lookahead_for(self.options.speculate, self.beams is not None)
        self.decode_steps = 0  # batched forwards that gave this request tokens (its first token excluded)
        # Generation health: a loop is flagged on the final event (and ends it with stop_on_repetition).
        self._loops = RepetitionDetector.of(self.answer_ids)
        self.repetition: dict[str, Any] | None = None

    # -- state ----------------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """Rows of the batch this request takes (its beams, or one)."""
        return 1 if self.beams is None else int(self.beams.k)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def uncached(self) -> list[int]:
        return self.context[self.prefilled :]

    @property
    def output_position(self) -> int:
        """Position of the next answer token (the counter of seeded sampling)."""
        return len(self.answer_ids)

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

    # -- edits: queued on the caller's thread, applied on the engine thread -------------------------

    def queue_edit(self, edit: Edit) -> None:
        with self._edits_lock:
            self._edits.append(edit)

    def take_edits(self) -> list[Edit]:
        with self._edits_lock:
            edits = list(self._edits)
            self._edits.clear()
        return edits

    @property
    def has_edits(self) -> bool:
        return bool(self._edits)

    def snap(self, offset: int) -> int:
        """How many answer tokens lie wholly before character ``offset`` (a rewind's cut)."""
        decode = self._detok._decode
        low, high = 0, len(self.answer_ids)
        while low < high:  # the largest k whose text ends at or before offset
            mid = (low + high + 1) // 2
            if len(decode(self.answer_ids[:mid])) <= offset:
                low = mid
            else:
                high = mid - 1
        return low

    def apply_edit(self, edit: Edit) -> int:
        """Change the context for a steer or rewind; returns how many context tokens stay cached.

        The text held back so far (partial characters, a possible stop string) is sent first
        for a steer; a rewind drops everything from its token boundary on and tells the client
        to replace from there (``offset``).
        """
        number = self.writer.new_revision()
        keep_cached = self.prefilled
        offset = len(self._text)
        if edit.kind == "steer":
            self._flush_held_back()
            offset = len(self._text)
            # The newest token is generated but not yet in the cache; it goes in with the instruction.
        else:
            k = self.snap(edit.offset if edit.offset is not None else len(self._text))
            cut = self.answer_pos[k] if k < len(self.answer_pos) else len(self.context)
            del self.context[cut:]
            del self.answer_ids[k:]
            del self.answer_pos[k:]
            del self.answer_logprobs[k:]
            self.rewinds += 1
            self.forced_token = edit.token_id
            self._detok = IncrementalDetokenizer(self.tokenizer)
            kept = self._detok.prime(self.answer_ids)
            self._stops = StopMatcher(list(self.options.stop))
            self._chunker = _Chunker(self.options.chunk_tokens, self.options.chunk_ms)
            self._chunker.index = len(self.answer_ids)
            self._text = kept
            offset = len(kept)
            self.writer.text("", [], len(self.answer_ids), offset=offset)  # "replace from here"
            keep_cached = min(self.prefilled, cut)
            if edit.sampler is not None:
                self.sampler = edit.sampler
            if self.constraint is not None:
                self.constraint.reset(self.answer_ids)
        self.context.extend(edit.inserted)
        # At least the last context token must go through the model again, for its logits.
        keep_cached = min(keep_cached, len(self.context) - 1)
        self.prefilled = keep_cached
        self.needs_prefill = True
        revision = {
            "kind": edit.kind, "step": self.generated, "offset": offset,
            "instruction": edit.instruction, "token_ids": list(edit.inserted),
        }
        self.revisions.append(revision)
        if self.on_edit is not None:
            try:
                self.on_edit({**revision, "revision": number, "at": len(self.answer_ids)})
            except Exception:  # noqa: BLE001 - the caller's hook must not fail the engine's other streams
                logger.exception("stream %s: on_edit raised; the edit stands", self.writer.stream_id)
        return keep_cached

    # -- tokens in, events out ------------------------------------------------------------------

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs >= 0

    def accept(self, token: int, logprob: dict[str, Any] | None = None, *, hold: bool = False) -> bool:
        """Take the next generated token (and its logprob entry, when the stream asked for them);
        emit what is ready (``hold``: not yet, more tokens of this step follow: `release`). True if
        the request has ended."""
        self.generated += 1
        self._token_times.append(self.writer.elapsed())
        if token in self.eos_token_ids:
            self.finish("stop")
            return True
        self.answer_pos.append(len(self.context))
        self.context.append(token)
        self.answer_ids.append(token)
        self.answer_logprobs.append(logprob)
        if self.constraint is not None:
            self.constraint.consume(token)
        safe, stopped = self._stops.feed(self._detok.feed(token))
        self._chunker.add(safe, token, logprob)
        if stopped:
            self.finish("stop_sequence")
            return True
        if not hold and self._chunker.ready():
            self._send()
        if self._repeating(token) and self.options.stop_on_repetition:
            self.finish("repetition")
            return True
        if self.constraint is not None and self.constraint.done:
            self.finish("stop")  # the grammar is complete: only EOS could follow, so end now
            return True
        if len(self.answer_ids) >= self.max_new_tokens or len(self.context) >= self.context_length:
            self.finish("length")
            return True
        return False

    def release(self) -> None:
        """Emit what is ready after tokens taken with ``accept(hold=True)``: several tokens of one
        step go out as one event."""
        if not self.done and self._chunker.ready():
            self._send()

    def _repeating(self, token: int) -> bool:
        """Feed the loop detector (rebuilt when an edit changed the answer); True once a loop is found."""
        if self._loops.count != len(self.answer_ids) - 1:
            self._loops = RepetitionDetector.of(self.answer_ids[:-1])
        if self._loops.feed(token) and self.repetition is None:
            self.repetition = dict(self._loops.found or {})
        return self.repetition is not None

    def accept_beams(self, logits: Any) -> list[int]:
        """Take one step's logits for the beams (one row after the prefill, then ``width`` rows);
        emit the best hypothesis; return each new beam's source row (finishing when the search is
        done)."""
        beams = self.beams
        source = beams.step(logits)
        self.generated += 1
        self._token_times.append(self.writer.elapsed())
        if beams.done:
            self.finish(beams.finish_reason)
        else:
            self._send_beams(final=False)
        return source

    def _send_beams(self, *, final: bool) -> tuple[str, list[int], int, int] | None:
        update = self.beams.update(self._detok._decode, final=final)
        if update is None:
            return None
        delta, ids, index, offset, committed = update
        self._text = self._text[:offset] + delta
        if final:
            return delta, ids, index, offset
        if self._first_text_at is None and self._text:
            self._first_text_at = self.writer.elapsed()
        self.writer.text(delta, ids, index, offset=offset, committed=committed)
        return None

    def _send(self) -> None:
        delta, ids, index = self._chunker.take()
        lps = self._chunker.take_logprobs()
        self._text += delta
        if self._first_text_at is None:
            self._first_text_at = self.writer.elapsed()
        self.writer.text(delta, ids, index, logprobs=lps if self.wants_logprobs else None)

    def _flush_held_back(self) -> None:
        tail, _ = self._stops.feed(self._detok.flush())
        self._chunker.add(tail + self._stops.flush(), None)
        if self._chunker.text:
            self._send()
        self._stops = StopMatcher(list(self.options.stop))

    def finish(self, reason: str) -> None:
        """Flush held-back text and emit the final event (once)."""
        if self.done:
            return
        self.finish_reason = reason
        self.own_cache = None
        self.share = None
        if self.beams is not None:
            self._finish_beams(reason)
            return
        if reason != "stop_sequence":
            tail, stopped = self._stops.feed(self._detok.flush())
            self._chunker.add(tail + self._stops.flush(), None)
            if stopped:
                self.finish_reason = reason = "stop_sequence"
        delta, ids, index = self._chunker.take()
        lps = self._chunker.take_logprobs()
        self._text += delta
        if self._first_text_at is None and delta:
            self._first_text_at = self.writer.elapsed()
        self._final_event(reason, delta, ids, index, offset=None, logprobs=lps if self.wants_logprobs else None)

    def _final_event(self, reason: str, delta: str, ids: list[int], index: int, *, offset: int | None,
                     logprobs: list[dict[str, Any]] | None = None) -> None:
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
        if self.lookahead is not None:
            metrics.update(drafted_tokens=float(self.lookahead.drafted), accepted_tokens=float(self.lookahead.accepted))
        metrics["decode_steps"] = float(self.decode_steps)
        if self.repetition is not None:  # flagged: the server counts it (multistream_repetition_loops_total)
            metrics.update(repetition_loops=1.0, repetition_period=float(self.repetition["period"]),
                           repetition_start=float(self.repetition["start"]))
        self.writer.finish_text(
            delta,
            ids,
            index,
            finish_reason=reason,
            text=self._text,
            # Every generated token counts, EOS included, as model.generate reports it.
            usage={"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.generated},
            metrics=metrics,
            revisions=self.revisions or None,
            offset=offset,
            logprobs=logprobs,
            tool_calls=self._tool_calls(),
        )
        if self.on_finish is not None:
            self.on_finish(self)

    def _tool_calls(self) -> list[dict[str, Any]] | None:
        """The calls in the answer, when tools were offered (else None: no ``tool_calls`` field)."""
        if not tools_active(self.options.tools, self.options.tool_choice):
            return None
        return parse_tool_calls(self._text, self.writer.stream_id)[1]

    def _finish_beams(self, reason: str) -> None:
        """The final event of a beam search: the best hypothesis, whole (and its tokens become the
        answer, so `TextModel.revise` can continue from it)."""
        answer = self.beams.best()
        self.answer_pos = list(range(len(self.prompt_ids), len(self.prompt_ids) + len(answer)))
        self.context = list(self.prompt_ids) + answer
        self.answer_ids = list(answer)
        # As generate counts them: every token of the answer, its EOS included.
        self.generated = len(self.beams.best_with_eos())
        delta, ids, index, offset = self._send_beams(final=True)  # type: ignore[misc]
        if self._first_text_at is None and self._text:
            self._first_text_at = self.writer.elapsed()
        self._final_event(reason, delta, ids, index, offset=offset)

    def fail(self, exc: BaseException) -> None:
        """End with an error event (a fault of the model on this request)."""
        if not self.done:
            self.finish_reason = "error"
            self.own_cache = None
            self.share = None
            self.writer.fail(exc)
