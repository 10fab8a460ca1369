"""The native routes: ``POST /v1/<family>`` for each entry of the family table (``/v1/text``,
``/v1/image``, ``/v1/speech``, ``/v1/video``: the family's ``.stream()`` arguments in, SSE of wire
events out),
resume, info, cancel and edits.

``POST /v1/speech`` takes `SpeechModel.stream`'s arguments (``text``, ``voice``, ``speed``,
``priority``: one definition, `SpeechOptions`) and answers ``audio`` events with base64 PCM (the
final one with the whole WAV), resumable like the others.

A new stream's response carries ``X-Stream-Id`` and ``X-Resume-Token``; while it waits for a
slot, ``event: queued`` with ``{"position", "queued"}`` comes first (not a protocol event: see
`sse`). Reading, resuming, cancelling or editing a stream later needs the key that created it
(with API keys) or that token (an open server: ``X-Resume-Token`` header or ``?token=``, which
EventSource can send).

Edits of a running stream (all answer `EditResult`; the effect shows in the stream's events):

- ``POST /v1/streams/{id}/finish``: stop now and keep the result (``finish_reason
  "finished_early"``; an image's final is its current estimate through the full VAE).
- ``POST /v1/streams/{id}/steer``: text ``{"instruction": "..."}``; image and video ``{"prompt": ...,
  "negative_prompt": ..., "guidance_scale": ...}``. From the model's next step on.
- ``POST /v1/streams/{id}/rewind``: text only, ``{"offset": 120, "instruction": null, "token_id": null, ...}``:
  regenerate from character ``offset``; later events carry a smaller ``offset`` and a new
  ``revision`` (clients keep ``text = text[:offset] + delta``).

Bad input is a 400 with the model's own message; a stream that already ended is a 409
(``stream_finished``); neither touches the stream.

With a shared event log, an edit of a stream that another process runs (another server, another
Ray ingress replica) is checked here (a 400 at once), forwarded to that process, and answered
with its verdict (200, or its 4xx); if it does not answer within ``CONTROL_WAIT_S`` (2 s) the
answer is **202** ``{"accepted": true, "pending": true, "note": ...}``: the edit is on its way.

Example:
    >>> httpx.post(f"{url}/v1/streams/{sid}/steer", json={"instruction": "shorter"},
    ...            headers={"X-Resume-Token": token})                           # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..access.keys import Principal
from ..bodies import EditResult, RewindBody, SteerBody
from ..families import FAMILIES, Family
from ..http.bodies import ErrorResponse, read_body
from ..http.errors import error_responses, json_body
from ..http.problems import Problem
from ..http.routes import RequestOnlyRoute
from ..state import ServerState, get_principal, get_state, principal_of, state_of
from ..streams.edits import apply_edit
from ..streams.registry import StreamRecord
from .sse import new_stream_sse, sse_response

__all__ = ["router"]

router = APIRouter(tags=["streams"])

SSE_EVENT_SCHEMA = {"type": "object", "description": "one server-sent event; `data` is an event's wire JSON",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                                   "retry": {"type": "integer"}}}
_SSE = {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
        "description": "the stream's events as server-sent events (id: seq, event: type, data: wire JSON)"}
_ERRORS = error_responses(ErrorResponse)


class StreamInfo(BaseModel):
    stream_id: str
    kind: str
    done: bool
    finish_reason: str | None = None
    events: int = Field(description="events so far (seq of the next one)")
    subscribers: int


class CancelResult(BaseModel):
    stream_id: str
    cancelled: bool = Field(description="true when the stream was still running (or waiting in the queue)")


def _family_route(fam: Family) -> None:
    """``POST /v1/<family>``: its body (`Family.body`, `Family.parse`) -> a new stream's SSE; one
    route per entry of the family table, so a family added there is served here."""

    async def post(request: Request) -> Response:
        arrived = time.perf_counter()
        state, principal = state_of(request), principal_of(request)  # the hot path: no FastAPI dependencies
        kwargs, priority = fam.parse(await read_body(request, state), state.settings)
        return await new_stream_sse(state, fam.name, kwargs, priority=priority, request=request, arrived_at=arrived,
                                    principal=principal)

    post.__name__ = f"post_{fam.name}"  # the OpenAPI operation id
    router.add_api_route(fam.route, post, methods=["POST"], route_class_override=RequestOnlyRoute,
                         responses={200: _SSE, **_ERRORS}, openapi_extra=json_body(fam.body),
                         summary=fam.summary or f"Stream {fam.name}", description=fam.body.__doc__)


for _fam in FAMILIES:
    _family_route(_fam)


def owned_record(state: ServerState, stream_id: str, request: Request, principal: Principal) -> StreamRecord:
    """The stream, if the caller may touch it; 404 either way otherwise (no probing for ids)."""
    record = state.registry.get(stream_id)
    token = request.headers.get("x-resume-token") or request.query_params.get("token")
    if record is None or not record.allows(principal, token):
        hint = ("with the API key that created it" if state.keyring.enabled
                else "with the X-Resume-Token (or ?token=) its creation returned")
        raise Problem(404, "stream_not_found", f"no stream {stream_id[:64]!r} here for you: it never existed, it "
                      f"finished more than {state.settings.retention_s:g} s ago (retention_s), or you must ask "
                      f"{hint}")
    return record


def _after(request: Request) -> int:
    # Last-Event-ID wins: an EventSource reconnects to the same URL (with its original ?after=)
    # and sends the id of the last event it really got.
    raw = request.headers.get("last-event-id")
    if raw is None:
        raw = request.query_params.get("after")
    if raw is None or raw == "":
        return -1
    try:
        if len(raw) > 20:
            raise ValueError
        value = int(raw)
    except ValueError:
        raise Problem(400, "invalid_argument", f"Last-Event-ID / after must be an event seq (an integer), got "
                      f"{raw[:40]!r}") from None
    if value < -1:
        raise Problem(400, "invalid_argument", f"Last-Event-ID / after must be >= -1, got {value}")
    return value


@router.get("/v1/streams/{stream_id}/events", responses={200: _SSE, 204: {"description": "nothing left to send"},
                                                        **_ERRORS},
            summary="Resume a stream", description="Replays the events after `Last-Event-ID` (or `?after=`), then "
            "follows live. Needs the creating key, or `X-Resume-Token` / `?token=`.")
async def resume(stream_id: str, request: Request, state: ServerState = Depends(get_state),
                 principal: Principal = Depends(get_principal)) -> Response:
    after = _after(request)
    record = owned_record(state, stream_id, request, principal)
    if not record.resumable:
        raise Problem(404, "stream_not_found", f"stream {stream_id!r} cannot be resumed (an OpenAI-route stream)")
    if record.done and after >= len(record.events) - 1:
        return Response(status_code=204, headers={"X-Stream-Id": stream_id})  # tells EventSource to stop
    if after >= len(record.events) and not record.done:
        raise Problem(400, "invalid_argument", f"event {after} has not happened yet in stream {stream_id} "
                      f"(last seq is {len(record.events) - 1})")
    record.check_follower_room()
    return sse_response(record, state.settings, after=after)


@router.get("/v1/streams/{stream_id}", response_model=StreamInfo, responses=_ERRORS, summary="Stream status")
async def stream_info(stream_id: str, request: Request, state: ServerState = Depends(get_state),
                      principal: Principal = Depends(get_principal)) -> Any:
    record = owned_record(state, stream_id, request, principal)
    return StreamInfo(stream_id=stream_id, kind=record.kind, done=record.done, finish_reason=record.finish_reason,
                      events=len(record.events), subscribers=record.subscribers)


@router.delete("/v1/streams/{stream_id}", response_model=CancelResult, responses=_ERRORS, summary="Cancel a stream")
async def cancel_stream(stream_id: str, request: Request, state: ServerState = Depends(get_state),
                        principal: Principal = Depends(get_principal)) -> Any:
    token = request.headers.get("x-resume-token") or request.query_params.get("token")
    waiting = state.waiting.find(stream_id, principal, token) if state.registry.get(stream_id) is None else None
    if waiting is not None:  # still in the admission queue: it gives up its place
        waiting.cancel()
        return CancelResult(stream_id=stream_id, cancelled=True)
    record = owned_record(state, stream_id, request, principal)
    was_running = not record.done
    record.cancel()
    return CancelResult(stream_id=stream_id, cancelled=was_running)


def _edit_response(status: int, result: dict[str, Any]) -> Any:
    return result if status == 200 else JSONResponse(result, status_code=status)


async def _edit_body(request: Request, state: ServerState) -> Any:
    # An empty body means {} (finish needs none); anything else must be a JSON object.
    if request.headers.get("content-length") in ("0", None) and "chunked" not in request.headers.get(
            "transfer-encoding", ""):
        return None
    return await read_body(request, state)


_EDIT_ERRORS = {**error_responses(ErrorResponse, {409: "the stream has already ended"}),
                202: {"description": "forwarded to the process that runs the stream (shared event log), which did not "
                      "confirm within 2 s: `EditResult` plus `pending: true` and a `note`"}}


def _edit_route(command: str, body: type | None, summary: str, description: str) -> None:
    """``POST /v1/streams/{id}/{command}``: one route per edit, all alike (owner only, `EditResult`)."""

    async def edit(stream_id: str, request: Request, state: ServerState = Depends(get_state),
                   principal: Principal = Depends(get_principal)) -> Any:
        record = owned_record(state, stream_id, request, principal)
        raw = await (read_body(request, state) if body is not None else _edit_body(request, state))
        return _edit_response(*await apply_edit(record, command, raw, state.settings, state.registry.log))

    edit.__name__ = f"{command}_stream"  # the OpenAPI operation id
    router.post(f"/v1/streams/{{stream_id}}/{command}", response_model=EditResult, responses=_EDIT_ERRORS,
                openapi_extra=json_body(body) if body is not None else None, summary=summary,
                description=description)(edit)


_edit_route("finish", None, "Finish a stream early",
            "Stop now and keep the result: `finish_reason` `finished_early` (an image: the current estimate through "
            "the full VAE). `accepted` is false if it had already ended. Owner only.")
_edit_route("steer", SteerBody, "Steer a running stream",
            "Text: `{\"instruction\": ...}`; image: `prompt` / `negative_prompt` / `guidance_scale`. Takes effect at "
            "the model's next step. Owner only.")
_edit_route("rewind", RewindBody, "Rewind a text stream",
            "Regenerate from character `offset` (optionally with a new `instruction` and sampling options); later "
            "events carry the smaller `offset` and a new `revision`. Owner only.")


test_router = APIRouter(include_in_schema=False)


@test_router.post("/v1/_test/drop")
async def drop(state: ServerState = Depends(get_state)) -> Response:
    """Test hook: end every live SSE/WS subscription abruptly (streams keep running)."""
    return JSONResponse({"dropped_streams": state.registry.drop_connections()})
