"""`ScriptedTextModel`: a fake text model that streams a fixed script through a real `Stream`.

Example:
    >>> from multistream.testing import ScriptedTextModel
    >>> ScriptedTextModel(["a", "b"]).generate("hi").text
    'ab'
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._checks import is_int, is_number
from ..errors import InvalidArgumentError, PromptTooLongError
from ..events import Event, TextEvent
from ..stream import Stream, StreamWriter
from ..text import REWIND_OPTIONS, TEXT_STREAM_ARGS, StopMatcher, TextOptions, check_prompt, parse_text_options
from ._scripted import CountedModel, Counters, Steps, prompt_text, require, scheduled_stream

__all__ = ["DEFAULT_TOKENS", "ScriptedTextModel"]

DEFAULT_TOKENS: tuple[str, ...] = (
    "Streams", " carry", " tokens", " one", " by", " one", ",", " and", " previews",
    " step", " by", " step", ":", " the", " reader", " sees", " them", " as", " they", " come", ".",
)


# As the real model, revise() knows the newest 64 finished streams.
_KEPT_RECORDS = 64


@dataclasses.dataclass
class _Record:
    """What revise() reuses of one stream: its checked options, its prompt's length, and its
    answer's tokens (script positions) with the character where each one's text ends."""

    options: TextOptions
    prompt_tokens: int
    ids: list[int] = dataclasses.field(default_factory=list)
    ends: list[int] = dataclasses.field(default_factory=list)


class _TextEdits:
    """Queued steer/rewind commands of one scripted text stream (checked on the caller's thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[tuple[str, int | None, str | None]] = []
        self.branches: dict[int, int] = {}  # queue position -> token_id of a rewind that branches
        self.taken_branches: dict[int, int] = {}
        self.writer: StreamWriter | None = None

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name == "steer":
            require(not kwargs, f"text steer() takes one instruction string; got unknown {', '.join(sorted(kwargs))}")
            require(len(args) == 1 and isinstance(args[0], str) and args[0].strip() != "",
                     "steer() needs a non-empty instruction string, e.g. s.steer('make it shorter')")
            item: tuple[str, int | None, str | None] = ("steer", None, args[0])
        elif name == "rewind":
            (offset,) = args
            instruction = kwargs.pop("instruction", None)
            token_id = kwargs.pop("token_id", None)
            require(token_id is None or (is_int(token_id) and token_id >= 0),
                     f"token_id must be a token id (an integer >= 0), got {token_id!r}")
            unknown = sorted(set(kwargs) - set(REWIND_OPTIONS))
            require(not unknown, f"rewind() got unknown option(s) {unknown}; known ones are {list(REWIND_OPTIONS)}")
            parse_text_options(**kwargs)
            require(instruction is None or (isinstance(instruction, str) and instruction.strip() != ""),
                     "instruction must be a non-empty string or None")
            length = self.writer.text_length if self.writer is not None else 0
            require(is_int(offset) and 0 <= offset <= length,
                     f"offset must be an integer from 0 to {length} (the answer's length so far), got {offset!r}")
            item = ("rewind", int(offset), instruction)
        else:
            raise InvalidArgumentError(f"text streams do not support {name}()")
        with self._lock:
            if name == "rewind" and token_id is not None:
                self.branches[len(self._queue)] = int(token_id)
            self._queue.append(item)

    def take(self) -> list[tuple[str, int | None, str | None]]:
        with self._lock:
            taken, self._queue = self._queue, []
            self.taken_branches, self.branches = self.branches, {}
            return taken


class ScriptedTextModel(CountedModel):
    """A fake text model that streams a fixed list of tokens, ``delay_s`` apart.

    It stops after ``max_new_tokens`` tokens (``finish_reason="length"``) or at the end of the
    script (``"stop"``); a ``stop`` string ends it with ``"stop_sequence"`` (text held back as the
    real model does, so deltas never contain a stop string). ``fail_after=n`` raises after n tokens
    (the stream then ends with an ``error`` event). ``calls`` records each call's arguments;
    ``active`` counts running generations and ``finish_reasons`` lists how each one ended.

    Example:
        >>> llm = ScriptedTextModel(["a", "b", "c"], delay_s=0.0)
        >>> final = llm.generate("hi", max_new_tokens=2)
        >>> final.text, final.finish_reason
        ('ab', 'length')
        >>> llm.stream("hi", max_new_tokens=0)
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: max_new_tokens must be an integer >= 1, got 0
    """

    #: As `TextModel`: ``.stream()`` returns at once (a server may call it on its event loop).
    quick_stream_start = True

    def __init__(
        self,
        tokens: Sequence[str] | None = None,
        delay_s: float = 0.0,
        *,
        first_delay_s: float | None = None,
        fail_after: int | None = None,
        name: str = "scripted-text",
        context_length: int = 2048,
    ) -> None:
        require(tokens is None or (len(tokens) > 0 and all(isinstance(t, str) for t in tokens)),
                 "tokens must be a non-empty list of strings (or None for the default script)")
        require(is_number(delay_s) and delay_s >= 0, f"delay_s must be a number >= 0, got {delay_s!r}")
        self.tokens = list(tokens) if tokens is not None else list(DEFAULT_TOKENS)
        self.delay_s = float(delay_s)
        self.first_delay_s = self.delay_s if first_delay_s is None else float(first_delay_s)
        self.fail_after = fail_after
        self.name = name
        self.device = "cpu"
        self.context_length = context_length
        self.model: Any = None
        self.tokenizer: Any = None
        self.calls: list[dict[str, Any]] = []
        self._counters = Counters()
        # stream id -> what revise() reuses of a stream, as the real model keeps its newest 64 finished ones
        self._records: collections.OrderedDict[str, _Record] = collections.OrderedDict()

    def count_tokens(self, prompt: str | list[dict[str, str]]) -> int:
        """Whitespace tokens: good enough to exercise prompt-length limits."""
        return max(1, len(prompt_text(prompt).split()))

    def stream(self, prompt: str | list[dict[str, str]], **options: Any) -> Stream:
        """Validate the arguments now (as the real model does), then stream the script (`scheduled_stream`)."""
        checked = parse_text_options(**options)

        prompt = check_prompt(prompt)
        prompt_tokens = self.count_tokens(prompt)
        if prompt_tokens >= self.context_length:
            raise PromptTooLongError(
                f"the prompt has {prompt_tokens} tokens but the context window is {self.context_length}; "
                "shorten the prompt"
            )
        # What the model was asked: every option (its checked default when not given) as the caller wrote it.
        self.calls.append({"prompt": prompt, **{name: getattr(checked, name) for name in TEXT_STREAM_ARGS}, **options})
        self._counters.enter()
        edits = _TextEdits()
        return self._start(checked, prompt_tokens, edits)

    def _start(self, checked: TextOptions, prompt_tokens: int, edits: _TextEdits, prefix: str = "",
               kept: tuple[list[int], list[int]] = ([], []), instruction: str | None = None) -> Stream:
        record = _Record(checked, prompt_tokens)
        top = checked.top_logprobs if checked.wants_logprobs else -1
        stream = scheduled_stream(
            "text",
            lambda w: self._produce(w, prompt_tokens, checked.max_new_tokens, list(checked.stop), checked.chunk_tokens or 1,
                                    edits, prefix=prefix, instruction=instruction, top=top, kept=kept, record=record),
            edits.handle,
        )
        self._records[stream.stream_id] = record
        while len(self._records) > _KEPT_RECORDS:
            self._records.popitem(last=False)
        return stream

    def revise(self, final: Event, offset: int, instruction: str | None = None, *, token_id: int | None = None,
               **options: Any) -> Stream:
        """Regenerate a finished answer from character ``offset``: a new stream whose first event
        is the kept prefix (``offset`` 0, revision 0), then (revision 1) the script from its start.

        As the real model's, a revision keeps the original request's options (``max_new_tokens``,
        ``stop``, ``chunk_tokens``, ``top_logprobs``, ...; ``options`` override them, beams become
        1) and its prompt, and ``max_new_tokens`` counts the kept tokens too. Unlike the real
        model's, the kept prefix is exactly ``offset`` characters (a token cut in two counts as
        kept), and the final of a stream this fake did not run (or one of more than 64 ago)
        revises with the default options.

        Example:
            >>> llm = ScriptedTextModel(["ab", "cd"])
            >>> llm.revise(llm.generate("x"), 2).wait().text
            'ababcd'
        """
        require(isinstance(final, TextEvent) and final.is_final and final.text is not None,
                 "revise() needs the final text event of a finished answer")
        text = final.text or ""
        require(is_int(offset) and 0 <= offset <= len(text),
                 f"offset must be an integer from 0 to {len(text)} (the answer's length), got {offset!r}")
        require(instruction is None or (isinstance(instruction, str) and instruction.strip() != ""),
                 "instruction must be a non-empty string or None")
        require(token_id is None or (is_int(token_id) and token_id >= 0),
                 f"token_id must be a token id (an integer >= 0), got {token_id!r}")
        old = self._records.get(final.stream_id) or _Record(parse_text_options(), 1)
        merged = dataclasses.asdict(old.options)
        merged["num_beams"] = 1  # a revision continues the kept text token by token
        merged.update(options)
        checked = parse_text_options(**merged)
        # The kept tokens: every token of the answer that starts before offset (the last one cut there).
        k = sum(1 for start in [0, *old.ends[:-1]] if start < offset) if old.ends and offset else 0
        kept = (old.ids[:k], [*old.ends[: k - 1], offset] if k else [])
        self.calls.append({"revise": True, "offset": offset, "instruction": instruction, **options})
        self._counters.enter()
        edits = _TextEdits()
        if token_id is not None:
            edits.branches[-1] = int(token_id)
        return self._start(checked, old.prompt_tokens, edits, prefix=text[:offset], kept=kept, instruction=instruction)

    def generate(self, prompt: str | list[dict[str, str]], on_event: Callable[[Event], Any] | None = None,
                 **kwargs: Any) -> Event:
        """Stream to the end, calling ``on_event`` for each event; return the final event."""
        return self.stream(prompt, **kwargs).wait(on_event)

    def logprob_entry(self, token_id: int, top: int) -> dict[str, Any]:
        """The scripted logprobs of script token ``token_id``: made-up numbers, most likely first,
        with the next script tokens as its ``top`` alternatives (their ids are script positions, so
        a branch to one continues the script from there)."""

        def one(i: int, logprob: float) -> dict[str, Any]:
            raw = list(self.tokens[i].encode("utf-8"))
            return {"token_id": i, "token": self.tokens[i], "bytes": raw, "logprob": logprob}

        chosen = -0.05 - 0.9 * (token_id % 4)
        alts = [one(token_id, chosen)] + [one((token_id + r) % len(self.tokens), chosen - 0.6 * r)
                                          for r in range(1, max(top, 0))]
        return {**one(token_id, chosen), "top_logprobs": alts[: max(top, 0)]}

    def _produce(self, w: StreamWriter, prompt_tokens: int, max_new_tokens: int, stops: list[str],
                 chunk_tokens: int, edits: _TextEdits, prefix: str = "", instruction: str | None = None,
                 top: int = -1, kept: tuple[list[int], list[int]] = ([], []), record: _Record | None = None) -> Steps:
        reason = "error"
        edits.writer = w
        try:
            reason = yield from self._run(w, prompt_tokens, max_new_tokens, stops, chunk_tokens, edits, prefix,
                                          instruction, top, kept, record)
        finally:
            self._counters.leave(reason)

    def _run(self, w: StreamWriter, prompt_tokens: int, max_new_tokens: int, stops: list[str],
             chunk_tokens: int, edits: _TextEdits, prefix: str = "", instruction: str | None = None,
             top: int = -1, kept: tuple[list[int], list[int]] = ([], []), record: _Record | None = None) -> Steps:
        """The script, one token a step: yields the wait before each step (`scheduled_stream` runs
        it), returns the finish reason."""
        emitted = ""      # text already sent
        held = ""         # text not sent yet (chunking, or a possible start of a stop string)
        held_ids: list[int] = []
        held_lps: list[dict[str, Any]] = []
        cursor = 0  # the script position of the next token (a branch moves it)
        if -1 in edits.branches:  # revise(..., token_id=)
            cursor = edits.branches.pop(-1) % len(self.tokens)
        ids, ends = list(kept[0]), list(kept[1])  # each sent token and where its text ends in the answer
        first_index = len(ids)   # the answer position (in tokens) of the next event's first token
        completion = len(ids)    # as the real model's, a revision's kept tokens count
        stamps: list[float] = []
        reason: str | None = None
        matcher = StopMatcher(stops)
        revisions: list[dict[str, Any]] = []
        cut: int | None = None  # after a rewind: where the next delta begins
        if prefix:
            # A revise() stream: the kept part first, then the regenerated rest as revision 1.
            w.text(prefix, ids, 0, logprobs=[self.logprob_entry(i, top) for i in ids] if top >= 0 else None)
            emitted = prefix
        if prefix or instruction is not None:
            w.new_revision()
            revisions.append({"kind": "revise", "step": 0, "offset": len(prefix), "instruction": instruction})
        for n in range(max(max_new_tokens - len(kept[0]), 0)):
            yield self.first_delay_s if n == 0 else self.delay_s
            if w.cancelled:
                reason = "cancelled"
                break
            if w.finish_early_requested:
                reason = "finished_early"
                break
            for position, (kind, offset, text) in enumerate(edits.take()):
                w.new_revision()
                if kind == "rewind":
                    assert offset is not None
                    offset = min(offset, len(emitted))
                    emitted, held, held_ids, held_lps = emitted[:offset], "", [], []
                    branch = edits.taken_branches.get(position)
                    if branch is not None:
                        cursor = branch % len(self.tokens)
                    matcher = StopMatcher(stops)
                    cut = offset
                    keep = sum(1 for e in ends if e <= offset)
                    del ends[keep:], ids[keep:]
                    first_index = keep
                else:
                    offset = len(emitted)
                revisions.append({"kind": kind, "step": n, "offset": offset, "instruction": text})
            if self.fail_after is not None and n >= self.fail_after:
                raise RuntimeError(f"scripted failure after {n} tokens")
            if cursor >= len(self.tokens):
                reason = "stop"
                break
            completion += 1
            safe, stopped = matcher.feed(self.tokens[cursor])
            held += safe
            held_ids.append(cursor)
            if top >= 0:
                held_lps.append(self.logprob_entry(cursor, top))
            cursor += 1
            if stopped:
                reason = "stop_sequence"
                break
            if (completion - len(kept[0])) % chunk_tokens:  # the rest of a chunk goes out on the final, as on the model
                continue
            if held:
                w.text(held, held_ids, first_index, offset=cut, logprobs=held_lps if top >= 0 else None)
                cut = None
                stamps.append(w.elapsed())
                for i in held_ids:
                    ids.append(i)
                    ends.append((ends[-1] if ends else len(prefix)) + len(self.tokens[i]))
                emitted += held
                first_index += len(held_ids)
                held, held_ids, held_lps = "", [], []
        held += matcher.flush()
        emitted += held
        if record is not None:  # what revise() of this answer keeps
            for i in held_ids if held else []:
                ids.append(i)
                ends.append((ends[-1] if ends else len(prefix)) + len(self.tokens[i]))
            if ends:
                ends[-1] = len(emitted)  # a stop string held back shortens the last token
            record.ids, record.ends = ids, ends
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        duration = w.elapsed()
        metrics = {
            "ttft_ms": round(stamps[0] * 1000, 3) if stamps else None,
            "itl_ms_p50": round(statistics.median(gaps) * 1000, 3) if gaps else None,
            "itl_ms_p95": round(sorted(gaps)[int(0.95 * (len(gaps) - 1))] * 1000, 3) if gaps else None,
            "duration_ms": round(duration * 1000, 3),
            "tokens_per_s": round(completion / duration, 3) if duration > 0 else None,
        }
        reason = reason or "length"
        w.finish_text(held, held_ids if held else [], first_index, finish_reason=reason, text=emitted,
                      usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion},
                      metrics=metrics, revisions=revisions or None, offset=cut,  # type: ignore[arg-type]
                      logprobs=(held_lps if held else []) if top >= 0 else None)
        return reason
