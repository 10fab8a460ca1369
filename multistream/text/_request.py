"""One text request inside the engine, from submission to its final event.

A request is four parts, each written by one side (vLLM v1's split):

- `RequestSpec` (``spec``): what was asked, frozen at submission;
- `RowState` (``row``): its tokens and its row of the batch, the only part the batcher writes;
- `TextOutput` (``out``): detokenizer, stop strings, chunker, logprobs, metrics, final event;
  it owns the stream's writer;
- `EditQueue` (``edits``): steers and rewinds from the caller's thread.

`TextRequest` joins them with the request's decoding machinery (its sampler, grammar, beam
search) and says what a token means: `accept` takes the next token into the row and the output
and decides whether the request has ended.

Example (what `TextModel` submits to its engine):
    >>> request = TextRequest(spec, writer, tokenizer=tok, sampler=RowSampler(spec.plan))  # doctest: +SKIP
    >>> ended = request.accept(token)                                                      # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..stream import StreamWriter
from ._edits import Edit, EditQueue
from ._lookahead import lookahead_for
from ._output import TextOutput
from ._repetition import RepetitionDetector
from ._request_spec import RequestSpec
from ._row_state import RowState
from ._sampling import RowSampler

__all__ = ["Edit", "TextRequest"]

logger = logging.getLogger("multistream")


class TextRequest:
    """A text generation on the engine thread: spec, row state, output and edits (module docstring).

    ``constraint``: the stream's grammar (`TokenConstraint`: allowed=, json_schema=, tools=), or None.
    ``beams``: a beam search (`_beams.BeamSearch`) when ``num_beams`` > 1: the request then takes
    that many rows of the batch, and its events show the best hypothesis (`accept_beams`).
    ``share``: the `SharedPrompt` of an ``n``-choice request. ``on_finish``: called with the request
    once it has ended (the model keeps a few, for `TextModel.revise`).
    """

    def __init__(self, spec: RequestSpec, writer: StreamWriter, *, tokenizer: Any, sampler: RowSampler,
                 constraint: Any = None, beams: Any = None, token_table: Any = None, share: Any = None,
                 on_finish: Callable[[TextRequest], Any] | None = None) -> None:
        self.spec = spec
        self.sampler = sampler
        self.constraint = constraint
        self.beams = beams
        self.on_finish = on_finish
        self.finish_reason: str | None = None
        self.edits = EditQueue()
        self.out = TextOutput(writer, tokenizer, spec.options, token_table)
        self.row = RowState(context=list(spec.prompt_ids), share=share,
                            lookahead=lookahead_for(spec.options.speculate, beams is not None))
        row = self.row
        if spec.history is not None:
            context, answer_ids, answer_pos = spec.history
            row.context, row.answer_ids, row.answer_pos = list(context), list(answer_ids), list(answer_pos)
            row.generated = len(row.answer_ids)
            self.out.resume(row.answer_ids, spec.history_logprobs, echo=spec.echo_history)
        if constraint is not None and row.answer_ids:
            constraint.reset(row.answer_ids)
        # Generation health: a loop is flagged on the final event (and ends it with stop_on_repetition).
        self._loops = RepetitionDetector.of(row.answer_ids)
        self.repetition: dict[str, Any] | None = None
        edit = spec.first_edit
        if edit is not None:  # revise: the answer was cut before submission; its instruction and branch
            row.forced_token = edit.token_id
            row.context.extend(edit.inserted)
            self.out.revisions.append({"kind": "rewind", "step": 0, "offset": len(self.out.text),
                                       "instruction": edit.instruction, "token_ids": list(edit.inserted)})

    # -- state ----------------------------------------------------------------------------------

    @property
    def writer(self) -> StreamWriter:
        return self.out.writer

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def generated(self) -> int:
        """Tokens the model generated, EOS and rewound ones included (usage)."""
        return self.row.generated

    @property
    def answer_ids(self) -> list[int]:
        return self.row.answer_ids

    @property
    def answer_logprobs(self) -> list[dict[str, Any] | None]:
        """One logprob entry per answer token (None where unknown), when the stream asked for them."""
        return self.out.answer_logprobs

    @property
    def width(self) -> int:
        """Rows of the batch this request takes (its beams, or one)."""
        return 1 if self.beams is None else int(self.beams.k)

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

    # -- edits: queued on the caller's thread, applied on the engine thread -------------------------

    def snap(self, offset: int) -> int:
        """How many answer tokens lie wholly before character ``offset`` (a rewind's cut)."""
        answer = self.row.answer_ids
        low, high = 0, len(answer)
        while low < high:  # the largest k whose text ends at or before offset
            mid = (low + high + 1) // 2
            if len(self.out.decode(answer[:mid])) <= offset:
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
        row, out = self.row, self.out
        number = self.writer.new_revision()
        keep_cached = row.prefilled
        if edit.kind == "steer":
            out.flush_held_back()
            offset = len(out.text)
            # The newest token is generated but not yet in the cache; it goes in with the instruction.
        else:
            cut = row.cut(self.snap(edit.offset if edit.offset is not None else len(out.text)))
            row.rewinds += 1
            row.forced_token = edit.token_id
            offset = out.restart(row.answer_ids)
            keep_cached = min(row.prefilled, cut)
            if edit.sampler is not None:
                self.sampler = edit.sampler
            if self.constraint is not None:
                self.constraint.reset(row.answer_ids)
        row.context.extend(edit.inserted)
        # At least the last context token must go through the model again, for its logits.
        keep_cached = min(keep_cached, len(row.context) - 1)
        row.prefilled = keep_cached
        row.needs_prefill = True
        revision = {
            "kind": edit.kind, "step": row.generated, "offset": offset,
            "instruction": edit.instruction, "token_ids": list(edit.inserted),
        }
        out.revisions.append(revision)
        if self.spec.on_edit is not None:
            try:
                self.spec.on_edit({**revision, "revision": number, "at": len(row.answer_ids)})
            except Exception:  # noqa: BLE001 - the caller's hook must not fail the engine's other streams
                logger.exception("stream %s: on_edit raised; the edit stands", self.writer.stream_id)
        return keep_cached

    # -- tokens in, events out ------------------------------------------------------------------

    def accept(self, token: int, logprob: dict[str, Any] | None = None, *, hold: bool = False) -> bool:
        """Take the next generated token (and its logprob entry, when the stream asked for them);
        emit what is ready (``hold``: not yet, more tokens of this step follow: `release`). True if
        the request has ended."""
        row, spec = self.row, self.spec
        row.generated += 1
        self.out.tick()
        if token in spec.eos_token_ids:
            self.finish("stop")
            return True
        row.append(token)
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.out.feed(token, logprob):
            self.finish("stop_sequence")
            return True
        if not hold:
            self.out.send_if_ready()
        if self._repeating(token) and spec.options.stop_on_repetition:
            self.finish("repetition")
            return True
        if self.constraint is not None and self.constraint.done:
            self.finish("stop")  # the grammar is complete: only EOS could follow, so end now
            return True
        if self.at_length_limit():
            self.finish("length")
            return True
        return False

    def at_length_limit(self) -> bool:
        """The answer has its ``max_new_tokens``, or the context is full: no token may follow."""
        row, spec = self.row, self.spec
        return len(row.answer_ids) >= spec.max_new_tokens or len(row.context) >= spec.context_length

    def release(self) -> None:
        """Emit what is ready after tokens taken with ``accept(hold=True)``: several tokens of one
        step go out as one event."""
        if not self.done:
            self.out.send_if_ready()

    def _repeating(self, token: int) -> bool:
        """Feed the loop detector (rebuilt when an edit changed the answer); True once a loop is found."""
        answer = self.row.answer_ids
        if self._loops.count != len(answer) - 1:
            self._loops = RepetitionDetector.of(answer[:-1])
        if self._loops.feed(token) and self.repetition is None:
            self.repetition = dict(self._loops.found or {})
        return self.repetition is not None

    def accept_beams(self, logits: Any) -> list[int]:
        """Take one step's logits for the beams (one row after the prefill, then ``width`` rows);
        emit the best hypothesis; return each new beam's source row (finishing when the search is
        done)."""
        beams = self.beams
        source = beams.step(logits)
        self.row.generated += 1
        self.out.tick()
        if beams.done:
            self.finish(beams.finish_reason)
        else:
            self.out.send_beams(beams, final=False)
        return source

    def finish(self, reason: str) -> None:
        """Flush held-back text and emit the final event (once)."""
        if self.done:
            return
        self.finish_reason = reason
        self.row.release()
        if self.beams is not None:
            self._finish_beams(reason)
        else:
            self.finish_reason = self.out.finish(reason, usage=self._usage(), metrics=self._metrics())
        if self.on_finish is not None:
            self.on_finish(self)

    def _usage(self) -> dict[str, int]:
        # Every generated token counts, EOS included, as model.generate reports it.
        return {"prompt_tokens": len(self.spec.prompt_ids), "completion_tokens": self.row.generated}

    def _metrics(self) -> dict[str, float]:
        """The final event's metrics beyond timing: lookahead, steps, a flagged loop."""
        metrics: dict[str, float] = {}
        look = self.row.lookahead
        if look is not None:
            metrics.update(drafted_tokens=float(look.drafted), accepted_tokens=float(look.accepted))
        metrics["decode_steps"] = float(self.row.decode_steps)
        if self.row.cached_prompt_tokens:
            metrics["cached_prompt_tokens"] = float(self.row.cached_prompt_tokens)
        if self.repetition is not None:  # flagged: the server counts it (multistream_repetition_loops_total)
            metrics.update(repetition_loops=1.0, repetition_period=float(self.repetition["period"]),
                           repetition_start=float(self.repetition["start"]))
        return metrics

    def _finish_beams(self, reason: str) -> None:
        """The final event of a beam search: the best hypothesis, whole (and its tokens become the
        answer, so `TextModel.revise` can continue from it)."""
        row, prompt = self.row, list(self.spec.prompt_ids)
        answer = self.beams.best()
        row.answer_pos = list(range(len(prompt), len(prompt) + len(answer)))
        row.context = prompt + answer
        row.answer_ids = list(answer)
        # As generate counts them: every token of the answer, its EOS included.
        row.generated = len(self.beams.best_with_eos())
        self.out.finish_beams(self.beams, reason, usage=self._usage(), metrics=self._metrics())

    def fail(self, exc: BaseException) -> None:
        """End with an error event (a fault of the model on this request)."""
        if not self.done:
            self.finish_reason = "error"
            self.row.release()
            self.writer.fail(exc)
