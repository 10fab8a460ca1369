"""The ASGI app: ``create_app(text_model=..., image_model=..., settings=...)``.

Routes (every native payload is the event wire form, ``ev.to_dict()``), one `APIRouter` per surface:

- native (`native.routes`: one ``POST /v1/<family>`` per entry of `families.FAMILIES`): ``POST /v1/text``, ``POST /v1/image``: JSON body = the arguments of
  ``.stream()`` (+ ``priority``); answers ``text/event-stream`` (``id:`` seq, ``event:`` type,
  ``data:`` wire JSON) with ``X-Stream-Id`` and ``X-Resume-Token`` headers.
  ``GET /v1/streams/{id}/events``: resume with ``Last-Event-ID`` (or ``?after=SEQ``); replays what
  came after, then follows live; 204 when nothing is left. ``GET`` / ``DELETE /v1/streams/{id}``.
- WebSocket (`native.websocket`): ``WS /v1/ws``.
- OpenAI (`openai.<endpoint>.router`): ``POST /v1/chat/completions`` (`chat`), ``POST /v1/completions``
  (`completions`), ``POST /v1/images/generations`` (`images`), ``POST /v1/audio/speech`` (`audio`),
  ``GET /v1/models`` (`openai.models`).
- OpenAI Responses (`openai.responses`): ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``
  (``?stream=true&starting_after=N``), ``POST /v1/responses/{id}/cancel``, ``GET .../input_items``.
- health (`native.health`): ``GET /healthz`` (liveness), ``GET /readyz`` (readiness), ``GET /metrics``
  (Prometheus), ``GET /`` (a small web client).
- ``GET /openapi.json`` and ``GET /docs`` describe every body.

POST bodies must be ``application/json``. Every refusal is a 4xx with a message naming the
problem and the fix; a server failure is a 500 with a request id and no internals.

Example:
    >>> from multistream.server import create_app, ServerSettings
    >>> from multistream.testing import ScriptedTextModel
    >>> app = create_app(text_model=ScriptedTextModel(), settings=ServerSettings(grace_period_s=10))
    >>> # uvicorn.run(app, host="127.0.0.1", port=8000)   or   multistream serve
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.staticfiles import StaticFiles

from .._gc import paused_until
from ..errors import InvalidArgumentError
from . import openai
from .access.keys import KeyRing
from .access.middleware import SecurityMiddleware
from .access.redaction import install_log_redaction
from .families import FAMILIES
from .http.bodies import ErrorResponse, OpenAIErrorResponse
from .http.deferred import DeferredApp
from .http.errors import request_bodies
from .http.problems import Problem
from .http.warmup import warm_up
from .native import health, websocket
from .native import routes as native_routes
from .native.health import STATIC_DIR
from .settings import ServerSettings
from .state import ModelSlot, ServerState
from .streams.filtering import ContentFilter, chain, load_blocklist

__all__ = ["ServerState", "create_app"]

logger = logging.getLogger("multistream.server")

def create_app(
    text_model: Any = None,
    image_model: Any = None,
    settings: ServerSettings | None = None,
    *,
    content_filter: ContentFilter | None = None,
    demo_path: str | None = None,
    speech_model: Any = None,
    video_model: Any = None,
    models: dict[str, Any] | None = None,
) -> FastAPI:
    """Build the ASGI app serving ``text_model`` and/or ``image_model``.

    Each model may be a loaded model (anything with ``.stream()``), ``"default"`` for the embedded
    model, a hub id or path, ``"module:factory"``, or a zero-argument callable; names are loaded
    in a background thread at startup (``/readyz`` says when they are ready). ``None`` = not served.
    ``speech_model`` likewise (``"default"``: the embedded Piper voice) serves ``/v1/audio/speech``
    and ``/v1/speech``; ``video_model`` (``"default"``: the embedded text-to-video model) serves
    ``/v1/video`` and OpenAI's ``/v1/videos``. ``models`` gives them by family name instead
    (``{"text": ..., "speech": ...}``, one entry per family of `multistream.server.families.FAMILIES`;
    it wins over the keywords).

    ``content_filter(text, part)`` sees each prompt and chat message (``part="prompt"``) and the
    output accumulated so far (``part="output"``, again as it grows; the server holds back the
    last ``settings.filter_holdback_chars`` characters, or the hook's own ``holdback`` attribute,
    so a word split across tokens is caught). It returns the text to use (redacted or not),
    ``None`` to keep it, or `STOP` to end the stream with ``finish_reason="content_filter"``. It
    runs on the event loop, so keep it fast. ``settings.blocklist_file`` adds a `Blocklist`.

    ``demo_path`` (e.g. ``"/demo"``, what ``multistream serve`` uses) also serves the Gradio demo
    page; its generations go through the same admission, quotas, content filter, timeouts and
    drain as the API. On a keyed server the page asks for a login: any user name, an API key as
    the password.

    Example:
        >>> from multistream.server import create_app, STOP
        >>> from multistream.testing import ScriptedTextModel
        >>> app = create_app(ScriptedTextModel(), content_filter=lambda text, part: text.replace("secret", "***"))
    """
    settings = settings or ServerSettings()
    specs = {"text": text_model, "image": image_model, "speech": speech_model, "video": video_model, **(models or {})}
    unknown = sorted(set(specs) - {f.name for f in FAMILIES})
    if unknown:
        raise InvalidArgumentError(f"no model family {unknown[0]!r}; the families are {[f.name for f in FAMILIES]}")
    if content_filter is not None and not callable(content_filter):
        raise InvalidArgumentError("content_filter must be a function (text, part) -> str | None | STOP")
    blocklist = load_blocklist(settings.blocklist_file) if settings.blocklist_file else None
    content_filter = chain(content_filter, blocklist)
    keyring = KeyRing(settings)
    install_log_redaction()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServerState(settings, content_filter=content_filter, keyring=keyring, models=specs)
        app.state.multistream = state
        loading = [slot for slot in state.models.values() if slot.state == "pending"]
        if loading:  # their loads share one pause of the collector: one walk after the last (`multistream._gc`)
            # Under `serve()` the runner freezes start-up's objects once the pause is over
            # (`runner._freeze_startup_objects`), without a walk: the pause's end need not walk them.
            runner_freezes = getattr(app.state, "runner_freezes_startup", False)
            paused_until((slot.settled for slot in loading), finish=(lambda: None) if runner_freezes else gc.collect)
        for slot in loading:
            slot.start_loading()
        stop_waiting = threading.Event()
        if demo is not None:  # built once the models are in and clients are quiet (or at its first request)
            demo.attach(asyncio.get_running_loop())
            _start_when_settled(demo, list(state.models.values()), state.registry.idle_for, stop_waiting)
        janitor = asyncio.get_running_loop().create_task(_janitor(state))
        # Runs once the server listens (a task): /healthz is not held up, the first request is faster.
        warming = app.state.warm_up = asyncio.get_running_loop().create_task(warm_up(app.router))
        continuer = None
        if state.registry.log is not None:
            from .durable.continuation import Continuer

            continuer = Continuer(state)  # continues the generations of a server that went away
            continuer.start()
            app.state.continuer = continuer
        try:
            yield
        finally:
            stop_waiting.set()
            janitor.cancel()
            warming.cancel()
            if continuer is not None:
                continuer.stop()
            state.registry.cancel_all()
            if demo is not None:
                await demo.aclose()
            if state.registry.log is not None:
                await asyncio.sleep(0.1)  # let the pumps append their finals to the shared log
                await state.registry.log.close()

    app = FastAPI(title="multistream", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  description="Stream LLM tokens and diffusion previews: SSE, WebSocket and OpenAI-compatible "
                  "routes. Errors: `{\"error\": {\"type\", \"message\"}}` (OpenAI routes: OpenAI's shape).")

    def openai_path(request: Request) -> bool:
        return request.url.path.startswith(openai.PATH_PREFIXES)

    @app.exception_handler(Problem)
    async def on_problem(request: Request, exc: Problem) -> Response:
        state = getattr(request.app.state, "multistream", None)
        if state is not None:
            state.metrics.rejected.inc(status=str(exc.status), reason=exc.type)
        response = exc.response(openai=openai_path(request))
        if exc.status == 500:
            request_id = getattr(request.state, "request_id", None) or "-"
            body = exc.body(openai_path(request))
            body["error"]["request_id"] = request_id
            body["error"]["message"] += f" (request id {request_id})"
            response = JSONResponse(body, status_code=500, headers=exc.headers)
        return response

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        request_id = getattr(request.state, "request_id", None) or "-"
        logger.error("unhandled error on %s (request id %s)", request.url.path, request_id, exc_info=exc)
        problem = Problem(500, "internal_error", f"the server failed on this request (request id {request_id}); "
                          "the server log has the details")
        body = problem.body(openai_path(request))
        body["error"]["request_id"] = request_id
        return JSONResponse(body, status_code=500, headers={"X-Request-Id": request_id})

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return Problem(400, "invalid_argument", f"{where}: {first.get('msg', 'invalid')}").response(
            openai=openai_path(request))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            problem = Problem(404, "not_found", f"no route {request.method} {request.url.path[:200]}")
        elif exc.status_code == 405:
            problem = Problem(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path[:200]}")
        else:
            problem = Problem(exc.status_code, "http_error", str(exc.detail), dict(exc.headers or {}))
        return problem.response(openai=openai_path(request))

    for module in (native_routes, openai, websocket, health):
        app.include_router(module.router)
    if settings.enable_test_hooks:
        app.include_router(native_routes.test_router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            # Every body a route names by `$ref` (`json_body`), and the error bodies.
            for model in (*request_bodies(), ErrorResponse, OpenAIErrorResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    demo = None
    if demo_path:
        demo = _deferred_demo(app, demo_path, specs["image"], keyring, speech=specs["speech"] is not None,
                              video=specs["video"] is not None)
        app.mount(demo_path.rstrip("/"), demo)
    app.add_middleware(SecurityMiddleware, settings=settings, keyring=keyring, demo_path=demo_path,
                       openai_paths=openai.PATH_PREFIXES)
    app.multistream_settings = settings  # type: ignore[attr-defined]  # read by runner.uvicorn_config
    return app


def _deferred_demo(app: FastAPI, path: str, image_spec: Any, keyring: KeyRing, speech: bool = False,
                   video: bool = False) -> DeferredApp:
    """The Gradio demo, built once the server listens (importing Gradio alone takes seconds, which
    ``/healthz`` and the API should not wait for); its generations run through this server's gates
    (`GatedModel`)."""
    from .streams.gated import GatedModel

    def provider(kind: str) -> Any:
        return lambda: GatedModel(app, kind)

    def check(username: str, password: str) -> bool:  # any user name, an API key as the password
        return keyring.find(password) is not None

    auth = check if keyring.enabled else None
    # The embedded image model draws shapes: constrain the LLM's prompts to its vocabulary.
    style = "shapes" if image_spec == "default" else "auto"
    # The demo speaks with the server's own speech model (no second copy), when it serves one.
    speech_model = (lambda: app.state.multistream.models["speech"].get()) if speech else False
    # The Video tab likewise films with the server's video model; none served, no tab.
    video_model = (lambda: app.state.multistream.models["video"].get()) if video else False

    def build() -> tuple[Any, Any]:
        from ..ui.demo import demo_asgi_app

        return demo_asgi_app(provider("text"), provider("image"), path=path.rstrip("/"), prompt_style=style,
                             auth=auth, speech_model=speech_model, video_model=video_model)

    return DeferredApp(build, name="demo page")


# How long no stream may have run before the demo page is built unasked: Gradio's import holds
# the GIL for seconds, and the API's first clients (a script that waits for /readyz, then sends
# requests) would wait with it (first tokens 0.6-1.9 s instead of 30-40 ms on 2 cores).
DEMO_BUILD_QUIET_S = 1.5


def _start_when_settled(demo: DeferredApp, slots: list[ModelSlot], idle_for: Callable[[float], bool],
                        stop: threading.Event) -> None:
    """Start building the demo once every model has loaded (or failed) and no stream has run for
    `DEMO_BUILD_QUIET_S`: building it during the loads would slow them (one GIL, two cores), and
    during a client's streams would slow those. A request to the page starts it at once anyway."""

    def wait() -> None:
        for slot in slots:
            while not slot.settled.wait(0.25):
                if stop.is_set():
                    return
        settled_at = time.monotonic()  # a client that waited for /readyz comes now: give it the quiet period too
        while not stop.is_set() and not demo.started:
            if time.monotonic() - settled_at >= DEMO_BUILD_QUIET_S and idle_for(DEMO_BUILD_QUIET_S):
                demo.start()
                return
            stop.wait(0.25)

    threading.Thread(target=wait, name="multistream-demo-when-quiet", daemon=True).start()


async def _janitor(state: ServerState) -> None:
    while True:
        await asyncio.sleep(5.0)
        state.registry.evict()


_ = ModelSlot  # re-exported for callers that imported it from here
