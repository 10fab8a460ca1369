"""OpenAI's Videos API: ``POST /v1/videos`` (a job), ``GET /v1/videos`` (a page of them),
``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content?variant=video|thumbnail|spritesheet`` and
``DELETE /v1/videos/{id}``, over the served video model (``POST /v1/videos/{id}/remix`` is a 400 that
says remixing is not supported).

A job is one video stream run in the background: the create answers at once (``queued``, or
``in_progress`` when a slot was free), one reader follows the stream to its end (so the grace
period, which cancels a stream nobody reads, leaves it alone) and folds its events into the job
(`serving.VideoJob`). Every job answer carries ``openai-poll-after-ms``, which the SDK's
``poll`` / ``create_and_poll`` use as their interval, so a short clip is not polled once a second.
Refusals known at once (a size the model cannot make, a bad option, a full queue) are 4xx on the
create; a refusal after the job was queued fails the job with the refusal's type and message.

A job may be read, downloaded and deleted by who made it: the API key that created it, or on an
open server the client address (or the ``X-Resume-Token`` its create returned).

Example:
    >>> from openai import OpenAI
    >>> client = OpenAI(base_url=f"{url}/v1", api_key="none")
    >>> video = client.videos.create_and_poll(prompt="a red circle moving right")   # doctest: +SKIP
    >>> client.videos.download_content(video.id, variant="spritesheet").write_to_file("sheet.jpg")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ....engine import capacity_of
from ...access.keys import Principal
from ...bodies import check_video_limits
from ...http.bodies import OpenAIErrorResponse, parse_json_object, read_body
from ...http.errors import error_responses, json_body
from ...http.problems import Problem, problem_from_exception
from ...state import ServerState, get_principal, get_state
from ...streams.registry import StreamRecord, new_token
from .._common import owner_allows
from .protocol import VideoCreateBody, VideoFormat, form_body, parse_video_create
from .serving import VideoJob, VideoJobStore, video_id

__all__ = ["jobs_of", "router"]

_ERRORS = error_responses(OpenAIErrorResponse, {404: "no such video, or no video model",
                                                  409: "the video has no content (yet)",
                                                  415: "neither JSON nor a form"})

_VIDEO_OBJECT = {"description": "the job (openai.types.Video); header openai-poll-after-ms: when to ask again",
                 "content": {"application/json": {"schema": {"type": "object"}}}}

# The previews a job's stream makes: only their step counts matter (they move `progress`), so the
# cheapest there is: the linear latent map on a small contact sheet.
_JOB_PREVIEWS = {"preview": "latent", "preview_format": "sheet", "preview_max_side": 64}

router = APIRouter(tags=["openai"])


def jobs_of(state: ServerState) -> VideoJobStore:
    """The server's video jobs (made on first use, bounded like the stream registry)."""
    store = getattr(state, "video_jobs", None)
    if store is None:
        s = state.settings
        store = VideoJobStore(max_jobs=max(64, s.max_retained_streams * 2), retention_s=s.retention_s,
                              max_bytes=s.max_retained_bytes)
        state.video_jobs = store  # type: ignore[attr-defined]
        state.video_keepers = set()  # type: ignore[attr-defined]
        state.video_runs = {}  # type: ignore[attr-defined]
    return store


