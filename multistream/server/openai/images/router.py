"""OpenAI's ``POST /v1/images/generations``: prompt, n, size ("64x64"), output_format,
``response_format`` "b64_json", ``stream`` with ``partial_images`` 0-3 (SSE events
``image_generation.partial_image`` and ``image_generation.completed``), plus the extensions steps,
seed, guidance_scale, negative_prompt, priority. An ``finish`` edit gives the current image as the
completed one.

Example:
    >>> client.images.generate(model="default", prompt="a red circle", size="64x64")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....events import ErrorEvent, ImageEvent
from ...access.security import Principal
from ...http.bodies import read_body
from ...http.errors import json_body
from ...http.sse import json_event
from ...state import ServerState, get_principal, get_state
from .._common import ERRORS, collect_events, error_body, sse_of
from .protocol import ImageGenerationRequest, image_kwargs

router = APIRouter(tags=["openai"])


@router.post("/v1/images/generations", responses=ERRORS, openapi_extra=json_body(ImageGenerationRequest))
async def images(request: Request, state: ServerState = Depends(get_state),
                 principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    settings = state.settings
    body = await read_body(request, state)
    state.check_model_name("image", body.get("model") if isinstance(body, dict) else None)
    kwargs, priority, stream, partial, fmt = image_kwargs(body, settings)
    record = await state.open_stream("image", kwargs, priority=priority, request=request, resumable=False,
                                     arrived_at=arrived, principal=principal)
    n = kwargs["num_images"]
    common = {"background": "opaque", "output_format": fmt, "quality": "auto"}
    usage = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
             "output_tokens": 0, "total_tokens": 0}

    def is_done(ev: ImageEvent) -> bool:
        return ev.is_final or ev.finish_reason is not None

    if not stream:
        images: dict[int, ImageEvent] = {}
        error = None
        for ev in await collect_events(record, request):
            if isinstance(ev, ErrorEvent):
                error = ev
            elif isinstance(ev, ImageEvent) and is_done(ev):
                images[ev.index] = ev
        if error is not None:
            return JSONResponse(error_body(error), status_code=500)
        first = next(iter(images.values()), None)
        return JSONResponse({
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(images[i].data).decode("ascii")} for i in sorted(images)],
            **common, "size": f"{first.width}x{first.height}" if first else "auto", "usage": usage,
        }, headers={"X-Stream-Id": record.stream_id})

    async def events() -> AsyncIterator[ServerSentEvent]:
        sent = [0] * n
        async for ev in record.subscribe():
            if isinstance(ev, ErrorEvent):
                yield json_event(error_body(ev), event="error")
                return
            assert isinstance(ev, ImageEvent)
            base = {**common, "created_at": int(time.time()), "size": f"{ev.width}x{ev.height}",
                    "b64_json": base64.b64encode(ev.data).decode("ascii")}
            if is_done(ev):
                yield json_event({"type": "image_generation.completed", **base, "usage": usage},
                            event="image_generation.completed")
            elif ev.index < n and sent[ev.index] < partial and \
                    ev.step >= math.ceil((sent[ev.index] + 1) * ev.total_steps / (partial + 1)):
                yield json_event({"type": "image_generation.partial_image", **base,
                             "partial_image_index": sent[ev.index]}, event="image_generation.partial_image")
                sent[ev.index] += 1

    return sse_of([record], settings, events())
