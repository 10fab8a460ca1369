"""Legacy text completions from text events: `CompletionChunks` turns the events of a request's
choices (``len(prompts) * n``; choice ``i`` answers prompt ``i // n``) into ``text_completion``
chunks (streaming) or one ``text_completion`` (not), with ``echo`` (the prompt first, and its own
logprobs with ``logprobs``) and the legacy ``logprobs`` object; a pure translator, testable with
hand-made events.

Example:
    >>> from multistream.events import TextEvent
    >>> chunks = CompletionChunks("cmpl-1", 0, "m", total=1, n=1)
    >>> ev = TextEvent(stream_id="s", seq=0, t=0.0, is_final=False, delta="Paris", token_ids=[5], index=0)
    >>> chunks.feed(0, ev)[0]["choices"][0]["text"]
    'Paris'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ....events import ErrorEvent, Event, TextEvent
from .._choices import ChoiceState, cached_tokens_of, legacy_logprobs, usage_of
from .._common import error_body, openai_finish

__all__ = ["CompletionChunks", "Echo"]


@dataclass
class Echo:
    """One prompt's own text, token count and (with logprobs) its logprob entries."""

    text: str
    tokens: int
    entries: list[dict[str, Any] | None] | None


def _echo_texts(echo: Echo) -> list[str]:
    """Each prompt token's text, so ``text_offset`` counts characters of the prompt: the tokens after
    the first from their bytes (a character split over tokens goes with the token that completes
    it), the first one (no entry: nothing predicts it) is what precedes them."""
    assert echo.entries is not None
    rest = [e for e in echo.entries[1:] if e is not None]
    lengths, raw = [], b""
    for e in rest:
        raw += bytes(e["bytes"])
        lengths.append(len(raw.decode("utf-8", errors="ignore")))
    first = max(0, len(echo.text) - (lengths[-1] if lengths else 0))
    out, before = [echo.text[:first]], 0
    for now in lengths:
        out.append(echo.text[first + before : first + now])
        before = now
    return out


class CompletionChunks:
    """The chunks of one completion request of ``total`` choices, ``n`` per prompt.

    ``echoes``: each prompt's `Echo` (with ``echo``); ``logprobs``: the legacy object is wanted;
    ``generate``: False for ``max_tokens=0`` (the echo only); ``include_usage``: a last chunk
    carries the usage.
    """

    def __init__(self, cid: str, created: int, model: str, *, total: int, n: int,
                 echoes: Sequence[Echo] | None = None, logprobs: bool = False, generate: bool = True,
                 include_usage: bool = False) -> None:
        self.cid, self.created, self.model = cid, created, model
        self.total, self.n, self.echoes = total, n, echoes
        self.logprobs, self.generate, self.include_usage = logprobs, generate, include_usage
        self.failed = False  # an error event came: the stream ends after its chunk
        self._prompt_tokens = self._completion_tokens = self._cached_tokens = 0
        self._sent = [0] * total  # characters of each choice's completion sent so far (text_offset)

    def _echo_of(self, i: int) -> Echo | None:
        return self.echoes[i // self.n] if self.echoes is not None else None

    def _choice_logprobs(self, i: int, entries: list[dict[str, Any]], start: int, with_echo: bool) -> Any:
        if not self.logprobs:
            return None
        echo = self._echo_of(i) if with_echo else None
        if echo is not None and echo.entries is not None:
            prompt_part = legacy_logprobs(echo.entries, _echo_texts(echo))
            rest = legacy_logprobs(entries, start=len(echo.text))
            return {k: prompt_part[k] + rest[k] for k in prompt_part}
        return legacy_logprobs(entries, start=start)

    def chunk(self, i: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def opening(self) -> list[dict[str, Any]]:
        """The echoed prompts first (the whole answer when nothing is generated)."""
        out = []
        for i in range(self.total):
            echo = self._echo_of(i)
            if echo is not None:
                out.append(self.chunk(i, echo.text, self._choice_logprobs(i, [], 0, True),
                                      None if self.generate else "length"))
                if not self.generate and i % self.n == 0:
                    self._prompt_tokens += echo.tokens
        return out

    def feed(self, i: int, ev: Event) -> list[dict[str, Any]]:
        """The chunks event ``ev`` of choice ``i`` makes (an error: its body, and `failed` is set)."""
        if isinstance(ev, ErrorEvent):
            self.failed = True
            return [error_body(ev)]
        assert isinstance(ev, TextEvent)
        out = []
        echo = self._echo_of(i)
        base = len(echo.text) if echo is not None else 0
        if ev.delta or ev.is_final:
            finish = openai_finish(ev.finish_reason) if ev.is_final else None
            lp = legacy_logprobs(ev.logprobs or [], start=base + self._sent[i]) if self.logprobs else None
            out.append(self.chunk(i, ev.delta, lp, finish))
            self._sent[i] += len(ev.delta)
        if ev.is_final and ev.usage:
            self._completion_tokens += ev.usage["completion_tokens"]
            if i % self.n == 0:
                self._prompt_tokens += ev.usage["prompt_tokens"]
                self._cached_tokens += cached_tokens_of(ev)
        return out

    def closing(self) -> list[dict[str, Any]]:
        """After every choice ended: the usage chunk, when asked."""
        if not self.include_usage:
            return []
        return [{"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [], "usage": usage_of(self._prompt_tokens, self._completion_tokens, self._cached_tokens)}]

    def completion(self, states: Sequence[ChoiceState]) -> dict[str, Any]:
        """The whole ``text_completion`` (``states``: each choice's, none when nothing was generated)."""
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i in range(self.total):
            echo = self._echo_of(i)
            c = states[i] if states else None
            final = c.final if c is not None else None
            text = (echo.text if echo is not None else "") + (final.text or "" if final is not None else "")
            if final is not None and final.usage:
                completion_tokens += final.usage["completion_tokens"]
                if i % self.n == 0:
                    prompt_tokens += final.usage["prompt_tokens"]
                    cached += cached_tokens_of(final)
            elif echo is not None and i % self.n == 0:
                prompt_tokens += echo.tokens
            reason = openai_finish(final.finish_reason) if final is not None else "length"
            choices.append({"index": i, "text": text, "finish_reason": reason,
                            "logprobs": self._choice_logprobs(i, c.entries if c is not None else [], 0, True)})
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices,
                "usage": usage_of(prompt_tokens, completion_tokens, cached)}