async def _read_create(request: Request, state: ServerState) -> tuple[dict[str, Any], bool]:
    """The create body as a dict and whether it was a form: JSON, or ``multipart/form-data`` /
    url-encoded (what the official SDK sends), read within the size cap and ``body_timeout_s``."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    form = ctype in ("multipart/form-data", "application/x-www-form-urlencoded")
    if not form and ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
        raise Problem(415, "unsupported_media_type", f"send the body as JSON ('Content-Type: application/json') or "
                      f"as multipart/form-data, as the OpenAI SDK does (got {ctype or 'none'!r})")
    raw = await read_body(request, state, raw=True)
    if not form:
        return parse_json_object(raw), False

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        parsed = await Request(request.scope, replay).form(max_files=1, max_fields=64)
    except Exception as exc:  # noqa: BLE001 - a malformed form is the client's: a 400, never a 500
        raise Problem(400, "invalid_form", f"the form could not be read: {str(exc)[:200]}") from None
    try:
        return form_body(parsed), True
    finally:
        await parsed.close()


def _headers(job: VideoJob) -> dict[str, str]:
    return {"openai-poll-after-ms": str(job.poll_after_ms()), "X-Stream-Id": job.stream_id}


def _allows(job: VideoJob, state: ServerState, request: Request, principal: Principal) -> bool:
    return owner_allows(job, request, principal, state.keyring.enabled)


def _owned(state: ServerState, job_id: str, request: Request, principal: Principal) -> VideoJob:
    job = jobs_of(state).get(job_id)
    if job is None or not _allows(job, state, request, principal):
        hint = "the API key that created it" if state.keyring.enabled else "the client that created it"
        raise Problem(404, "video_not_found", f"no video {job_id[:80]!r} here for you: it never existed, was deleted, "
                      f"ended more than {state.settings.retention_s:g} s ago (retention_s), or must be asked for "
                      f"with {hint}", param="video_id")
    return job


def _runs(state: ServerState) -> dict[str, asyncio.Future[StreamRecord]]:
    """Each running job's stream, by job id: a future of its record (pending while it is queued)."""
    jobs_of(state)
    return state.video_runs  # type: ignore[attr-defined,no-any-return]


def _follow(state: ServerState, job: VideoJob, started: asyncio.Future[StreamRecord]) -> None:
    """One reader to the stream's end, folding its events into the job; a refusal while it was
    queued (``started`` still awaiting its admission) fails the job."""
    runs = _runs(state)
    runs[job.id] = started

    async def follow() -> None:
        try:
            record = await started
        except asyncio.CancelledError:
            job.fail("cancelled", "the job was deleted while it waited for a slot", time.time())
            return
        except Exception as exc:  # noqa: BLE001 - refused after the create answered: the job says why
            problem = problem_from_exception(exc)
            job.fail(problem.type, problem.message, time.time())
            return
        job.admitted()
        try:
            async for ev in record.subscribe():
                job.apply(ev, time.time())
        finally:
            runs.pop(job.id, None)

    keeper = asyncio.get_running_loop().create_task(follow(), name=f"multistream-video-job-{job.stream_id[:8]}")
    keepers: set[asyncio.Task[None]] = state.video_keepers  # type: ignore[attr-defined]
    keepers.add(keeper)
    keeper.add_done_callback(keepers.discard)


def _stop(state: ServerState, job: VideoJob) -> None:
    """Stop a job's generation: its stream is cancelled, or, still queued, it gives up its place."""
    started = _runs(state).pop(job.id, None)
    if started is None:
        return
    if not started.done():
        started.cancel()
    elif not started.cancelled() and started.exception() is None and not started.result().done:
        started.result().cancel()


@router.post("/v1/videos", responses={200: _VIDEO_OBJECT, **_ERRORS}, openapi_extra=json_body(
    VideoCreateBody, media=("application/json", "multipart/form-data")))
async def create_video(request: Request, state: ServerState = Depends(get_state),
                       principal: Principal = Depends(get_principal)) -> Response:
    arrived = time.perf_counter()
    body, form = await _read_create(request, state)
    model = state.model_for("video")  # 404 when none is served, 503 while it loads
    state.check_model_name("video", body.get("model"))
    fmt = VideoFormat.of(model)
    req, kwargs = parse_video_create(body, fmt, form=form)
    priority: int = req.priority  # type: ignore[attr-defined]
    check_video_limits(kwargs, state.settings)
    kwargs.update(_JOB_PREVIEWS)
    stream_id, token = uuid.uuid4().hex, new_token()

    def start() -> Awaitable[StreamRecord]:
        return state.open_stream("video", kwargs, priority=priority, arrived_at=arrived, principal=principal,
                                 reserved=(stream_id, token), resumable=False)

    gate = state.gates.get("video")
    if gate is not None and not gate.concurrency:
        gate.concurrency = capacity_of(model)  # as the first stream would set it: the engine's capacity
    record: StreamRecord | None = None
    if gate is None or not gate.would_wait():
        record = await start()  # a free slot: refusals (a bad option, a full quota) are this answer's 4xx
    store = jobs_of(state)
    job = store.add(VideoJob(
        id=video_id(stream_id), stream_id=stream_id, model=req.model or state.models["video"].name,
        prompt=req.prompt, size=fmt.size_of(kwargs.get("width"), kwargs.get("height")),
        seconds=fmt.seconds_of(kwargs.get("num_frames"), req.seconds), created_at=int(time.time()), owner=principal.id,
        owner_keyed=principal.keyed, token=token))
    if record is not None:
        job.admitted()
        job.fold([ev for ev in record.events if ev is not None], time.time())
    if record is not None:
        started: asyncio.Future[StreamRecord] = asyncio.get_running_loop().create_future()
        started.set_result(record)
    else:  # queued: the admission goes on after this answer (the job says "queued" until it runs)
        started = asyncio.ensure_future(start())
    _follow(state, job, started)
    return JSONResponse(job.to_object(), headers={**_headers(job), "X-Resume-Token": token})


