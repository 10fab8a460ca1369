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

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...access.keys import Principal
from ...http.bodies import read_body
from ...http.errors import json_body
from ...http.problems import Problem
from ...http.routes import RequestOnlyRoute
from ...state import ServerState, principal_of, state_of
from ...streams.registry import StreamRecord
from .._choices import collect_choices, interleave, open_choices
from .._common import ERRORS, chunk_events, error_body, sse_of
from .._protocol import check_options
from .protocol import CompletionRequest, parse_completion
from .serving import CompletionChunks, Echo

router = APIRouter(tags=["openai"], route_class=RequestOnlyRoute)  # the hot path: no FastAPI dependencies


async def _echo(state: ServerState, prompt: str, req: CompletionRequest, request: Request,
                principal: Principal) -> Echo:
    model = state.models["text"].get()
    if req.logprobs is None:
        count = getattr(model, "count_tokens", None)
        return Echo(prompt, count(prompt) if count else 0, None)
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
    return Echo(prompt, len(entries), entries)


@router.post("/v1/completions", responses=ERRORS, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    arrived = time.perf_counter()
    state, principal = state_of(request), principal_of(request)
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
    chunks = CompletionChunks(cid, created, model, total=len(prompts) * n, n=n, echoes=echoes,
                              logprobs=req.logprobs is not None, generate=generate,
                              include_usage=bool(req.stream_options is not None and req.stream_options.include_usage))

    if not req.stream:
        states = await collect_choices(records, request) if records else []
        failed = next((c.error for c in states if c.error is not None), None)
        if failed is not None:
            return JSONResponse(error_body(failed), status_code=500)
        return JSONResponse(chunks.completion(states), headers={"X-Stream-Id": ",".join(r.stream_id for r in records)})

    events = interleave(records) if records else _nothing()
    return sse_of(records, settings, chunk_events(chunks, events))


async def _nothing() -> AsyncIterator[tuple[int, Any]]:
    return
    yield  # an empty async generator
