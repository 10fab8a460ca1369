"""The native speech route: ``POST /v1/speech``.

It takes `SpeechModel.stream`'s arguments (``text``, ``voice``, ``speed``, ``priority``: one
definition, `SpeechOptions`) and answers the native SSE of wire events (``audio`` events with
base64 PCM; the final one with the whole WAV), resumable like the others through
``GET /v1/streams/{id}/events`` with the ``X-Resume-Token`` it returns.

Example:
    >>> httpx.post(f"{url}/v1/speech", json={"text": "Hello there."})   # doctest: +SKIP
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from ..access.security import Principal
from ..bodies import SpeechBody, parse_speech_body
from ..http.bodies import ErrorResponse, read_body
from ..http.errors import error_responses, json_body
from ..state import ServerState, get_principal, get_state
from .sse import new_stream_sse

__all__ = ["router"]

router = APIRouter(tags=["streams"])

_SSE = {"200": {"description": "the audio as it is made", "content": {"text/event-stream": {}}}}


@router.post("/v1/speech", summary="Stream speech", openapi_extra={**json_body(SpeechBody), "responses": _SSE},
             responses=error_responses(ErrorResponse),
             description="Body: `SpeechModel.stream` arguments (`text`, `voice`, `speed`, `priority`).")
async def post_speech(request: Request, state: ServerState = Depends(get_state),
                      principal: Principal = Depends(get_principal)) -> Response:
    kwargs, priority = parse_speech_body(await read_body(request, state))
    return await new_stream_sse(state, "speech", kwargs, priority=priority, request=request,
                                arrived_at=time.perf_counter(), principal=principal)