@router.get("/v1/videos", responses={200: {"description": "a page of jobs (newest first)"}, **_ERRORS})
async def list_videos(request: Request, state: ServerState = Depends(get_state),
                      principal: Principal = Depends(get_principal)) -> Response:
    q = request.query_params
    raw_limit = q.get("limit", "20")
    if not (raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 4):
        raise Problem(400, "invalid_argument", f"limit must be an integer from 1 to 100, got {raw_limit[:20]!r}",
                      param="limit")
    page = jobs_of(state).page(after=q.get("after") or None, limit=int(raw_limit), order=q.get("order", "desc"),
                               visible=lambda job: _allows(job, state, request, principal))
    return JSONResponse(page)


@router.get("/v1/videos/{video_id}", responses={200: _VIDEO_OBJECT, **_ERRORS})
async def retrieve_video(video_id: str, request: Request, state: ServerState = Depends(get_state),
                         principal: Principal = Depends(get_principal)) -> Response:
    job = _owned(state, video_id, request, principal)
    return JSONResponse(job.to_object(), headers=_headers(job))


@router.get("/v1/videos/{video_id}/content", responses={200: {
    "description": "the clip (video/mp4 or video/webm), a frame (thumbnail: image/webp) or all frames on one "
    "sheet (spritesheet: image/jpeg)",
    "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in (
        "video/mp4", "video/webm", "image/webp", "image/jpeg")}}, **_ERRORS})
async def download_video(video_id: str, request: Request, state: ServerState = Depends(get_state),
                         principal: Principal = Depends(get_principal)) -> Response:
    job = _owned(state, video_id, request, principal)
    variant = request.query_params.get("variant")
    # The thumbnail and the sheet decode the clip (PyAV) once: off the event loop.
    asset = await asyncio.to_thread(job.content, variant)
    ext = {"video/mp4": "mp4", "video/webm": "webm", "image/webp": "webp", "image/jpeg": "jpg"}.get(
        asset.media_type, "bin")
    return Response(asset.data, media_type=asset.media_type, headers={
        "Content-Disposition": f'attachment; filename="{job.id}-{variant or "video"}.{ext}"'})


@router.post("/v1/videos/{video_id}/remix", responses={400: {"description": "remixing is not supported"}, **_ERRORS})
async def remix_video(video_id: str, request: Request, state: ServerState = Depends(get_state),
                      principal: Principal = Depends(get_principal)) -> Response:
    """OpenAI's ``client.videos.remix``: refused by name (it was a bare "no route" 404)."""
    _owned(state, video_id, request, principal)  # a video that is not the client's is still a 404
    raise Problem(400, "unsupported", "remixing a video is not supported: the served video model makes clips from a "
                  "text prompt only; create a new video (client.videos.create) with the changed prompt",
                  param="video_id")


@router.delete("/v1/videos/{video_id}", responses={200: {"description": "{id, object: video.deleted, deleted}"},
                                                   **_ERRORS})
async def delete_video(video_id: str, request: Request, state: ServerState = Depends(get_state),
                       principal: Principal = Depends(get_principal)) -> Response:
    job = _owned(state, video_id, request, principal)
    _stop(state, job)  # a job still running or queued is stopped: nobody can ask for it any more
    jobs_of(state).delete(job.id)
    return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})
