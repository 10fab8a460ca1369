"""multistream as a Ray Serve application: one HTTP ingress, one deployment per model kind.

- ``ingress`` (FastAPI, the same app as ``multistream serve``: native SSE and WebSocket routes,
  resume, OpenAI routes, metrics): admission, quotas, content filter and the event log run here;
  its models are proxies (`RemoteModel`) that stream from the model deployments through
  deployment handles (``handle.options(stream=True)``).
- ``text`` and ``image``: each replica loads its model once and runs its engine (continuous
  batching inside the replica); ``num_replicas`` or an autoscaling config per kind.

Failover: when a model replica dies mid-stream (a crash, a lost node, ``ray.kill``), the ingress
resubmits the request to a live replica and continues from what it already sent: for text the
prompt plus the tokens already emitted are prefilled (``TextModel.stream(resume_tokens=...)``; a
model without it regenerates and the replica skips what was sent, exact for greedy and seeded
sampling since draws depend only on (seed, position)). For images, with ``event_log`` the image
replica writes the stream's newest `ImageCheckpoint` to Redis every ``image_checkpoint_every``
steps (`checkpoint_key`: ``ms:ckpt:{stream id}``, deleted when the stream ends); the replica
taking over continues from it (``ImageModel.stream(resume_from=...)``, the final event's
``metrics["resumed_from_step"]``) and ends with the uninterrupted run's picture (bit for bit on
the same device when steps are not batched with other requests, ``max_batch=1``; within float
rounding when they are); with no usable checkpoint it denoises from step 0 with the same seed
(fixed by the ingress). Previews up to the last step sent are skipped. The client sees one
stream: no duplicate, nothing out of order, no text or final missing (a preview that a newer one
replaced while the client was away is skipped, as on one server). With several
ingress replicas, ``event_log`` (Redis) makes a resume work on any of them.

Edits (finish, steer, rewind) reach the replica generating the stream through the event log's
control channel (``ms:ctl:replica:{name}``; `RemoteModel.forward_edit`), so they need
``event_log``; a cancel cancels the replica's streaming call. The text replica reports each
edit as it takes effect (a ``{"edit": ...}`` item in its handle stream, before the events after
it); after a failover the new replica gets the instruction tokens still in the context
(``TextModel.stream(resume_inserted=...)``), so the answer goes on as the uninterrupted steered
one would, and ``revision`` numbers and the final ``revisions`` span all replicas. An image
steer travels in the checkpoint (its conditioning). A rewind's new sampling options are not
carried over.

Example:
    $ multistream serve --ray --text-replicas 2 --image-replicas 0 --event-log redis://127.0.0.1:6379/0
    >>> from multistream.server.ray_app import build_app                       # doctest: +SKIP
    >>> serve.run(build_app(ServerSettings(event_log="redis://..."), text_replicas=2), route_prefix="/")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import random
import signal
import threading
import time
from typing import Any

from ..events import ErrorEvent, Event, ImageEvent, TextEvent
from ..stream import Stream, StreamWriter
from .settings import ServerSettings

__all__ = ["ModelReplica", "RemoteModel", "app_builder", "build_app", "serve_ray"]

logger = logging.getLogger("multistream.server")

APP_NAME = "multistream"
_PREFIX = "ms:"  # the event log's key prefix (`RedisEventLog`)
_MAX_FAILOVERS = 8
_FAILOVER_WINDOW_S = 60.0
_MODEL_WAIT_S = 600.0  # how long an ingress replica waits for its model deployments before it starts
_CHECKPOINT_TTL_S = 600  # an image checkpoint outlives its last write by this much (a stream not ended cleanly)


def checkpoint_key(stream_id: str) -> str:
    """The Redis key of the newest image checkpoint of ``stream_id`` (``ms:ckpt:{id}``)."""
    return f"{_PREFIX}ckpt:{stream_id}"


def _retryable() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, ReplicaUnavailableError, DeploymentUnavailableError)


class _CheckpointWriter:
    """Keeps the newest checkpoint of one image stream in Redis (`checkpoint_key`).

    ``put`` runs on the model's engine thread and only hands the checkpoint over; one task on the
    replica's event loop serializes and writes the newest one (a checkpoint superseded before its
    turn is never written, so a slow Redis costs checkpoints, never denoising time). ``close``
    waits for the write in flight and deletes the key: the stream has ended.
    """

    def __init__(self, client: Any, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.client, self.key, self.loop = client, key, loop
        self._lock = threading.Lock()
        self._newest: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.writes = 0
        self.write_s = 0.0
        self.nbytes = 0
        self.failed = 0

    def put(self, checkpoint: Any) -> None:
        with self._lock:
            self._newest = checkpoint
        self.loop.call_soon_threadsafe(self._kick)

    def _kick(self) -> None:
        if not self._closed and (self._task is None or self._task.done()):
            self._task = self.loop.create_task(self._drain(), name=f"multistream-ckpt-{self.key[-8:]}")

    async def _drain(self) -> None:
        while not self._closed:
            with self._lock:
                checkpoint, self._newest = self._newest, None
            if checkpoint is None:
                return
            started = time.perf_counter()
            try:
                data = checkpoint.to_bytes()
                await self.client.set(self.key, data, ex=_CHECKPOINT_TTL_S)
            except Exception as exc:  # noqa: BLE001 - a lost checkpoint only makes a failover start earlier
                self.failed += 1
                logger.debug("writing image checkpoint %s failed: %s", self.key, exc)
                continue
            self.writes += 1
            self.write_s += time.perf_counter() - started
            self.nbytes = len(data)

    def metrics(self) -> dict[str, float]:
        out = {"checkpoint_writes": float(self.writes)}
        if self.writes:
            out["checkpoint_write_ms"] = self.write_s * 1e3 / self.writes
            out["checkpoint_bytes"] = float(self.nbytes)
        return out

    async def close(self, delete: bool) -> None:
        """Stop writing; ``delete`` the key once the stream has ended (else it expires)."""
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except Exception:  # noqa: BLE001
                pass
        if not delete:
            return
        try:
            await self.client.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            logger.debug("deleting image checkpoint %s failed: %s", self.key, exc)


class ModelReplica:
    """One model replica (deployment ``text`` or ``image``): loads the model, streams events.

    An image replica with an event log writes each stream's newest `ImageCheckpoint` to Redis
    every ``checkpoint_every`` steps (`checkpoint_key`); the replica that takes the stream over
    after a failure continues from it.
    """

    def __init__(self, kind: str, spec: Any, event_log: str | None = None, checkpoint_every: int = 1) -> None:
        from .state import load_model

        self.kind = kind
        self.checkpoint_every = max(1, int(checkpoint_every))
        self._redis: Any = None
        self.event_log = event_log if event_log and event_log.startswith(("redis://", "rediss://", "unix://")) else None
        self.streams: dict[str, Stream] = {}  # ingress stream id -> the generation running here (for edits)
        self._control: asyncio.Task[None] | None = None
        self.model = load_model(kind, "default" if spec is None else spec)
        self.name = str(getattr(self.model, "name", None) or kind)
        try:
            params = inspect.signature(self.model.stream).parameters
        except (TypeError, ValueError):  # pragma: no cover
            params = {}
        self.native_resume = "resume_tokens" in params
        # A text model that reports its edits and takes them back: a failover replays steers.
        self.replays_edits = self.native_resume and "resume_inserted" in params and "on_edit" in params
        self.checkpoints = kind == "image" and self.event_log is not None and "on_checkpoint" in params
        try:
            import ray

            self.replica = ray.get_runtime_context().get_actor_name() or ""
        except Exception:  # noqa: BLE001
            self.replica = ""

    def info(self) -> dict[str, Any]:
        capacity = getattr(self.model, "capacity", None)
        return {"kind": self.kind, "name": self.name, "replica": self.replica, "pid": os.getpid(),
                "native_resume": self.native_resume, "checkpoints": self.checkpoints,
                "capacity": capacity if isinstance(capacity, int) else 4}

    def _client(self) -> Any:
        if self._redis is None:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(self.event_log, socket_connect_timeout=2.0, socket_timeout=5.0)
        return self._redis

    async def _newest_checkpoint(self, key: str) -> bytes | None:
        try:
            data = await self._client().get(checkpoint_key(key))
        except Exception as exc:  # noqa: BLE001 - no checkpoint: the run starts from step 0
            logger.warning("stream %s: reading its image checkpoint failed (%s); denoising from step 0", key, exc)
            return None
        return bytes(data) if data else None

    def _listen(self) -> None:
        """Start answering edits for the streams running here (``ms:ctl:replica:{name}``)."""
        if self._control is not None or self.event_log is None or not self.replica:
            return
        import redis.asyncio as aioredis

        from .event_log import serve_control

        client = aioredis.from_url(self.event_log, socket_connect_timeout=2.0)
        self._control = asyncio.get_running_loop().create_task(
            serve_control(client, _PREFIX, f"replica:{self.replica}", self._on_control), name="multistream-replica-control")

    async def _on_control(self, message: dict[str, Any]) -> dict[str, Any]:
        from .event_log import apply_command, verdict
        from .problems import Problem

        stream = self.streams.get(str(message.get("stream_id")))
        command, args, kwargs = message.get("command"), message.get("args"), message.get("kwargs")
        if command not in ("finish", "steer", "rewind") or not isinstance(args, list) or not isinstance(kwargs, dict):
            return verdict(Problem(400, "invalid_message", "malformed forwarded edit"))
        if stream is None:
            return {"gone": True}
        return verdict(accepted=apply_command(stream, command, args, kwargs))

    async def generate(self, kwargs: dict[str, Any], resume: dict[str, Any] | None = None, key: str | None = None) -> Any:
        """Yield the replica's name, then the stream's events, trimmed to what follows ``resume``
        (``{"tokens": [...], "chars": n, "inserted": [[k, ids], ...]}`` for text, ``{"step": s}``
        for an image; ``"failover": True``: the image run continues from the stream's newest
        checkpoint, if there is one), with ``{"edit": ...}`` items as text edits take effect.
        ``key`` (the ingress's stream id) names the generation for edits forwarded here and its
        checkpoints."""
        self._listen()
        yield {"replica": self.replica}
        resume = resume or {}
        tokens = list(resume.get("tokens") or [])
        kwargs = dict(kwargs)
        trim_tokens, trim_chars, trim_step = 0, 0, int(resume.get("step", -1))
        failover = bool(resume.get("failover")) or trim_step >= 0
        edits: collections.deque[dict[str, Any]] = collections.deque()
        if self.kind == "text" and self.replays_edits:
            kwargs["on_edit"] = edits.append  # engine thread; relayed before the events that follow the edit
        if self.kind == "text" and tokens:
            if self.native_resume:
                kwargs["resume_tokens"] = tokens
                if self.replays_edits and resume.get("inserted"):
                    # An instruction after tokens the ingress never got (held back, then cut) goes at the end.
                    kwargs["resume_inserted"] = [(min(int(k), len(tokens)), list(ids)) for k, ids in resume["inserted"]]
            else:
                trim_tokens, trim_chars = len(tokens), int(resume.get("chars", 0))
        writer: _CheckpointWriter | None = None
        if self.checkpoints and key is not None:
            writer = _CheckpointWriter(self._client(), checkpoint_key(key), asyncio.get_running_loop())
            kwargs.update(on_checkpoint=writer.put, checkpoint_every=self.checkpoint_every)
            if failover:
                data = await self._newest_checkpoint(key)
                if data is not None:
                    kwargs["resume_from"] = data
        try:
            try:
                stream = self.model.stream(**kwargs)
            except Exception as exc:  # noqa: BLE001
                if "resume_from" not in kwargs:
                    raise
                # A checkpoint this run cannot use (another model version, a corrupt value): from step 0.
                logger.warning("stream %s: its image checkpoint is unusable (%s); denoising from step 0", key, exc)
                del kwargs["resume_from"]
                stream = self.model.stream(**kwargs)
            else:
                if "resume_from" in kwargs:
                    logger.info("stream %s: image resumed from its checkpoint on replica %s", key, self.replica)
        except Exception as exc:  # noqa: BLE001 - a refusal reaches the client as an error event
            yield ErrorEvent(stream_id="", seq=0, t=0.0, error={"type": type(exc).__name__, "message": str(exc)})
            return
        if key is not None:
            self.streams[key] = stream
        ended = False  # the final event went out; otherwise (a drain, a cancelled call) keep the checkpoint
        try:
            async for ev in stream:
                while edits:
                    yield {"edit": edits.popleft()}
                if isinstance(ev, TextEvent) and (trim_tokens or trim_chars):
                    ev = _trim_text(ev, trim_tokens, trim_chars)
                    if ev is None:
                        continue
                elif isinstance(ev, ImageEvent) and not ev.is_final and ev.finish_reason is None and ev.step <= trim_step:
                    continue
                if writer is not None and isinstance(ev, ImageEvent) and ev.is_final:
                    ev = dataclasses.replace(ev, metrics={**(ev.metrics or {}), **writer.metrics()})
                ended = ended or ev.is_final
                yield ev
        finally:
            if key is not None and self.streams.get(key) is stream:
                del self.streams[key]
            stream.close()
            if writer is not None:
                # A replica drained or a call cancelled mid-run leaves the checkpoint for the replica
                # that takes over; it expires on its own.
                await writer.close(delete=ended)


def _trim_text(ev: TextEvent, tokens: int, chars: int) -> TextEvent | None:
    """The part of a regenerated event that comes after ``tokens`` tokens / ``chars`` characters."""
    end_tokens = ev.index + len(ev.token_ids)
    offset = ev.offset if ev.offset is not None else 0
    end_chars = offset + len(ev.delta)
    if end_tokens <= tokens and end_chars <= chars and not ev.is_final:
        return None
    delta = ev.delta[max(0, chars - offset):] if offset < chars else ev.delta
    ids = list(ev.token_ids[max(0, tokens - ev.index):]) if ev.index < tokens else list(ev.token_ids)
    return dataclasses.replace(ev, delta=delta, token_ids=ids, index=max(ev.index, tokens), offset=max(offset, chars))


def _check_here(kind: str, kwargs: dict[str, Any]) -> None:
    """The model-independent argument checks (torch-free, the models' own code), at the ingress: a
    bad argument is a 400 there, as on a single server, not an error event in a 200 stream. What
    needs the model (a prompt longer than its context, a size its VAE cannot make) is checked on
    the replica."""
    if kind == "image":
        from ..image import parse_image_options

        parse_image_options(**kwargs)
    elif kind == "text":
        from ..text import TEXT_STREAM_ARGS, check_prompt, parse_text_options

        check_prompt(kwargs.get("prompt"))
        parse_text_options(**{k: v for k, v in kwargs.items() if k in TEXT_STREAM_ARGS})


class RemoteModel:
    """The ingress's stand-in for a model: ``.stream(**kwargs)`` streams from the model deployment,
    failing over to another replica when one dies."""

    def __init__(self, kind: str, handle: Any, name: str = "", event_log: str | None = None) -> None:
        self.kind = kind
        self.handle = handle
        self.event_log = event_log if event_log and event_log.startswith(("redis://", "rediss://", "unix://")) else None
        self._redis: Any = None
        self.name = name or kind
        self.replica_of: dict[str, str] = {}  # stream id -> replica serving it now (for tests, metrics)
        self.failovers = 0
        self.capacity = 4

    def stream(self, **kwargs: Any) -> Stream:
        _check_here(self.kind, kwargs)
        loop = asyncio.get_running_loop()
        if self.kind == "image" and kwargs.get("seed") is None and "generator" not in kwargs:
            # Fixed here, once: a replica that takes the stream over must draw the same noise.
            kwargs = {**kwargs, "seed": random.randrange(2**31)}

        def submit(writer: StreamWriter) -> None:
            # A fresh context: Serve ties handle calls made inside a request to that request and
            # cancels them when its client goes away, but the stream must outlive the connection
            # (the grace period, a resume); the registry cancels it when it should.
            task = loop.create_task(self._pump(writer, kwargs), name=f"multistream-remote-{writer.stream_id[:8]}",
                                    context=contextvars.Context())
            writer.on_cancel(lambda: loop.call_soon_threadsafe(task.cancel))

        stream = Stream(kind=self.kind, submit=submit)
        # The server's edit routes look for this (`routes_native.apply_edit`): edits travel to the replica.
        stream.forward_edit = functools.partial(self.forward_edit, stream.stream_id)  # type: ignore[attr-defined]
        return stream

    async def forward_edit(self, stream_id: str, command: str, args: list[Any],
                           kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """Send finish/steer/rewind to the replica generating ``stream_id`` (Redis control channel):
        its verdict, ``{"gone": True}``, or None when it did not answer in time."""
        from .event_log import control_request
        from .problems import Problem

        if self.event_log is None:
            raise Problem(501, "edits_need_event_log", "on Ray Serve, finish/steer/rewind reach the model replica "
                          "through the shared event log; start with --event-log redis://HOST:PORT/DB")
        if self._redis is None:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(self.event_log, socket_connect_timeout=2.0, socket_timeout=5.0)
        answer: dict[str, Any] | None = {"gone": True}
        seen = False
        for _ in range(10):  # not started on a replica yet, a failover in progress, a listener subscribing
            replica = self.replica_of.get(stream_id)
            if replica:
                seen = True
                try:
                    answer = await control_request(self._redis, _PREFIX, f"replica:{replica}", {
                        "stream_id": stream_id, "command": command, "args": list(args), "kwargs": kwargs})
                except Exception as exc:  # noqa: BLE001
                    from .event_log import unavailable

                    raise unavailable("forward the edit", exc) from None
                if answer is None or not answer.get("gone"):
                    return answer
            await asyncio.sleep(0.1)
        if not seen:
            raise Problem(503, "stream_starting", f"stream {stream_id} has not reached a model replica yet; retry "
                          "shortly", {"Retry-After": "1"})
        return answer

    async def _pump(self, w: StreamWriter, kwargs: dict[str, Any]) -> None:
        ids: list[int] = []
        text = ""
        revision = 0
        base = 0  # revisions made on replicas that failed (a new replica counts its own from 0)
        inserted: list[dict[str, Any]] = []  # instructions in the context now: {"revision", "at", "token_ids", ...}
        history: list[dict[str, Any]] = []  # revision dicts reported by replicas that failed
        edits: list[dict[str, Any]] = []  # those reported by the replica serving the stream now
        step = -1
        failures: list[float] = []
        retryable = _retryable()
        while True:
            resume = {"tokens": ids, "chars": len(text), "step": step, "failover": bool(failures),
                      "inserted": [[e["at"], e["token_ids"]] for e in inserted if e.get("token_ids")]}
            gen = self.handle.options(stream=True).generate.remote(kwargs, resume, w.stream_id)
            try:
                async for item in gen:
                    if isinstance(item, dict):
                        if "edit" in item:  # a steer or rewind took effect on the replica
                            edit = dict(item["edit"])
                            edits.append(edit)
                            inserted.append({**edit, "revision": base + int(edit.get("revision") or 0)})
                        elif "replica" in item:
                            self.replica_of[w.stream_id] = item.get("replica", "")
                        continue
                    ev: Event = item
                    if isinstance(ev, TextEvent):
                        # Offsets and revisions pass through: a rewind on the replica replaces text here too.
                        offset = ev.offset if ev.offset is not None else len(text)
                        moved = offset != len(text)
                        index = ev.index if moved else len(ids)
                        while revision < base + (ev.revision or 0):
                            revision = w.new_revision()
                        if moved:  # a rewind: instructions taken in after its cut are gone with the text
                            now = base + (ev.revision or 0)
                            inserted = [e for e in inserted if e["revision"] >= now or e["at"] <= index]
                        if ev.is_final:
                            revisions = history + list(ev.revisions or [])
                            w.finish_text(ev.delta, ev.token_ids, index, finish_reason=ev.finish_reason or "stop",
                                          text=text[:offset] + ev.delta, usage=dict(ev.usage or {}),
                                          metrics=dict(ev.metrics or {}), revisions=revisions or None,
                                          offset=offset if moved else None)
                        elif ev.delta or moved:
                            w.text(ev.delta, ev.token_ids, index, offset=offset if moved else None)
                        ids = ids[:index] + list(ev.token_ids)
                        text = text[:offset] + ev.delta
                    elif isinstance(ev, ImageEvent):
                        w.forward(ev)
                        if not ev.is_final and ev.finish_reason is None:
                            step = max(step, ev.step)
                    else:
                        w.forward(ev)
                    if ev.is_final:
                        return
                if not w.finished:
                    w.fail(RuntimeError("the model replica ended the stream without a final event"))
                return
            except asyncio.CancelledError:
                gen.cancel()
                if not w.finished:
                    if self.kind == "text":
                        w.finish_text("", [], len(ids), finish_reason="cancelled", text=text,
                                      usage={"prompt_tokens": 0, "completion_tokens": len(ids)}, metrics={})
                    else:
                        w.fail(RuntimeError("cancelled"))
                return
            except retryable as exc:
                history.extend({k: v for k, v in e.items() if k not in ("revision", "at")} for e in edits)
                edits = []
                base = revision
                now = time.monotonic()
                failures = [t for t in failures if now - t < _FAILOVER_WINDOW_S] + [now]
                self.failovers += 1
                if len(failures) > _MAX_FAILOVERS:
                    w.fail(RuntimeError(f"the {self.kind} replicas kept failing ({type(exc).__name__})"))
                    return
                logger.warning("stream %s: %s replica %s failed (%s); resuming on another replica after %s",
                               w.stream_id, self.kind, self.replica_of.get(w.stream_id, "?"), type(exc).__name__,
                               f"{len(ids)} tokens" if self.kind == "text" else f"step {max(step, 0)}")
                await asyncio.sleep(min(0.5, 0.02 * 2 ** (len(failures) - 1)))
            except Exception as exc:  # noqa: BLE001
                w.fail(exc)
                return


def _wait_healthy(kind: str, timeout: float = 900.0) -> None:
    """Block until the deployment ``kind`` runs all its target replicas (for /readyz)."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            app = serve.status().applications.get(APP_NAME)
            dep = app.deployments.get(kind) if app is not None else None
            if dep is not None and str(getattr(dep.status, "value", dep.status)) == "HEALTHY":
                return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the {kind} deployment did not become healthy")


def _replicas(kind: str) -> int:
    from ray import serve

    try:
        dep = serve.status().applications[APP_NAME].deployments[kind]
        return int(dep.replica_states.get("RUNNING", 1))
    except Exception:  # noqa: BLE001
        return 1


class Ingress:
    """The HTTP ingress: ``create_app`` with `RemoteModel` proxies for the model deployments.

    The constructor is async and waits (up to ``_MODEL_WAIT_S``) for every model deployment to run
    its target replicas: Serve routes traffic to an ingress replica only once its constructor has
    returned, so every ingress replica that answers already has its models (with two ingress
    replicas, one answering ``/readyz`` 200 must not leave the other answering 503). A deployment
    that is not up in time is resolved in the background instead, and ``/readyz`` says so.
    """

    async def __init__(self, settings: ServerSettings, text: Any = None, image: Any = None) -> None:
        self.settings = settings
        self.handles = {"text": text, "image": image}
        self.remote: dict[str, RemoteModel] = {}
        self.models: dict[str, Any] = {}
        for kind in ("text", "image"):
            if self.handles[kind] is None:
                self.models[kind] = None
                continue
            try:
                self.models[kind] = await asyncio.wait_for(asyncio.to_thread(self._resolve, kind), _MODEL_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - keep starting; the slot loads in the background
                logger.warning("the %s deployment is not up yet (%s); the ingress starts and keeps waiting",
                               kind, type(exc).__name__)
                self.models[kind] = functools.partial(self._resolve, kind)

    def _resolve(self, kind: str) -> RemoteModel:
        """Wait for the ``kind`` deployment's replicas, then build its proxy (blocking: a worker thread)."""
        handle = self.handles[kind]
        _wait_healthy(kind)
        info = handle.info.remote().result(timeout_s=60)
        model = RemoteModel(kind, handle, info.get("name", kind), self.settings.event_log)
        # The ingress admits what all replicas together take (engine capacity x replicas).
        model.capacity = int(info.get("capacity") or 4) * max(1, _replicas(kind))
        self.remote[kind] = model
        return model

    def __serve_build_asgi_app__(self) -> Any:
        from .app import create_app

        app = create_app(text_model=self.models["text"], image_model=self.models["image"], settings=self.settings)
        if self.settings.enable_test_hooks:
            async def replica_of(stream_id: str) -> Any:
                from starlette.responses import JSONResponse

                for model in self.remote.values():
                    if stream_id in model.replica_of:
                        return JSONResponse({"replica": model.replica_of[stream_id], "pid": os.getpid()})
                return JSONResponse({"replica": None, "pid": os.getpid()}, status_code=404)

            app.add_api_route("/v1/_test/replica/{stream_id}", replica_of, methods=["GET"], include_in_schema=False)
        return app


def build_app(settings: ServerSettings, *, text_model: Any = "default", image_model: Any = "default",
              text_replicas: int | dict[str, Any] = 1, image_replicas: int | dict[str, Any] = 1,
              ingress_replicas: int = 1, text_actor_options: dict[str, Any] | None = None,
              image_actor_options: dict[str, Any] | None = None, image_checkpoint_every: int = 1) -> Any:
    """The Serve application: ``ingress`` bound to the ``text`` and ``image`` deployments.

    ``*_replicas``: a count (0: that model is not served) or an autoscaling config
    (``{"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 8}``).
    ``*_actor_options``: Ray resources per replica, e.g. ``{"num_gpus": 1}`` (default ``num_cpus=1``).
    ``image_checkpoint_every``: with ``event_log``, image replicas write a stream's checkpoint to
    Redis every this many denoising steps (a failover continues from the newest one).
    """
    from ray import serve

    if isinstance(image_checkpoint_every, bool) or not isinstance(image_checkpoint_every, int) or image_checkpoint_every < 1:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"image_checkpoint_every must be an integer >= 1, got {image_checkpoint_every!r}")

    def model_deployment(kind: str, spec: Any, replicas: int | dict[str, Any], options: dict[str, Any] | None) -> Any:
        if spec is None or replicas == 0:
            return None
        scale: dict[str, Any] = ({"autoscaling_config": replicas} if isinstance(replicas, dict)
                                 else {"num_replicas": int(replicas)})
        dep = serve.deployment(ModelReplica).options(
            name=kind, ray_actor_options=options or {"num_cpus": 1}, max_ongoing_requests=64,
            health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5, **scale)
        return dep.bind(kind, spec, settings.event_log, image_checkpoint_every if kind == "image" else 1)

    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress", num_replicas=ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=settings.max_connections)
    return ingress.bind(settings, model_deployment("text", text_model, text_replicas, text_actor_options),
                        model_deployment("image", image_model, image_replicas, image_actor_options))


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files and KubeRay's RayService (``import_path: multistream.server.ray_app:app_builder``).

    ``args``: ``text_model``, ``image_model`` (``"none"`` to skip), ``text_replicas``,
    ``image_replicas``, ``ingress_replicas``, ``text_actor_options``, ``image_actor_options``,
    ``image_checkpoint_every``;
    every other key is a `ServerSettings` field (``event_log: redis://...``), after
    ``MULTISTREAM_*`` environment variables.
    """
    args = dict(args or {})
    own = {k: args.pop(k) for k in ("text_model", "image_model", "text_replicas", "image_replicas",
                                    "ingress_replicas", "text_actor_options", "image_actor_options",
                                    "image_checkpoint_every") if k in args}
    for kind in ("text_model", "image_model"):
        if str(own.get(kind, "default")).lower() in ("none", "off", ""):
            own[kind] = None
    return build_app(ServerSettings.from_env(**args), **own)


def serve_ray(settings: ServerSettings, *, text_model: Any = "default", image_model: Any = "default",
              text_replicas: int = 1, image_replicas: int = 1, ingress_replicas: int = 1, autoscale: bool = False,
              host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
              image_checkpoint_every: int = 1) -> int:
    """``multistream serve --ray``: run the application on a local or existing Ray cluster until SIGINT/SIGTERM."""
    import httpx
    import ray
    from ray import serve

    if ingress_replicas > 1 and not settings.event_log:
        logger.warning("several ingress replicas without --event-log: a resume works only on the replica that "
                       "runs the stream; use --event-log redis://...")
    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})

    def count(n: int) -> int | dict[str, Any]:
        return {"min_replicas": 1, "max_replicas": n, "target_ongoing_requests": 8} if autoscale and n > 1 else n

    serve.run(build_app(settings, text_model=text_model, image_model=image_model, text_replicas=count(text_replicas),
                        image_replicas=count(image_replicas), ingress_replicas=ingress_replicas,
                        image_checkpoint_every=image_checkpoint_every),
              name=APP_NAME, route_prefix="/", blocking=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = f"http://{host}:{port}/readyz"
    announced = False
    while not stop.wait(1.0):
        if not announced:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    print(f"multistream on Ray Serve: ready at http://{host}:{port}", flush=True)
                    announced = True
            except httpx.HTTPError:
                pass
    serve.delete(APP_NAME)
    serve.shutdown()
    return 0
