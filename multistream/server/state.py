"""Shared server state: the served models, admission gates, per-client quotas, the registry.

Routes get it through FastAPI's ``Depends(get_state)`` and the caller through ``Depends(get_principal)``;
the routes that start streams (`http.routes.RequestOnlyRoute`) call `state_of` and `principal_of`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from starlette.requests import HTTPConnection, Request

from ..engine import capacity_of
from ..errors import ModelLoadError
from ..stream import Stream, StreamWriter, reserved_stream_id
from .access.keys import KeyRing, Principal
from .access.metrics import Metrics
from .families import FAMILIES, Family, check_model_name, family
from .http.disconnect import until_done_or_gone
from .http.problems import Problem, problem_from_exception
from .settings import ServerSettings
from .streams.admission import Admission
from .streams.filtering import STOP, ContentFilter
from .streams.registry import Registry, StreamRecord
from .streams.starting import start_stream
from .streams.waiting import WaitingStreams

__all__ = ["ModelSlot", "ServerState", "get_principal", "get_state", "principal_of", "state_of"]

logger = logging.getLogger("multistream.server")


# One model loads at a time: diffusers and transformers build models under accelerate's
# init_empty_weights, which patches torch.nn.Module process-wide, so a text model built in another
# thread meanwhile gets meta tensors ("Cannot copy out of meta tensor"; seen in `multistream serve`
# loading both embedded models at once from a fresh venv).
_LOAD_LOCK = threading.Lock()


_GONE_WHILE_QUEUED = "the client went away while queued"

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
        self.error: str | None = None  # the exception's type name
        self.reason: str | None = None  # why, in one line, and the fix
        self.settled = threading.Event()  # set once the model is ready, failed or not served
        if spec is None:
            self.state = "disabled"
        elif isinstance(spec, (str, type)) or (callable(spec) and not hasattr(spec, "stream")):
            self.state = "pending"  # a name or a factory: loaded in the background at startup
        else:
            self.model, self.state = spec, "ready"
        if self.state != "pending":
            self.settled.set()

    @property
    def name(self) -> str:
        if self.model is not None:
            return str(getattr(self.model, "name", None) or self.kind)
        if self.spec == "default":  # the embedded model, by the name it will report once loaded
            return family(self.kind).embedded_name or self.kind
        return self.spec if isinstance(self.spec, str) else self.kind

    def start_loading(self) -> None:
        if self.state != "pending":
            return
        self.state = "loading"
        threading.Thread(target=self._load, name=f"multistream-load-{self.kind}", daemon=True).start()

    def _load(self) -> None:
        try:
            with _LOAD_LOCK:
                started = time.perf_counter()
                self.model = load_model(self.kind, self.spec)
            warm_up_model(self.model)  # outside the lock: it overlaps the next family's load
            self.state = "ready"
            logger.info("%s model %s is ready (loaded in %.1f s)", self.kind, self.name, time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - report it on /healthz, keep serving the rest
            self.error = type(exc).__name__  # the traceback is in the log, not on the wire
            self.reason = load_failure(self.kind, self.name, exc)
            # A ModelLoadError's message is the cause and the fix: no traceback under it.
            logger.error("%s", self.reason, exc_info=None if isinstance(exc, ModelLoadError) else exc)
            self.state = "failed"
        finally:
            self.settled.set()

    def get(self) -> Any:
        if self.state == "ready":
            return self.model
        if self.state == "disabled":
            raise Problem(404, "model_not_served", f"this server has no {self.kind} model; start it with "
                          f"`multistream serve --{self.kind}-model default` (or a model name)")
        if self.state == "failed":
            raise Problem(503, "model_failed", f"the {self.kind} model failed to load ({self.error}); "
                          "the server log has the details")
        raise Problem(503, "model_loading", f"the {self.kind} model is still loading; retry shortly",
                      {"Retry-After": "5"})


def load_failure(kind: str, name: str, exc: BaseException) -> str:
    """One line for the log and ``/readyz``: what failed to load, why, and the fix.

    Example:
        >>> load_failure("image", "default", ModuleNotFoundError("No module named 'greenlet'", name="greenlet"))
        "the image model default failed to load: ModuleNotFoundError: No module named 'greenlet'. Fix: install it (pip install greenlet, or ./scripts/setup.sh again), or serve without it: --image-model none, or --allow-partial"
    """
    message = " ".join(str(exc).split())[:600] or "(no message)"
    if isinstance(exc, ModelLoadError) and "Fix:" in message:  # the loader said the fix already
        return (f"the {kind} model {name} failed to load: {message}; or serve without it: --{kind}-model none, "
                "or --allow-partial")
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if missing:
        fix = f"install it (pip install {missing.split('.')[0]}, or ./scripts/setup.sh again)"
    elif isinstance(exc, (OSError, ValueError)):
        fix = f"check --{kind}-model {name!r} (a hub id in the local cache, a local path, 'module:factory' or 'default')"
    elif isinstance(exc, MemoryError) or "out of memory" in message.lower():
        fix = "free memory, pick a smaller model, or another --device"
    else:
        fix = "see the traceback above"
    return (f"the {kind} model {name} failed to load: {type(exc).__name__}: {message}. "
            f"Fix: {fix}, or serve without it: --{kind}-model none, or --allow-partial")


def load_model(kind: str, spec: Any) -> Any:
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


def warm_up_model(model: Any) -> None:
    """The model's ``warm_up()``, if it has one (a text model: the first chat request then starts
    from a cached system prompt); a failure is logged, never a failed load."""
    run = getattr(model, "warm_up", None)
    if not callable(run):
        return
    try:
        run()
    except Exception:  # noqa: BLE001 - the model loaded; a real request will show any problem
        logger.warning("warming up the %s model failed", type(model).__name__, exc_info=True)


class ServerState:
    """Everything the routes share: settings, models, admission gates, the stream registry."""

    def __init__(self, settings: ServerSettings, text_model: Any = None, image_model: Any = None,
                 content_filter: ContentFilter | None = None, keyring: KeyRing | None = None, *,
                 speech_model: Any = None, models: dict[str, Any] | None = None) -> None:
        """``models``: a model spec per family name (`families.FAMILIES`); ``text_model``,
        ``image_model`` and ``speech_model`` are the same, by keyword. A family left out is not served."""
        self.settings = settings
        self.keyring = keyring or KeyRing(settings)
        self.metrics = Metrics()
        self.registry = Registry(settings, self.metrics, _event_log(settings))
        specs = {"text": text_model, "image": image_model, "speech": speech_model, **(models or {})}
        self.models = {f.name: ModelSlot(f.name, specs.get(f.name)) for f in FAMILIES}
        # Concurrency left as None follows the model's engine capacity once the model is loaded.
        self.gates = {f.name: Admission(f.name, f.concurrency(settings) or 0, settings.queue_size) for f in FAMILIES}
        self.content_filter = content_filter
        self.draining = False
        self.continuer: Any = None  # with a Redis log: `continuation.Continuer`
        self.drained = asyncio.Event() if _has_loop() else None
        self._drain_task: asyncio.Task[None] | None = None  # begin_drain's (held: a task nobody holds may be collected)
        self.started_at = time.time()
        self.loop = asyncio.get_running_loop() if _has_loop() else None
        self.in_use: dict[str, int] = {}  # principal id -> streams queued or running
        self.waiting = WaitingStreams()  # queued requests whose client holds their id (cancel by id)
        m = self.metrics
        m.gauge("multistream:num_requests_running", "Streams generating now.",
                lambda: [({"kind": k}, float(self.registry.active(k))) for k in self.gates])
        m.gauge("multistream:num_requests_waiting", "Requests waiting for a slot.",
                lambda: [({"kind": k}, float(g.queued)) for k, g in self.gates.items()])
        m.gauge("multistream:retained_streams", "Finished streams kept for replay.",
                lambda: [({}, float(len(self.registry.finished)))])
        m.gauge("multistream:retained_bytes", "Approximate bytes held by replay logs (live and finished).",
                lambda: [({"state": "finished"}, float(self.registry.retained_bytes)),
                         ({"state": "live"}, float(self.registry.live_bytes()))])
        m.gauge("multistream:model_ready", "1 when the model is loaded and serving.",
                lambda: [({"kind": k, "model": s.name}, float(s.state == "ready"))
                         for k, s in self.models.items() if s.state != "disabled"])
        log = self.registry.log
        if log is not None:
            log.start(on_cancel=self.registry.cancel_remote_request, on_control=self._on_control)
            m.gauge("multistream:event_log_up", "1 while the shared event log (Redis) answers.",
                    lambda: [({}, float(log.up))])
            m.gauge("multistream:event_log_write_failures", "Streams whose event log writes failed.",
                    lambda: [({}, float(log.write_failures))])

    @property
    def ready(self) -> bool:
        """Every model loaded; with ``allow_partial``, every model settled and one of them loaded."""
        if self.draining:
            return False
        states = [s.state for s in self.models.values()]
        if self.settings.allow_partial and "failed" in states:
            return "ready" in states and not any(st in ("pending", "loading") for st in states)
        return all(st in ("ready", "disabled") for st in states)

    @property
    def failed(self) -> dict[str, str]:
        """The models that failed to load, by kind: why, and the fix."""
        return {k: s.reason or s.error or "failed" for k, s in self.models.items() if s.state == "failed"}

    # -- opening streams -----------------------------------------------------------------------

    def model_for(self, kind: str) -> Any:
        """The loaded model of family ``kind``; a `Problem` when it is not served, loading or failed."""
        return self.models[family(kind).name].get()

    def check_model_name(self, kind: str, requested: Any) -> None:
        """An OpenAI body's ``model`` must name the family's served model (or an alias): else 404
        ``model_not_found``."""
        fam = family(kind)
        check_model_name(fam, requested, self.models[fam.name].name)

    def cap_priority(self, priority: int, principal: Principal | None) -> int:
        """The client's priority, clamped to its ceiling (per key, or the server default)."""
        ceiling = principal.max_priority if principal is not None else self.settings.max_priority
        return max(-ceiling - 1000, min(int(priority), ceiling))

    async def open_stream(self, kind: str, kwargs: dict[str, Any], *, priority: int = 0,
                          request: Request | None = None, resumable: bool = True,
                          arrived_at: float | None = None, principal: Principal | None = None,
                          on_queued: Callable[[int, int], None] | None = None,
                          reserved: tuple[str, str] | None = None) -> StreamRecord:
        """Admit a request (quota, queue, limits), start the model, register the stream; raises `Problem`.

        ``on_queued(position, queued)`` is told where the request stands while it waits for a slot
        (`Admission.acquire`); ``reserved`` = (stream id, resume token) the stream gets, handed to
        the client before it was admitted (`sse.queued_sse_response`)."""
        arrived_at = arrived_at if arrived_at is not None else time.perf_counter()
        if self.draining:
            raise Problem(503, "shutting_down", "the server is shutting down; retry on another instance",
                          {"Retry-After": "5"})
        fam = family(kind)
        kind = fam.name
        slot = self.models[kind]
        model = slot.get()
        await self.registry.check_log()  # a 503 now rather than a stream nobody could resume elsewhere
        gate = self.gates[kind]
        if not gate.concurrency:
            gate.concurrency = _capacity(model, kind)
        priority = self.cap_priority(priority, principal)
        kwargs = fam.with_server_defaults(kwargs, self.settings)
        if fam.adapt is not None:
            kwargs = fam.adapt(model, kwargs)
        if fam.check_model is not None:
            try:
                fam.check_model(model, kwargs)
            except Exception as exc:  # noqa: BLE001 - said as .stream() would have said it: a 400 for bad input
                raise _start_problem(kind, exc) from None
        owner = principal.id if principal is not None else None
        keyed = bool(principal is not None and principal.keyed)
        if principal is not None and keyed and _stream_takes(model, "cache_salt"):
            kwargs = fam.salted_for(kwargs, principal.id)  # each API key's prompts are cached apart
        if self.content_filter is not None and self._filter_input(fam, kwargs):
            if fam.refuse_filtered:
                field = " and ".join(f"'{name}'" for name in fam.filter_fields)
                raise Problem(400, "content_filter", f"the request's {field} was rejected by the content filter",
                              param=fam.filter_fields[0])
            return self.registry.start(_filtered_stream(kind), kind=kind, resumable=resumable,
                                       model_name=slot.name, arrived_at=arrived_at, owner=owner,
                                       owner_keyed=keyed)
        release_quota = self._take_quota(principal)
        gate = self.gates[kind]
        waited = time.perf_counter()
        if not gate.try_acquire():  # no free slot: wait in the queue, given up if the client goes
            try:
                await until_done_or_gone(gate.acquire(priority, self.settings.queue_timeout_s, on_queued), request,
                                         on_abandoned=gate.release, message=_GONE_WHILE_QUEUED)
            except BaseException:
                release_quota()
                raise
        self.metrics.queue_wait.observe(time.perf_counter() - waited, kind=kind)
        started = time.perf_counter()
        try:
            if self.draining:
                raise Problem(503, "shutting_down", "the server is shutting down", {"Retry-After": "5"})
            if _takes_priority(model):
                kwargs["priority"] = priority  # the engine serves higher priorities first at every step
            plan = None
            if self.registry.log is not None and fam.continues:
                from .durable.continuation import durable_plan

                # A restart continues it (`durable.continuation`): an image's seed fixed, its checkpoints kept.
                plan = durable_plan(self.registry.log, kind, model, kwargs, self.settings.image_checkpoint_every,
                                    resumable)
                kwargs = plan.kwargs
            extra = plan.extra if plan is not None else {}

            def start() -> Stream:
                with reserved_stream_id(reserved[0]) if reserved else contextlib.nullcontext():
                    return model.stream(**kwargs, **extra)  # type: ignore[no-any-return]

            # A model whose start is quick (``quick_stream_start``, TextModel's) skips the hand-off for the
            # requests its family says start at once (`Family.quick_start`: no grammar, a short prompt);
            # `start_stream` keeps on the loop a model whose .stream() needs it (the Ray handle).
            quick = (not extra and getattr(model, "quick_stream_start", False) and fam.quick_start is not None
                     and fam.quick_start(kwargs))
            stream = start() if quick else await start_stream(model, lambda _model: start())
        except BaseException as exc:
            gate.release()
            release_quota()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _start_problem(kind, exc) from None

        def on_done(record: StreamRecord) -> None:
            gate.release(time.perf_counter() - started)
            release_quota()

        count = getattr(model, "count_tokens", None)
        record = self.registry.start(stream, kind=kind, on_done=on_done, resumable=resumable, model_name=slot.name,
                                     content_filter=self.content_filter if fam.filters_output else None,
                                     arrived_at=arrived_at, owner=owner, owner_keyed=keyed,
                                     token=reserved[1] if reserved else None,
                                     count_prompt_tokens=(lambda: count(kwargs["prompt"])) if count else None)
        record.request = kwargs  # as the model got it (after the filter): a final the server writes reads it
        if self.content_filter is not None:
            record.input_filter = self._run_filter  # a steer's or rewind's new instruction is input too
        if plan is not None:
            from .durable.continuation import remember_request

            remember_request(self.registry.log, record, kwargs, plan.checkpoints)
        return record

    def _take_quota(self, principal: Principal | None) -> Callable[[], None]:
        """Count one more request queued or running for ``principal`` (a 429 past its quota);
        returns the function that gives it back (once)."""
        if principal is None:
            return lambda: None
        used = self.in_use.get(principal.id, 0)
        if used >= principal.concurrency:
            raise Problem(429, "quota_exceeded", f"you already have {used} streams queued or running, your "
                          f"quota ({'per key' if principal.keyed else 'per client address'}: client_concurrency "
                          "or the key's concurrency=); wait for one to finish", {"Retry-After": "2"})
        self.in_use[principal.id] = used + 1
        released = False

        def release_quota() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.in_use.get(principal.id, 1) - 1
                if left > 0:
                    self.in_use[principal.id] = left
                else:
                    self.in_use.pop(principal.id, None)

        return release_quota

    async def run_admitted(self, kind: str, call: Callable[[Any], Any], *, priority: int = 0,
                           request: Request | None = None, principal: Principal | None = None) -> Any:
        """``call(model)`` on a worker thread, admitted like a stream: the client's quota, the
        model's queue and one of its slots, held until the call returns. For model work that is
        not a stream, e.g. scoring a prompt for /v1/completions' ``echo``.

        Example:
            >>> entries = await state.run_admitted("text", lambda m: m.score("Hi"))   # doctest: +SKIP
        """
        if self.draining:
            raise Problem(503, "shutting_down", "the server is shutting down; retry on another instance",
                          {"Retry-After": "5"})
        kind = family(kind).name
        model = self.models[kind].get()
        gate = self.gates[kind]
        if not gate.concurrency:
            gate.concurrency = _capacity(model, kind)
        release_quota = self._take_quota(principal)
        try:
            await until_done_or_gone(gate.acquire(self.cap_priority(priority, principal),
                                                  self.settings.queue_timeout_s), request, on_abandoned=gate.release,
                                     message=_GONE_WHILE_QUEUED)
        except BaseException:
            release_quota()
            raise
        started = time.perf_counter()
        try:
            return await asyncio.to_thread(call, model)
        finally:
            gate.release(time.perf_counter() - started)
            release_quota()

    def _filter_input(self, fam: Family, kwargs: dict[str, Any]) -> bool:
        """Run the content filter over the request's input (the family's ``filter_fields``: each
        prompt, each chat message, the text to speak), redacting in place; True when it says stop."""
        assert self.content_filter is not None
        for key in fam.filter_fields:
            value = kwargs.get(key)
            if isinstance(value, str):
                out = self._run_filter(value)
                if out is STOP:
                    return True
                if isinstance(out, str):
                    kwargs[key] = out
            elif isinstance(value, list):
                messages = []
                for m in value:
                    out = self._run_filter(m["content"])
                    if out is STOP:
                        return True
                    messages.append({**m, "content": out} if isinstance(out, str) else m)
                kwargs[key] = messages
        return False

    def _run_filter(self, text: str) -> Any:
        assert self.content_filter is not None
        try:
            return self.content_filter(text, "prompt")
        except Exception:  # noqa: BLE001 - a failing filter fails closed
            logger.exception("the content filter raised on a prompt; refusing it")
            return STOP

    async def _on_control(self, message: dict[str, Any]) -> dict[str, Any]:
        """An edit another process forwarded (its body already checked there) for a stream that
        runs here: apply it, answer the verdict (`event_log.serve_control`)."""
        from .durable.event_log import verdict
        from .streams.edits import apply_parsed_edit

        sid, command = message.get("stream_id"), message.get("command")
        args, kwargs = message.get("args"), message.get("kwargs")
        if command not in ("finish", "steer", "rewind") or not isinstance(args, list) or not isinstance(kwargs, dict):
            return verdict(Problem(400, "invalid_message", "malformed forwarded edit"))
        record = self.registry.live.get(sid) or self.registry.finished.get(sid) if isinstance(sid, str) else None
        if record is None:
            return verdict(Problem(409, "stream_finished", f"stream {str(sid)[:64]} is not running any more, so it "
                                   f"cannot {command}"))
        status, result = await apply_parsed_edit(record, command, args, kwargs, self.registry.log)
        return verdict(accepted=bool(result["accepted"]), status=status)

    # -- shutdown ------------------------------------------------------------------------------

    def begin_drain(self, deadline_s: float | None = None, on_drained: Callable[[], None] | None = None) -> None:
        """Stop admitting (503), let running streams finish for ``deadline_s``, cancel the rest
        (with a Redis event log, hand off those another server can continue: `continuation.hand_off`),
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
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(deadline, on_drained))

    def stop_now(self) -> int:
        """Stop admitting, and end every running stream at once with a final ``cancelled`` event:
        no deadline, no hand-off, no wait for a model to stop (a second Ctrl-C). A drain under
        way then finishes at once. Returns how many streams were running.

        Example:
            >>> state.loop.call_soon_threadsafe(state.stop_now)   # doctest: +SKIP
        """
        if not self.draining:
            self.begin_drain(0.0)
        return self.registry.end_all_now("cancelled")

    async def _drain(self, deadline: float, on_drained: Callable[[], None] | None) -> None:
        # ``on_drained`` stops the server (`runner.DrainingServer`): it runs whatever ending the streams
        # raised: before, a drain that raised never called it, and a SIGTERM'd server stayed up.
        try:
            await self._end_streams(deadline)
        except Exception:  # noqa: BLE001 - said with its traceback; the server stops all the same
            logger.exception("draining: ending the streams failed; stopping anyway")
        finally:
            if self.drained is not None:
                self.drained.set()
            if on_drained is not None:
                on_drained()

    async def _end_streams(self, deadline: float) -> None:
        """The drain's work (`begin_drain`): the deadline, the hand-off, the cancel, the readers' moment."""
        end = time.monotonic() + deadline
        while self.registry.live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if self.registry.log is not None:
            # A durable log: what another server can continue is handed off, not ended (`durable.continuation`).
            from .durable.continuation import hand_off

            try:
                await hand_off(self)
            except Exception as exc:  # noqa: BLE001 - Redis away: the next server claims them as orphans
                logger.warning("draining: handing streams off failed (%s: %s)", type(exc).__name__, exc)
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

    # -- health --------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        models = {k: {"name": s.name, "state": s.state, **({"error": s.error} if s.error else {}),
                      **({"reason": s.reason} if s.reason else {})}
                  for k, s in self.models.items() if s.state != "disabled"}
        ready = self.ready
        # A failed model is never reported as loading: "degraded" says some model will not come.
        status = ("draining" if self.draining else "degraded" if self.failed else "ok" if ready else "loading")
        return {"status": status, "ready": ready,
                "models": models, "active_streams": self.registry.active(),
                "queued": {k: g.queued for k, g in self.gates.items()},
                "uptime_s": round(time.time() - self.started_at, 3)}


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _start_problem(kind: str, exc: BaseException) -> Problem:
    """What the model's ``.stream()`` raised, as the client's problem when it is about the input."""
    problem = problem_from_exception(exc)
    if problem.status < 500:
        return problem
    name = type(exc).__name__
    # A prompt the tokenizer or the chat template cannot take (a TypeError on odd text, a Jinja
    # TemplateError raised by the template itself) is about the request, not a server fault.
    if isinstance(exc, (TypeError, ValueError, UnicodeError, KeyError)) or "Template" in name:
        logger.info("a %s request was refused by the model: %s: %s", kind, name, exc)
        return Problem(400, "invalid_prompt", f"the {kind} model cannot take this prompt ({name}: {str(exc)[:200]}); "
                       "check the prompt or chat messages (roles, text)")
    logger.error("starting a %s stream failed", kind, exc_info=exc)
    return problem


def _filtered_stream(kind: str) -> Stream:
    """A text answer the content filter stopped before it began: an empty final."""
    def producer(w: StreamWriter) -> None:
        w.finish_text("", [], 0, finish_reason="content_filter", text="",
                      usage={"prompt_tokens": 0, "completion_tokens": 0}, metrics={})
    return Stream(producer, kind=kind)


def state_of(conn: HTTPConnection) -> ServerState:
    """The app's `ServerState`, for a route without a ``{stream_id}`` (`get_state` otherwise)."""
    return conn.app.state.multistream  # type: ignore[no-any-return]


