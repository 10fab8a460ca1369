"""``POST /v1/completions``: OpenAI's legacy text completions, which lm-evaluation-harness,
LangChain's ``OpenAI`` class and many tools send.

- ``prompt``: a string or a list of strings (a raw completion: no chat template); token-id prompts
  are refused (send the text).
- ``max_tokens`` (OpenAI's default 16), ``temperature``, ``top_p``, ``stop``, ``seed``, ``n`` (up
  to 8 per prompt; choice ``index`` = prompt number * n + choice), ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, ``stream`` with ``stream_options.include_usage``, and
  vLLM's ``top_k``, ``min_p``, ``repetition_penalty``.
- ``logprobs``: an integer 0..20: the legacy ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`` per choice (raw model log-softmax, before temperature and penalties).
- ``echo``: the prompt comes first in each choice's text and, with ``logprobs``, the prompt's own
  logprobs come first (the first one null: nothing predicts it), so loglikelihood scoring works,
  also with ``max_tokens=0`` (no generation, only the prompt scored).
- ``suffix`` (insertion) and ``best_of`` other than ``n`` are refused in OpenAI's error shape.

Example:
    >>> from openai import OpenAI                                              # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # doctest: +SKIP
    >>> r = client.completions.create(model="default", prompt="The capital of France is",  # doctest: +SKIP
    ...                               max_tokens=0, echo=True, logprobs=1)
    >>> sum(r.choices[0].logprobs.token_logprobs[1:])                          # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....events import ErrorEvent, TextEvent
from ...access.security import Principal
from ...http.bodies import OpenAIErrorResponse, read_body
from ...http.errors import error_responses, json_body
from ...http.problems import Problem
from ...http.sse import DONE, event_source, json_event
from ...state import ServerState, get_principal, get_state
from ...streams.registry import StreamRecord
from .._choices import collect_choices, interleave, legacy_logprobs, open_choices, usage_of
from .._common import error_body, openai_finish
from .._protocol import check_options
from .protocol import CompletionRequest, parse_completion

router = APIRouter(tags=["openai"])


class _Echo:
    """One prompt's own text, token count and (with logprobs) its logprob entries."""

    def __init__(self, text: str, tokens: int, entries: list[dict[str, Any] | None] | None) -> None:
        self.text, self.tokens, self.entries = text, tokens, entries


async def _echo(state: ServerState, prompt: str, req: CompletionRequest, request: Request,
                principal: Principal) -> _Echo:
    model = state.models["text"].get()
    if req.logprobs is None:
        count = getattr(model, "count_tokens", None)
        return _Echo(prompt, count(prompt) if count else 0, None)
    if not callable(getattr(model, "score", None)):
        raise Problem(400, "unsupported", "this model cannot score prompts, so echo with logprobs is not available",
                      param="echo")

    def score(m: Any) -> Any:
        try:
            return m.score(prompt, top_logprobs=req.logprobs, chat=False)
        except Exception as exc:  # noqa: BLE001 - bad input is the client's 400, as for a stream
            raise Problem(400, "invalid_argument", str(exc), param="prompt") from None

    # Scoring is a prefill on the model's engine: it queues and takes a slot like a stream does.
    entries = await state.run_admitted("text", score, priority=req.priority or 0, request=request,
                                       principal=principal)
    return _Echo(prompt, len(entries), entries)


def _echo_texts(echo: _Echo) -> list[str]:
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


