"""A model replica of the Ray application: loads one model, streams its events to the ingress,
continues another replica's stream after a failover, takes edits from the event log's control channel."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import os
from typing import Any

from ...engine import capacity_of
from ...events import ErrorEvent, ImageEvent, TextEvent
from ...stream import Stream
from ..durable.checkpoints import CheckpointWriter, already_sent
from ..durable.resume import PREFIX, checkpoint_key, redis_client, start_from_checkpoint, trim_text
from ..families import family

logger = logging.getLogger("multistream.server")


class ModelReplica:
    """One model replica (deployment ``text`` or ``image``): loads the model, streams events.

    An image replica with an event log writes each stream's newest `ImageCheckpoint` to Redis
    every ``checkpoint_every`` steps (`checkpoint_key`); the replica that takes the stream over
    after a failure continues from it.
    """

    def __init__(self, kind: str, spec: Any, event_log: str | None = None, checkpoint_every: int = 1) -> None:
        from ..state import load_model, warm_up_model

        self.kind = kind
        self.checkpoint_every = max(1, int(checkpoint_every))
        self._redis: Any = None
        self.event_log = event_log if event_log and event_log.startswith(("redis://", "rediss://", "unix://")) else None
        self.streams: dict[str, Stream] = {}  # ingress stream id -> the generation running here (for edits)
        self._control: asyncio.Task[None] | None = None
        self.model = load_model(kind, "default" if spec is None else spec)
        warm_up_model(self.model)
        self.name = str(getattr(self.model, "name", None) or kind)
        try:
            params = inspect.signature(self.model.stream).parameters
        except (TypeError, ValueError):  # pragma: no cover
            params = {}
        # A text model with the failover entry point (`TextModel.replica_stream`) continues a run
        # from its tokens, reports its edits and takes them back: a failover replays steers.
        self.family = family(kind)
        self._replica_stream = getattr(self.model, "replica_stream", None) if self.family.resumes_from_tokens else None
        self.native_resume = callable(self._replica_stream)
        self.replays_edits = self.native_resume
        self.checkpoints = self.family.checkpoints and self.event_log is not None and "on_checkpoint" in params
        try:
            import ray

            self.replica = ray.get_runtime_context().get_actor_name() or ""
        except Exception:  # noqa: BLE001
            self.replica = ""

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "replica": self.replica, "pid": os.getpid(),
                "native_resume": self.native_resume, "checkpoints": self.checkpoints,
                "capacity": capacity_of(self.model)}

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = redis_client(self.event_log)
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
        from ..durable.event_log import serve_control

        client = redis_client(self.event_log, timeout_s=None)
        self._control = asyncio.get_running_loop().create_task(
            serve_control(client, PREFIX, f"replica:{self.replica}", self._on_control), name="multistream-replica-control")

    async def _on_control(self, message: dict[str, Any]) -> dict[str, Any]:
        from ..durable.event_log import apply_command, verdict
        from ..http.problems import Problem

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
        yield {"replica": self.replica, "pid": os.getpid()}
        resume = resume or {}
        tokens = list(resume.get("tokens") or [])
        kwargs = dict(kwargs)
        trim_tokens, trim_chars, trim_step = 0, 0, int(resume.get("step", -1))
        failover = bool(resume.get("failover")) or trim_step >= 0
        edits: collections.deque[dict[str, Any]] = collections.deque()
        if self.family.resumes_from_tokens and self.replays_edits:
            kwargs["on_edit"] = edits.append  # engine thread; relayed before the events that follow the edit
        if self.family.resumes_from_tokens and tokens:
            if self.native_resume:
                kwargs["resume_tokens"] = tokens
                if self.replays_edits and resume.get("inserted"):
                    # An instruction after tokens the ingress never got (held back, then cut) goes at the end.
                    kwargs["resume_inserted"] = [(min(int(k), len(tokens)), list(ids)) for k, ids in resume["inserted"]]
            else:
                trim_tokens, trim_chars = len(tokens), int(resume.get("chars", 0))
        writer: CheckpointWriter | None = None
        checkpoint: bytes | None = None
        if self.checkpoints and key is not None:
            writer = CheckpointWriter(self._client(), checkpoint_key(key), asyncio.get_running_loop())
            kwargs.update(on_checkpoint=writer.put, checkpoint_every=self.checkpoint_every)
            if failover:
                checkpoint = await self._newest_checkpoint(key)
        start = self._replica_stream if self.native_resume else self.model.stream
        try:
            stream, resumed = start_from_checkpoint(start, kwargs, checkpoint, key)
            if resumed:
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
                    ev = trim_text(ev, trim_tokens, trim_chars)
                    if ev is None:
                        continue
                elif already_sent(ev, trim_step):
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

