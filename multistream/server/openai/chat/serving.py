"""Chat completions from text events: `ChatChunks` turns the events of a request's ``n`` streams
into OpenAI's ``chat.completion.chunk`` objects (streaming) or one ``chat.completion`` (not), a
pure translator: no server, no I/O, testable with hand-made events.

What it writes: the role chunk of each choice first; then the content as it comes (with
``logprobs`` when asked); a tool call as ``tool_calls`` deltas (id, type and name first, then the
``arguments`` in fragments); with beams only the committed text (OpenAI chunks can only append);
each choice's last chunk with its ``finish_reason``; the usage chunk last when asked.

Example:
    >>> from multistream.events import TextEvent
    >>> chunks = ChatChunks("chatcmpl-1", 0, "m", ["s1"])
    >>> [c["choices"][0]["delta"] for c in chunks.opening()]
    [{'role': 'assistant', 'content': ''}]
    >>> ev = TextEvent(stream_id="s1", seq=0, t=0.0, is_final=False, delta="Hi", token_ids=[7], index=0)
    >>> chunks.feed(0, ev)[0]["choices"][0]["delta"]
    {'content': 'Hi'}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....events import ErrorEvent, Event, TextEvent
from ....text import ToolCallParser, parse_tool_calls
from .._choices import ChoiceState, cached_tokens_of, chat_logprobs, usage_of
from .._common import error_body, openai_finish

__all__ = ["ChatChunks"]


class ChatChunks:
    """The chunks of one chat completion whose choices are the streams ``stream_ids``.

    ``with_tools``: parse tool calls out of the text; ``beams``: send only committed text;
    ``logprobs``: attach each event's log-probabilities; ``continuous_usage``: every chunk carries
    the usage so far (vLLM's); ``include_usage``: a last chunk carries it (OpenAI's).
    """

    def __init__(self, cid: str, created: int, model: str, stream_ids: Sequence[str], *, with_tools: bool = False,
                 beams: bool = False, logprobs: bool = False, continuous_usage: bool = False,
                 include_usage: bool = False) -> None:
        self.cid, self.created, self.model = cid, created, model
        self.stream_ids = list(stream_ids)
        self.with_tools, self.beams, self.logprobs = with_tools, beams, logprobs
        self.continuous_usage, self.include_usage = continuous_usage, include_usage
        self.failed = False  # an error event came: the stream ends after its chunk
        self._prompt_tokens = self._cached_tokens = 0
        self._done: dict[int, int] = {}  # completion tokens of each choice, as they go
        self._parsers = {i: ToolCallParser(sid) for i, sid in enumerate(self.stream_ids)} if with_tools else {}
        self._texts: dict[int, str] = {}  # with beams: each choice's text so far,
        self._sent: dict[int, int] = {}  # and how much of it went out

    def chunk(self, delta: dict[str, Any], finish: str | None = None, index: int = 0,
              logprobs: Any = None) -> dict[str, Any]:
        return {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": None,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    @staticmethod
    def finish_reason(ev: TextEvent, called: bool) -> str:
        return "tool_calls" if called else openai_finish(ev.finish_reason)

    def opening(self) -> list[dict[str, Any]]:
        """Each choice's first chunk: the assistant's role."""
        return [self.chunk({"role": "assistant", "content": ""}, index=i) for i in range(len(self.stream_ids))]

    def feed(self, i: int, ev: Event) -> list[dict[str, Any]]:
        """The chunks event ``ev`` of choice ``i`` makes (an error: its body, and `failed` is set)."""
        if isinstance(ev, ErrorEvent):
            self.failed = True
            return [error_body(ev)]
        assert isinstance(ev, TextEvent)
        if ev.token_ids:
            self._done[i] = max(self._done.get(i, 0), ev.index + len(ev.token_ids))
        if ev.is_final and ev.usage:
            self._prompt_tokens, self._done[i] = ev.usage["prompt_tokens"], ev.usage["completion_tokens"]
            self._cached_tokens = max(self._cached_tokens, cached_tokens_of(ev))  # n choices: one prompt
        extra = {"usage": self._usage()} if self.continuous_usage else {}
        logprobs = chat_logprobs(ev.logprobs) if self.logprobs and ev.logprobs else None
        parser = self._parsers.get(i)
        out: list[dict[str, Any]] = []
        if self.beams:
            # OpenAI chunks can only append: send the text that can no longer change.
            text = self._texts[i] = self._texts.get(i, "")[: ev.offset] + ev.delta
            end = len(text) if ev.is_final else min(ev.committed, len(text))
            if end > self._sent.get(i, 0):
                out.append({**self.chunk({"content": text[self._sent.get(i, 0):end]}, index=i), **extra})
                self._sent[i] = end
        elif parser is not None:
            items = parser.feed(ev.delta) + (parser.finish() if ev.is_final else [])
            out.extend({**self.chunk(delta, index=i), **extra} for delta in _tool_deltas(items))
        elif ev.delta or logprobs is not None:
            out.append({**self.chunk({"content": ev.delta}, index=i, logprobs=logprobs), **extra})
        if ev.is_final:
            called = bool(parser is not None and parser.calls)
            out.append({**self.chunk({}, self.finish_reason(ev, called), index=i), **extra})
        return out

    def closing(self) -> list[dict[str, Any]]:
        """After every choice ended: the usage chunk, when asked."""
        if not self.include_usage:
            return []
        return [{**self.chunk({}), "choices": [], "usage": self._usage()}]

    def _usage(self) -> dict[str, int]:
        return usage_of(self._prompt_tokens, sum(self._done.values()), self._cached_tokens)

    def completion(self, states: Sequence[ChoiceState]) -> dict[str, Any]:
        """The whole ``chat.completion`` of choices that all ended with a final event."""
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i, c in enumerate(states):
            final = c.final
            assert final is not None
            u = final.usage or {"prompt_tokens": 0, "completion_tokens": 0}
            prompt_tokens, completion_tokens = u["prompt_tokens"], completion_tokens + u["completion_tokens"]
            cached = max(cached, cached_tokens_of(final))
            message: dict[str, Any] = {"role": "assistant", "content": final.text or ""}
            calls = final.tool_calls or []
            if self.with_tools:
                content, _ = parse_tool_calls(final.text or "", self.stream_ids[i])
                message["content"] = content or (None if calls else "")
                if calls:
                    message["tool_calls"] = [{"id": call["id"], "type": "function",
                                              "function": {"name": call["name"], "arguments": call["arguments"]}}
                                             for call in calls]
            choices.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(c.entries) if self.logprobs else None,
                            "finish_reason": self.finish_reason(final, bool(calls))})
        return {"id": self.cid, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices,
                "usage": usage_of(prompt_tokens, completion_tokens, cached)}


def _tool_deltas(items: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Chunk deltas for what the tool-call parser read: content, a call's head, its argument fragments."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item[0] == "content":
            out.append({"content": item[1]})
        elif item[0] == "call":
            _, index, call_id, name = item
            out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        else:
            out.append({"tool_calls": [{"index": item[1], "function": {"arguments": item[2]}}]})
    return out
