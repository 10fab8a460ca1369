"""What the OpenAI text routes share: ``n`` choices opened as ``n`` streams of one prompt (prefilled
once where the model can), their events interleaved with their choice ``index``, and the two
logprob shapes OpenAI clients read (chat's ``logprobs.content[]`` and the legacy completions
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``).

Example:
    >>> entry = {"token_id": 9, "token": "Hi", "bytes": [72, 105], "logprob": -0.1,
    ...          "top_logprobs": [{"token_id": 9, "token": "Hi", "bytes": [72, 105], "logprob": -0.1}]}
    >>> chat_logprobs([entry])["content"][0]["token"]
    'Hi'
    >>> legacy_logprobs([None, entry], ["a", "Hi"])["text_offset"]
    [0, 1]
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from ...events import ErrorEvent, Event, TextEvent
from ...text import choice_seed
from ..access.keys import Principal
from ..http.disconnect import until_done_or_gone
from ..http.problems import Problem
from ..state import ServerState
from ..streams.registry import StreamRecord

__all__ = ["ChoiceState", "MAX_CHOICES", "chat_logprobs", "collect_choices", "interleave", "legacy_logprobs",
           "open_choices", "usage_of"]

MAX_CHOICES = 8


def _alternative(e: dict[str, Any]) -> dict[str, Any]:
    return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["bytes"])}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat's ``choices[].logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}``."""
    content = [{**_alternative(e), "top_logprobs": [_alternative(t) for t in e.get("top_logprobs") or []]}
               for e in entries]
    return {"content": content, "refusal": None}


def legacy_logprobs(entries: list[dict[str, Any] | None], texts: list[str] | None = None,
                    start: int = 0) -> dict[str, Any]:
    """The completions ``logprobs`` object. ``None`` entries (the first prompt token of an echo)
    give a null logprob and null alternatives; ``texts`` (each token's text, default its ``token``)
    give ``text_offset``, counted from ``start``."""
    tokens, values, tops, offsets = [], [], [], []
    at = start
    for i, e in enumerate(entries):
        text = texts[i] if texts is not None else (e["token"] if e is not None else "")
        offsets.append(at)
        at += len(text)
        tokens.append(e["token"] if e is not None else text)
        values.append(e["logprob"] if e is not None else None)
        if e is None:
            tops.append(None)
        else:
            top: dict[str, float] = {}
            for alt in e.get("top_logprobs") or []:
                top.setdefault(alt["token"], alt["logprob"])
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens`` when the prefix cache served
    part of the prompt (as OpenAI and vLLM report it)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def cached_tokens_of(final: TextEvent | None) -> int:
    """The prompt tokens of a text stream that came from the prefix cache (its final's metrics)."""
    return int(((final.metrics if final is not None else None) or {}).get("cached_prompt_tokens", 0))


async def open_choices(state: ServerState, kwargs: dict[str, Any], n: int, *, priority: int, request: Request,
                       arrived_at: float, principal: Principal) -> list[StreamRecord]:
    """``n`` streams of one request. Choice ``i`` is seeded from ``(seed, i)``; a model that can
    (`TextModel.share_prompt`) prefills the prompt once for all of them."""
    if not 1 <= n <= MAX_CHOICES:
        raise Problem(400, "invalid_argument", f"n must be from 1 to {MAX_CHOICES}, got {n}", param="n")
    if n == 1:
        return [await state.open_stream("text", kwargs, priority=priority, request=request, resumable=False,
                                        arrived_at=arrived_at, principal=principal)]
    slot = state.models["text"]
    model = slot.get()
    share = model.share_prompt(n) if callable(getattr(model, "share_prompt", None)) else None
    records: list[StreamRecord] = []
    try:
        for i in range(n):
            kw = dict(kwargs)
            if kw.get("seed") is not None:
                kw["seed"] = choice_seed(int(kw["seed"]), i)
            if share is not None:
                kw["share"] = share
            records.append(await state.open_stream("text", kw, priority=priority, request=request,
                                                   resumable=False, arrived_at=arrived_at, principal=principal))
    except BaseException:
        for record in records:
            record.cancel()
        raise
    return records


async def interleave(records: list[StreamRecord]) -> AsyncIterator[tuple[int, Event]]:
    """``(choice index, event)`` from every record as each arrives, until every one has ended."""
    if len(records) == 1:
        async for ev in records[0].subscribe():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(i: int, record: StreamRecord) -> None:
        try:
            async for ev in record.subscribe():
                await queue.put((i, ev))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(records)]
    try:
        left = len(records)
        while left:
            i, ev = await queue.get()
            if ev is None:
                left -= 1
            else:
                yield i, ev
    finally:
        for task in tasks:
            task.cancel()
        for record in records:
            if not record.done:
                record.cancel()


@dataclass
class ChoiceState:
    """One choice's answer as its events arrive: text (offsets applied), logprob entries (by token
    index, so a rewind's cut applies to them too) and the final event."""

    text: str = ""
    entries: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    final: TextEvent | None = None
    error: ErrorEvent | None = None

    def add(self, ev: Event) -> None:
        if isinstance(ev, ErrorEvent):
            self.error = ev
            return
        assert isinstance(ev, TextEvent)
        self.text = self.text[: ev.offset] + ev.delta
        if ev.logprobs is not None:
            self.entries = self.entries[: ev.index] + list(ev.logprobs)
        self.tokens = max(self.tokens, ev.index + len(ev.token_ids)) if ev.token_ids else self.tokens
        if ev.is_final:
            self.final = ev


async def collect_choices(records: list[StreamRecord], request: Request) -> list[ChoiceState]:
    """Every event of every choice, for the non-streaming routes; a client that goes away
    meanwhile cancels the generations instead of leaving them running to the end."""
    states = [ChoiceState() for _ in records]

    async def collect() -> None:
        async for i, ev in interleave(records):
            states[i].add(ev)

    def cancel_all() -> None:
        for record in records:
            record.cancel()

    await until_done_or_gone(collect(), request, on_gone=cancel_all)
    return states
