"""Liveness, readiness, metrics and the web client page.

- ``GET /healthz``: liveness: 200 while the process serves (503 only while draining), with the
  models' states.
- ``GET /readyz``: readiness: 503 until every model is loaded, and while draining; 200 otherwise.
  ``status`` is ``"loading"``, ``"ok"``, ``"draining"`` or ``"degraded"`` (a model failed to load:
  its ``state`` is ``"failed"`` and ``reason`` says why and the fix; with ``allow_partial`` the
  server answers 200 on the models that loaded, without it ``multistream serve`` exits with 1).
- ``GET /metrics``: Prometheus text format.
- ``GET /``: the small web client (with a Content-Security-Policy); ``GET /favicon.ico``: 204 (none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from fastapi import APIRouter, Depends
from pydantic import BaseModel
from starlette.responses import FileResponse, JSONResponse, Response

from ..access.metrics import CONTENT_TYPE
from ..state import ServerState, get_state

__all__ = ["router"]

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
# media-src blob:: the video view plays the finished clip from a blob URL of the event's bytes.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
       "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

router = APIRouter(tags=["health"])


class ModelHealth(BaseModel):
    name: str
    state: str
    error: Optional[str] = None
    reason: Optional[str] = None


class Health(BaseModel):
    status: str
    ready: bool
    models: dict[str, ModelHealth]
    active_streams: int
    queued: dict[str, int]
    uptime_s: float


@router.get("/healthz", response_model=Health, responses={503: {"model": Health, "description": "draining"}})
async def healthz(state: ServerState = Depends(get_state)) -> Any:
    health = state.health()
    return JSONResponse(health, status_code=503 if state.draining else 200)


@router.get("/readyz", response_model=Health,
            responses={503: {"model": Health, "description": "models loading, or draining"}})
async def readyz(state: ServerState = Depends(get_state)) -> Any:
    health = state.health()
    return JSONResponse(health, status_code=200 if state.ready else 503,
                        headers={} if state.ready else {"Retry-After": "5"})


@router.get("/metrics", responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                                         "description": "Prometheus text format"}})
async def metrics(state: ServerState = Depends(get_state)) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    # Browsers ask for it on every page (the web client, /demo); a 404 is a console error there.
    return Response(status_code=204, headers={"Cache-Control": "public, max-age=86400"})


@router.get("/", include_in_schema=False)
async def index() -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers={
        "Cache-Control": "no-cache", "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"})
