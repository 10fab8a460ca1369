"""The Responses API's events from a stream's events: `ResponseBuilder` folds a text stream's events
into the typed Responses event stream (``response.created`` ... ``response.completed``, each with
its ``sequence_number``) and the response object; a pure translator, testable without a server.

The typed stream is a pure function of the stream's events (and the response's stored request),
so nothing but the stream's own event log is stored: ``GET /v1/responses/{id}?stream=true&
starting_after=N`` replays by folding the log again and skipping sequence numbers up to N, then
follows live; a stream continued after a restart or a failover keeps the same numbering.

Example:
    >>> from multistream.events import TextEvent
    >>> b = ResponseBuilder("resp_1", "s1", {"model": "m", "created_at": 1})
    >>> [e["type"] for e in b.start()]
    ['response.created', 'response.in_progress']
    >>> ev = TextEvent(stream_id="s1", seq=0, t=0.0, delta="Hello", token_ids=[1], index=0)
    >>> [e["type"] for e in b.feed(ev)]
    ['response.output_item.added', 'response.content_part.added', 'response.output_text.delta']
"""

from __future__ import annotations

from typing import Any

from ....events import ErrorEvent, Event, TextEvent
from ....text import ToolCallParser
from .._choices import cached_tokens_of

# -- the typed event stream ----------------------------------------------------------------------


def _usage(final: TextEvent | None) -> dict[str, Any] | None:
    if final is None or not final.usage:
        return None
    p, c = int(final.usage.get("prompt_tokens", 0)), int(final.usage.get("completion_tokens", 0))
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached_tokens_of(final)}, "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


class ResponseBuilder:
    """Folds one text stream's events into Responses events and the response object. Pure and
    deterministic: the same events give the same typed stream, ``sequence_number`` included."""

    def __init__(self, response_id: str, stream_id: str, view: dict[str, Any], *, tools: bool = False) -> None:
        self.id = response_id
        self.stream_id = stream_id
        self.view = view
        self.seq = -1
        self.status = "queued" if view.get("background") else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.final: TextEvent | None = None
        self.parser = ToolCallParser(stream_id) if tools else None
        self._message: int | None = None  # output index of the open message item
        self._messages = 0
        self._calls: dict[int, int] = {}  # parser call index -> output index

    # -- the response object -------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        v = self.view
        return {"id": self.id, "object": "response", "created_at": v.get("created_at", 0), "status": self.status,
                "background": v.get("background", False), "error": self.error,
                "incomplete_details": self.incomplete, "instructions": v.get("instructions"),
                "max_output_tokens": v.get("max_output_tokens"), "model": v.get("model") or "default",
                "output": [dict(item) for item in self.output], "parallel_tool_calls": v.get("parallel_tool_calls", True),
                "previous_response_id": v.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
                "service_tier": "default", "store": v.get("store", True), "temperature": v.get("temperature", 1.0),
                "text": v.get("text") or {"format": {"type": "text"}}, "tool_choice": v.get("tool_choice", "auto"),
                "tools": v.get("tools", []), "top_p": v.get("top_p", 1.0), "truncation": "disabled",
                "usage": _usage(self.final), "user": None, "metadata": v.get("metadata") or {}}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def start(self) -> list[dict[str, Any]]:
        out = [self._event("response.created", response=self.response())]
        if self.status == "queued":
            out.append(self._event("response.queued", response=self.response()))
        self.status = "in_progress"
        out.append(self._event("response.in_progress", response=self.response()))
        return out

    # -- items ---------------------------------------------------------------------------------

    def _open_message(self) -> list[dict[str, Any]]:
        item_id = f"msg_{self.stream_id}" + (f"_{self._messages}" if self._messages else "")
        self._messages += 1
        self._message = len(self.output)
        item = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=self._message, item=dict(item, content=[])),
                self._event("response.content_part.added", item_id=item_id, output_index=self._message,
                            content_index=0, part=dict(part))]

    def _text(self, delta: str) -> list[dict[str, Any]]:
        out = self._open_message() if self._message is None else []
        assert self._message is not None
        item = self.output[self._message]
        if not item["content"]:
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        item["content"][0]["text"] += delta
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                               content_index=0, delta=delta, logprobs=[]))
        return out

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.output[index]
        part = item["content"][0] if item["content"] else {"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []}
        item["content"] = [part]
        item["status"] = "completed"
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _call(self, index: int, call_id: str, name: str) -> list[dict[str, Any]]:
        out = self._close_message()
        self._calls[index] = len(self.output)
        item = {"id": f"fc_{call_id}", "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=self._calls[index], item=dict(item)))
        return out

    def _arguments(self, index: int, fragment: str) -> list[dict[str, Any]]:
        at = self._calls[index]
        item = self.output[at]
        item["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                            delta=fragment)]

    def _close_calls(self) -> list[dict[str, Any]]:
        out = []
        calls = {c["id"]: c for c in (self.parser.calls if self.parser is not None else [])}
        for at in self._calls.values():
            item = self.output[at]
            if item["status"] != "in_progress":
                continue
            parsed = calls.get(item["call_id"])
            if parsed is not None:
                item["arguments"] = parsed["arguments"]
            item["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                   name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=at, item=dict(item)))
        return out

    # -- events --------------------------------------------------------------------------------

    def feed(self, ev: Event) -> list[dict[str, Any]]:
        """The Responses events that the stream event ``ev`` makes (the stream's events in order)."""
        if isinstance(ev, ErrorEvent):
            out = self._close_message() + self._close_calls()
            self.status = "failed"
            self.error = {"code": "server_error", "message": str(ev.error.get("message", "generation failed"))}
            return out + [self._event("response.failed", response=self.response())]
        if not isinstance(ev, TextEvent):
            return []
        out: list[dict[str, Any]] = []
        if self.parser is not None:
            items = self.parser.feed(ev.delta) + (self.parser.finish() if ev.is_final else [])
            for item in items:
                if item[0] == "content":
                    if item[1]:
                        out += self._text(item[1])
                elif item[0] == "call":
                    out += self._call(item[1], item[2], item[3])
                else:
                    out += self._arguments(item[1], item[2])
        elif ev.delta:
            out += self._text(ev.delta)
        if not ev.is_final:
            return out
        self.final = ev
        if not self.output:  # an empty answer still has its (empty) message
            out += self._open_message()
        out += self._close_message() + self._close_calls()
        reason = ev.finish_reason or "stop"
        if reason == "cancelled":
            self.status = "cancelled"
            return out + [self._event("response.incomplete", response=self.response())]
        if reason in ("length", "content_filter", "repetition"):
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens" if reason == "length" else reason}
            return out + [self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return out + [self._event("response.completed", response=self.response())]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item.get("content", [])]}


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished response's output as chat messages (what ``previous_response_id`` carries on)."""
    text, calls = "", []
    for item in response.get("output", []):
        if item.get("type") == "message":
            text += "".join(p.get("text", "") for p in item.get("content", []))
        elif item.get("type") == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