async def get_state(conn: HTTPConnection) -> ServerState:
    """FastAPI dependency: the app's `ServerState`. With a shared event log, a route about a
    stream this process does not hold (``{stream_id}`` in its path) first loads it from the log."""
    state = state_of(conn)
    stream_id = conn.path_params.get("stream_id") if state.registry.log is not None else None
    if isinstance(stream_id, str):
        await state.registry.fetch(stream_id)
    return state


def _event_log(settings: ServerSettings) -> Any:
    url = settings.event_log
    if not url or url == "memory" or not _has_loop():
        return None
    from .durable.event_log import RedisEventLog

    return RedisEventLog(url, settings)


async def get_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency: who is calling (set by the security middleware). Async, so FastAPI
    calls it on the loop rather than through a worker thread (a thread hop per request)."""
    return principal_of(conn)


def principal_of(conn: HTTPConnection) -> Principal:
    """Who is calling (`get_principal` without FastAPI: a `RequestOnlyRoute`'s endpoint)."""
    principal = getattr(conn.state, "principal", None)
    if principal is None:  # an app used without its middleware (should not happen)
        client = conn.client
        principal = Principal(f"addr:{client.host if client else 'unknown'}", 0, 1, False)
    return principal  # type: ignore[no-any-return]


def _capacity(model: Any, kind: str) -> int:
    """How many streams the model's engine serves at once (its ``capacity``), else a safe default."""
    return capacity_of(model)


_STREAM_TAKES: weakref.WeakKeyDictionary[Any, dict[str, bool]] = weakref.WeakKeyDictionary()


def _takes_priority(model: Any) -> bool:
    return _stream_takes(model, "priority")


def _stream_takes(model: Any, option: str) -> bool:
    """Does ``model.stream`` take ``option``? Asked once per model and option (inspect.signature
    costs about 50 us, and this is on every request's path); a model may be anything with a
    ``.stream()``, so what the server adds by itself must be asked for first."""
    try:
        known = _STREAM_TAKES.setdefault(model, {})
    except TypeError:  # not weakly referenceable (or unhashable): ask each time
        return _signature_takes(model, option)
    if option not in known:
        known[option] = _signature_takes(model, option)
    return known[option]


def _signature_takes(model: Any, option: str) -> bool:
    import inspect

    try:
        params = inspect.signature(model.stream).parameters
    except (TypeError, ValueError):
        return False
    # The families take every option as keywords (`TextOptions`, `ImageOptions`, priority among them).
    return option in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
