"""The ASGI app: ``create_app(text_model=..., image_model=..., settings=...)``.

Routes (every native payload is the event wire form, ``ev.to_dict()``):

- ``POST /v1/text``, ``POST /v1/image``: JSON body = the arguments of ``.stream()`` (+ ``priority``);
  answers ``text/event-stream`` (``id:`` seq, ``event:`` type, ``data:`` wire JSON) and an
  ``X-Stream-Id`` header.
- ``GET /v1/streams/{id}/events``: resume with ``Last-Event-ID`` (or ``?after=SEQ``): replays what
  came after, then follows live. 204 when nothing is left to send.
- ``WS /v1/ws``: see `multistream.server.websocket`.
- ``POST /v1/chat/completions``, ``POST /v1/images/generations``, ``GET /v1/models``: OpenAI-compatible.
- ``GET /metrics`` (Prometheus), ``GET /healthz``, ``GET /`` (a small web client).

Example:
    >>> from multistream.server import create_app, ServerSettings
    >>> from multistream.testing import ScriptedTextModel
    >>> app = create_app(text_model=ScriptedTextModel(), settings=ServerSettings(grace_period_s=10))
    >>> # uvicorn.run(app, host="127.0.0.1", port=8000)   or   multistream serve
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import InvalidArgumentError
from ..stream import Stream, StreamWriter
from .admission import Admission
from .metrics import Metrics
from .problems import Problem, problem_from_exception
from .registry import STOP, ContentFilter, Registry, StreamRecord
from .requests import parse_image_body, parse_text_body, read_json
from .settings import ServerSettings
from .sse import sse_response

__all__ = ["ServerState", "create_app"]

logger = logging.getLogger("multistream.server")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
_OPENAI_PATHS = ("/v1/chat/", "/v1/images/", "/v1/models")
_OPEN_PATHS = ("/healthz", "/", "/favicon.ico")


class ModelSlot:
    """One served model: given ready, or loaded in a background thread so the server starts fast.

    ``spec`` is a model object, ``"default"`` (the embedded model), a name or path for the
    ``load_*_model`` function, ``"module:attr"`` (a factory called with no arguments), a callable,
    or None (not served).
    """

    def __init__(self, kind: str, spec: Any) -> None:
        self.kind = kind
        self.spec = spec
        self.model: Any = None
        self.error: str | None = None
        if spec is None:
            self.state = "disabled"
        elif isinstance(spec, (str, type)) or (callable(spec) and not hasattr(spec, "stream")):
            self.state = "pending"  # a name or a factory: loaded in the background at startup
        else:
            self.model, self.state = spec, "ready"

    @property
    def name(self) -> str:
        if self.model is not None:
            return str(getattr(self.model, "name", None) or self.kind)
        return self.spec if isinstance(self.spec, str) else self.kind

    def start_loading(self) -> None:
        if self.state != "pending":
            return
        self.state = "loading"
        threading.Thread(target=self._load, name=f"multistream-load-{self.kind}", daemon=True).start()

    def _load(self) -> None:
        try:
            self.model = _load_model(self.kind, self.spec)
            self.state = "ready"
            logger.info("%s model %s is ready", self.kind, self.name)
        except BaseException as exc:  # noqa: BLE001 - report it on /healthz, keep serving the rest
            logger.exception("loading the %s model failed", self.kind)
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"

    def get(self) -> Any:
        if self.state == "ready":
            return self.model
        if self.state == "disabled":
            raise Problem(404, "model_not_served", f"this server has no {self.kind} model; start it with "
                          f"`multistream serve --{self.kind}-model ...`")
        if self.state == "failed":
            raise Problem(503, "model_failed", f"the {self.kind} model failed to load: {self.error}")
        raise Problem(503, "model_loading", f"the {self.kind} model is still loading; retry shortly",
                      {"Retry-After": "5"})


def _load_model(kind: str, spec: Any) -> Any:
    if callable(spec) and not isinstance(spec, str):
        return spec()
    if isinstance(spec, str) and ":" in spec and not spec.startswith(("/", ".")) and "/" not in spec.split(":")[0]:
        module_name, _, attr = spec.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj() if callable(obj) else obj
    module = importlib.import_module(f"multistream.{kind}")
    loader = getattr(module, f"load_{kind}_model")
    return loader(None if spec == "default" else spec)


class ServerState:
    """Everything the routes share: settings, models, admission gates, the stream registry."""

    def __init__(self, settings: ServerSettings, text_model: Any, image_model: Any,
                 content_filter: ContentFilter | None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.registry = Registry(settings, self.metrics)
        self.models = {"text": ModelSlot("text", text_model), "image": ModelSlot("image", image_model)}
        self.gates = {"text": Admission("text", settings.text_concurrency, settings.queue_size),
                      "image": Admission("image", settings.image_concurrency, settings.queue_size)}
        self.content_filter = content_filter
        self.draining = False
        self.drained = asyncio.Event() if _has_loop() else None
        self.started_at = time.time()
        m = self.metrics
        m.gauge("multistream_active_streams", "Streams generating now.",
                lambda: [({"kind": k}, float(self.registry.active(k))) for k in self.gates])
        m.gauge("multistream_queued_requests", "Requests waiting for a slot.",
                lambda: [({"kind": k}, float(g.queued)) for k, g in self.gates.items()])
        m.gauge("multistream_retained_streams", "Finished streams kept for replay.",
                lambda: [({}, float(len(self.registry.finished)))])
        m.gauge("multistream_retained_bytes", "Approximate bytes held by finished streams' replay logs.",
                lambda: [({}, float(self.registry.retained_bytes))])
        m.gauge("multistream_model_ready", "1 when the model is loaded and serving.",
                lambda: [({"kind": k, "model": s.name}, float(s.state == "ready"))
                         for k, s in self.models.items() if s.state != "disabled"])

    # -- opening streams -----------------------------------------------------------------------

    async def open_stream(self, kind: str, kwargs: dict[str, Any], *, priority: int = 0,
                          request: Request | None = None, resumable: bool = True,
                          arrived_at: float | None = None) -> StreamRecord:
        """Admit a request (queue, limits), start the model, register the stream; raises `Problem`."""
        arrived_at = arrived_at if arrived_at is not None else time.perf_counter()
        if self.draining:
            raise Problem(503, "shutting_down", "the server is shutting down; retry on another instance",
                          {"Retry-After": "5"})
        model = self.models[kind].get()
        kwargs = dict(kwargs)
        if self.content_filter is not None and self._filter_prompt(kwargs):
            if kind != "text":
                raise Problem(400, "content_filter", "the prompt was rejected by the content filter")
            return self.registry.start(_filtered_stream(), kind=kind, resumable=resumable, model_name=self.models[kind].name,
                                       arrived_at=arrived_at)
        gate = self.gates[kind]
        waited = time.perf_counter()
        await _until_disconnected(gate.acquire(priority, self.settings.queue_timeout_s), request,
                                  on_abandoned=gate.release)
        self.metrics.queue_wait.observe(time.perf_counter() - waited, kind=kind)
        started = time.perf_counter()
        try:
            if self.draining:
                raise Problem(503, "shutting_down", "the server is shutting down", {"Retry-After": "5"})
            stream = model.stream(**kwargs)
        except BaseException as exc:
            gate.release()
            problem = problem_from_exception(exc)
            if problem.status >= 500:
                logger.exception("starting a %s stream failed", kind)
            raise problem from None

        def on_done(record: StreamRecord) -> None:
            gate.release(time.perf_counter() - started)

        count = getattr(model, "count_tokens", None)
        return self.registry.start(stream, kind=kind, on_done=on_done, resumable=resumable,
                                   model_name=self.models[kind].name, content_filter=self.content_filter,
                                   arrived_at=arrived_at,
                                   count_prompt_tokens=(lambda: count(kwargs["prompt"])) if count else None)

    def _filter_prompt(self, kwargs: dict[str, Any]) -> bool:
        """Run the content filter over the prompt(s); True when it says stop."""
        assert self.content_filter is not None
        for key in ("prompt", "negative_prompt"):
            value = kwargs.get(key)
            if isinstance(value, str):
                out = self.content_filter(value, "prompt")
                if out is STOP:
                    return True
                if isinstance(out, str):
                    kwargs[key] = out
            elif isinstance(value, list):
                messages = []
                for m in value:
                    out = self.content_filter(m["content"], "prompt")
                    if out is STOP:
                        return True
                    messages.append({**m, "content": out} if isinstance(out, str) else m)
                kwargs[key] = messages
        return False

    # -- shutdown ------------------------------------------------------------------------------

    def begin_drain(self, deadline_s: float | None = None, on_drained: Callable[[], None] | None = None) -> None:
        """Stop admitting (503), let running streams finish for ``deadline_s``, cancel the rest,
        give clients a moment to read their final events, then call ``on_drained``."""
        if self.draining:
            return
        self.draining = True
        deadline = self.settings.shutdown_deadline_s if deadline_s is None else deadline_s
        problem = Problem(503, "shutting_down", "the server is shutting down; retry on another instance",
                          {"Retry-After": "5"})
        for gate in self.gates.values():
            gate.close(problem)
        logger.info("draining: %d running streams get %.1f s to finish", self.registry.active(), deadline)
        asyncio.get_running_loop().create_task(self._drain(deadline, on_drained))

    async def _drain(self, deadline: float, on_drained: Callable[[], None] | None) -> None:
        end = time.monotonic() + deadline
        while self.registry.live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        self.registry.cancel_all("cancelled")
        end = time.monotonic() + self.settings.cancel_timeout_s + 1
        while self.registry.live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for record in list(self.registry.live.values()):
            record.force_finish()
        # Let attached clients read the final events before the connections close.
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(r.subscribers for r in self.registry.finished.values()):
            await asyncio.sleep(0.05)
        if self.drained is not None:
            self.drained.set()
        if on_drained is not None:
            on_drained()

    # -- health --------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        models = {k: {"name": s.name, "state": s.state, **({"error": s.error} if s.error else {})}
                  for k, s in self.models.items() if s.state != "disabled"}
        ready = all(m["state"] == "ready" for m in models.values()) and not self.draining
        return {"status": "draining" if self.draining else ("ok" if ready else "loading"), "ready": ready,
                "models": models, "active_streams": self.registry.active(),
                "queued": {k: g.queued for k, g in self.gates.items()},
                "uptime_s": round(time.time() - self.started_at, 3)}


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _filtered_stream() -> Stream:
    def producer(w: StreamWriter) -> None:
        w.finish_text("", [], 0, finish_reason="content_filter", text="",
                      usage={"prompt_tokens": 0, "completion_tokens": 0}, metrics={})
    return Stream(producer, kind="text")


async def _until_disconnected(
    awaitable: Any, request: Request | None, on_abandoned: Callable[[], Any] | None = None
) -> Any:
    """Await ``awaitable`` (a queue wait), giving up if the HTTP client goes away meanwhile.

    ``on_abandoned`` runs when the wait succeeded but its result never reached the caller (the
    caller was cancelled in between), so an admission slot won then is given back, not leaked.
    """
    task = asyncio.ensure_future(awaitable)
    delivered = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                result = task.result()
                delivered = True
                return result
            if request is not None and await request.is_disconnected():
                task.cancel()
                raise Problem(499, "client_closed", "the client went away while queued")
    finally:
        if not task.done():
            task.cancel()
        elif not delivered and on_abandoned is not None and not task.cancelled() and task.exception() is None:
            on_abandoned()


def _after(request: Request) -> int:
    # Last-Event-ID wins: an EventSource reconnects to the same URL (with its original ?after=)
    # and sends the id of the last event it really got.
    raw = request.headers.get("last-event-id")
    if raw is None:
        raw = request.query_params.get("after")
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise Problem(400, "invalid_argument", f"Last-Event-ID / after must be an event seq (an integer), got {raw!r}") from None
    if value < -1:
        raise Problem(400, "invalid_argument", f"Last-Event-ID / after must be >= -1, got {value}")
    return value


class _AuthMiddleware:
    """Bearer-key check for HTTP and WebSocket. Browsers cannot set headers on EventSource or
    WebSocket, so those two also accept ``?api_key=``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        problem = Problem(401, "unauthorized", "missing or wrong API key: send `Authorization: Bearer <key>`")
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            if "websocket.http.response" in scope.get("extensions", {}):
                body = problem.response().body
                await send({"type": "websocket.http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "websocket.http.response.body", "body": body})
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
            return
        await problem.response(openai=path.startswith(_OPENAI_PATHS))(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        if path in _OPEN_PATHS or path.startswith("/static/"):
            return True
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.key):
            return True
        if scope["type"] == "websocket" or scope.get("method") == "GET":
            from urllib.parse import parse_qs

            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            supplied = (query.get("api_key") or [""])[0].encode()
            return bool(supplied) and hmac.compare_digest(supplied, self.key)
        return False


def create_app(
    text_model: Any = None,
    image_model: Any = None,
    settings: ServerSettings | None = None,
    *,
    content_filter: ContentFilter | None = None,
    demo_path: str | None = None,
) -> FastAPI:
    """Build the ASGI app serving ``text_model`` and/or ``image_model``.

    Each model may be a loaded model (anything with ``.stream()``), ``"default"`` for the embedded
    model, a hub id or path, ``"module:factory"``, or a zero-argument callable; names are loaded
    in a background thread at startup (``/healthz`` says when they are ready). ``None`` = not served.

    ``content_filter(text, part)`` sees the prompt (``part="prompt"``) and every text delta
    (``part="delta"``); it returns the text to use (redacted or not), ``None`` to keep it, or
    `STOP` to end the stream with ``finish_reason="content_filter"``. It runs on the event loop,
    so keep it fast.

    ``demo_path`` (e.g. ``"/demo"``, what ``multistream serve`` uses) also serves the Gradio demo
    page on the same models, so one process serves the API and the page. The page runs through
    Gradio's own queue (its concurrency limit), not this server's admission gates and request
    limits, and its API calls cannot carry a bearer key: do not mount it on a keyed server.

    Example:
        >>> from multistream.server import create_app, STOP
        >>> from multistream.testing import ScriptedTextModel
        >>> app = create_app(ScriptedTextModel(), content_filter=lambda text, part: text.replace("secret", "***"))
    """
    settings = settings or ServerSettings()
    if content_filter is not None and not callable(content_filter):
        raise InvalidArgumentError("content_filter must be a function (text, part) -> str | None | STOP")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServerState(settings, text_model, image_model, content_filter)
        app.state.multistream = state
        for slot in state.models.values():
            slot.start_loading()
        janitor = asyncio.get_running_loop().create_task(_janitor(state))
        try:
            yield
        finally:
            janitor.cancel()
            state.registry.cancel_all()

    app = FastAPI(title="multistream", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)

    def state_of(request: Request) -> ServerState:
        return request.app.state.multistream  # type: ignore[no-any-return]

    @app.exception_handler(Problem)
    async def on_problem(request: Request, exc: Problem) -> Response:
        state = getattr(request.app.state, "multistream", None)
        if state is not None:
            state.metrics.rejected.inc(status=str(exc.status), reason=exc.type)
        return exc.response(openai=request.url.path.startswith(_OPENAI_PATHS))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return Problem(500, "internal_error", f"{type(exc).__name__}: {exc}").response(
            openai=request.url.path.startswith(_OPENAI_PATHS))

    @app.exception_handler(404)
    async def on_404(request: Request, exc: Exception) -> Response:
        return Problem(404, "not_found", f"no route {request.method} {request.url.path}").response(
            openai=request.url.path.startswith(_OPENAI_PATHS))

    @app.exception_handler(405)
    async def on_405(request: Request, exc: Exception) -> Response:
        return Problem(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}").response()

    @app.post("/v1/text")
    async def post_text(request: Request) -> Response:
        arrived = time.perf_counter()
        state = state_of(request)
        kwargs, priority = parse_text_body(await read_json(request, settings.max_body_bytes), settings)
        record = await state.open_stream("text", kwargs, priority=priority, request=request, arrived_at=arrived)
        return sse_response(record, settings)

    @app.post("/v1/image")
    async def post_image(request: Request) -> Response:
        arrived = time.perf_counter()
        state = state_of(request)
        kwargs, priority = parse_image_body(await read_json(request, settings.max_body_bytes), settings)
        record = await state.open_stream("image", kwargs, priority=priority, request=request, arrived_at=arrived)
        return sse_response(record, settings)

    @app.get("/v1/streams/{stream_id}/events")
    async def resume(stream_id: str, request: Request) -> Response:
        state = state_of(request)
        after = _after(request)
        record = state.registry.get(stream_id)
        if record is None or not record.resumable:
            raise Problem(404, "stream_not_found", f"no stream {stream_id!r} here: it never existed, or it finished "
                          f"more than {settings.retention_s:g} s ago (retention_s); start a new one")
        if record.done and after >= len(record.events) - 1:
            return Response(status_code=204, headers={"X-Stream-Id": stream_id})  # tells EventSource to stop
        if after >= len(record.events) and not record.done:
            raise Problem(400, "invalid_argument", f"event {after} has not happened yet in stream {stream_id} "
                          f"(last seq is {len(record.events) - 1})")
        return sse_response(record, settings, after=after)

    @app.get("/v1/streams/{stream_id}")
    async def stream_info(stream_id: str, request: Request) -> Response:
        record = state_of(request).registry.get(stream_id)
        if record is None:
            raise Problem(404, "stream_not_found", f"no stream {stream_id!r} here")
        return JSONResponse({"stream_id": stream_id, "kind": record.kind, "done": record.done,
                             "finish_reason": record.finish_reason, "events": len(record.events),
                             "subscribers": record.subscribers})

    @app.delete("/v1/streams/{stream_id}")
    async def cancel_stream(stream_id: str, request: Request) -> Response:
        record = state_of(request).registry.get(stream_id)
        if record is None:
            raise Problem(404, "stream_not_found", f"no stream {stream_id!r} here")
        record.cancel()
        return JSONResponse({"stream_id": stream_id, "cancelled": not record.done})

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        health = state_of(request).health()
        return JSONResponse(health, status_code=200 if health["status"] != "draining" else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return PlainTextResponse(state_of(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    if settings.enable_test_hooks:
        @app.post("/v1/_test/drop")
        async def drop(request: Request) -> Response:
            """Test hook: end every live SSE/WS subscription abruptly (streams keep running)."""
            return JSONResponse({"dropped_streams": state_of(request).registry.drop_connections()})

    from .openai_routes import add_openai_routes
    from .websocket import add_websocket_route

    add_openai_routes(app, settings, state_of)
    add_websocket_route(app, settings)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    if demo_path:
        _mount_demo(app, demo_path, image_model)
    if settings.api_key:
        app.add_middleware(_AuthMiddleware, key=settings.api_key)
    return app


def _mount_demo(app: FastAPI, path: str, image_spec: Any) -> None:
    """Serve the Gradio demo on the models this server loads (fetched when a request comes)."""
    from ..demo import mount_demo

    def provider(kind: str) -> Callable[[], Any]:
        def get() -> Any:
            slot: ModelSlot = app.state.multistream.models[kind]
            deadline = time.monotonic() + 300
            while slot.state in ("pending", "loading") and time.monotonic() < deadline:
                time.sleep(0.2)  # the page asked before the background load finished: wait for it
            return slot.get()

        return get

    # The embedded image model draws shapes: constrain the LLM's prompts to its vocabulary.
    style = "shapes" if image_spec == "default" else "auto"
    mount_demo(app, provider("text"), provider("image"), path=path, prompt_style=style)


async def _janitor(state: ServerState) -> None:
    while True:
        await asyncio.sleep(5.0)
        state.registry.evict()
