"""OpenAI's ``POST /v1/images/generations``: prompt, n, size ("64x64"), output_format,
``response_format`` "b64_json", ``stream`` with ``partial_images`` 0-3 (SSE events
``image_generation.partial_image`` and ``image_generation.completed``), plus the extensions steps,
seed, guidance_scale, negative_prompt, priority. An ``finish`` edit gives the current image as the
completed one.

Example:
    >>> client.images.generate(model="default", prompt="a red circle", size="64x64")  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...access.keys import Principal
from ...http.errors import json_body
from ...http.problems import Problem
from ...http.sse import json_event
from ...state import ServerState, get_principal, get_state
from .._common import ERRORS, collect_events, read_model_body, sse_of
from .._protocol import in_openai_names
from .protocol import OPENAI_IMAGE_NAMES, ImageGenerationRequest, image_kwargs
from .serving import ImageGenerations

router = APIRouter(tags=["openai"])


@router.post("/v1/images/generations", responses=ERRORS, openapi_extra=json_body(ImageGenerationRequest))
async def images(request: Request, state: ServerState = Depends(get_state),
                 principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    settings = state.settings
    body = await read_model_body(request, state, "image")
    sizes = getattr(state.model_for("image"), "sizes", None)  # 404 when none is served, 503 while it loads
    try:  # the server's limits (image_kwargs) and the model's checks (open_stream) name our options
        kwargs, priority, stream, partial, fmt = image_kwargs(body, settings, sizes)
        record = await state.open_stream("image", kwargs, priority=priority, request=request, resumable=False,
                                         arrived_at=arrived, principal=principal)
    except Problem as problem:
        raise in_openai_names(problem, OPENAI_IMAGE_NAMES) from None
    generations = ImageGenerations(kwargs["num_images"], partial, fmt)

    if not stream:
        content, status = generations.response(await collect_events(record, request))
        return JSONResponse(content, status_code=status, headers={"X-Stream-Id": record.stream_id} if status == 200 else None)

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for ev in record.subscribe():
            for name, payload in generations.feed(ev):
                yield json_event(payload, event=name)
            if generations.failed:
                return

    return sse_of([record], settings, events())