@router.post("/v1/completions", responses=error_responses(OpenAIErrorResponse), openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, state: ServerState = Depends(get_state),
                      principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    settings = state.settings
    req = parse_completion(await read_body(request, state), settings)
    state.check_model_name("text", req.model)
    prompts = req.prompts()
    n = req.n if req.n is not None else 1
    kwargs_list = [req.to_text_options(p, settings) for p in prompts]
    # max_tokens=0 (echo only) generates nothing; the other options are checked as a stream would be
    check_options({**kwargs_list[0], "max_new_tokens": max(1, kwargs_list[0].get("max_new_tokens", 1))})
    echoes = [await _echo(state, p, req, request, principal) for p in prompts] if req.echo else None
    generate = (req.max_tokens if req.max_tokens is not None else 16) > 0
    records: list[StreamRecord] = []
    try:
        if generate:
            for kwargs in kwargs_list:
                records += await open_choices(state, kwargs, n, priority=req.priority, request=request,
                                              arrived_at=arrived, principal=principal)
    except BaseException:
        for record in records:
            record.cancel()
        raise
    cid = f"cmpl-{records[0].stream_id}" if records else f"cmpl-{int(time.time() * 1000)}"
    created, model = int(time.time()), (records[0].model_name if records else state.models["text"].name)
    total = len(prompts) * n
    want = req.logprobs is not None

    def echo_of(i: int) -> _Echo | None:
        return echoes[i // n] if echoes is not None else None

    def choice_logprobs(i: int, entries: list[dict[str, Any]], start: int, with_echo: bool) -> Any:
        if not want:
            return None
        echo = echo_of(i) if with_echo else None
        if echo is not None and echo.entries is not None:
            prompt_part = legacy_logprobs(echo.entries, _echo_texts(echo))
            rest = legacy_logprobs(entries, start=len(echo.text))
            return {k: prompt_part[k] + rest[k] for k in prompt_part}
        return legacy_logprobs(entries, start=start)

    if not req.stream:
        states = await collect_choices(records, request) if records else []
        failed = next((c.error for c in states if c.error is not None), None)
        if failed is not None:
            return JSONResponse(error_body(failed), status_code=500)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i in range(total):
            echo = echo_of(i)
            c = states[i] if states else None
            final = c.final if c is not None else None
            text = (echo.text if echo is not None else "") + (final.text or "" if final is not None else "")
            if final is not None and final.usage:
                completion_tokens += final.usage["completion_tokens"]
                if i % n == 0:
                    prompt_tokens += final.usage["prompt_tokens"]
            elif echo is not None and i % n == 0:
                prompt_tokens += echo.tokens
            reason = openai_finish(final.finish_reason) if final is not None else "length"
            choices.append({"index": i, "text": text, "finish_reason": reason,
                            "logprobs": choice_logprobs(i, c.entries if c is not None else [], 0, True)})
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "system_fingerprint": None, "choices": choices,
                             "usage": usage_of(prompt_tokens, completion_tokens)},
                            headers={"X-Stream-Id": ",".join(r.stream_id for r in records)})

    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)

    def chunk(i: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    async def events() -> AsyncIterator[ServerSentEvent]:
        prompt_tokens, completion_tokens = 0, 0
        sent = [0] * total  # characters of each choice's completion sent so far (text_offset)
        for i in range(total):
            echo = echo_of(i)
            if echo is not None:
                yield json_event(chunk(i, echo.text, choice_logprobs(i, [], 0, True), None if generate else "length"))
                if not generate and i % n == 0:
                    prompt_tokens += echo.tokens
        async for i, ev in interleave(records) if records else _nothing():
            if isinstance(ev, ErrorEvent):
                yield json_event(error_body(ev))
                return
            assert isinstance(ev, TextEvent)
            echo = echo_of(i)
            base = len(echo.text) if echo is not None else 0
            finish = openai_finish(ev.finish_reason) if ev.is_final else None
            if ev.delta or ev.is_final:
                lp = legacy_logprobs(ev.logprobs or [], start=base + sent[i]) if want else None
                yield json_event(chunk(i, ev.delta, lp, finish))
                sent[i] += len(ev.delta)
            if ev.is_final and ev.usage:
                completion_tokens += ev.usage["completion_tokens"]
                if i % n == 0:
                    prompt_tokens += ev.usage["prompt_tokens"]
        if include_usage:
            yield json_event({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [], "usage": usage_of(prompt_tokens, completion_tokens)})
        yield ServerSentEvent(data=DONE)

    return event_source(events(), settings, ",".join(r.stream_id for r in records))


async def _nothing() -> AsyncIterator[tuple[int, Any]]:
    return
    yield  # an empty async generator
