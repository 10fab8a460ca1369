"""The ingress's remote handle on a model deployment (`RemoteModel`): streams from a replica and
fails over to another one when it dies, without a gap or a duplicate."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
import time
from typing import Any

from ...engine import DEFAULT_CAPACITY
from ...events import Event, ImageEvent, TextEvent
from ...stream import Stream, StreamWriter
from ..durable.resume import PREFIX, redis_client
from ..families import family
from ._common import FAILOVER_WINDOW_S, MAX_FAILOVERS, MODEL_WAIT_S, retryable_errors, waiting_errors

logger = logging.getLogger("multistream.server")
WAITING_POLL_S = 0.5  # while no replica is up: how often a stream asks again


def _check_here(kind: str, kwargs: dict[str, Any]) -> None:
    """The model-independent argument checks (torch-free, the models' own code), at the ingress: a
    bad argument is a 400 there, as on a single server, not an error event in a 200 stream. What
    needs the model (a prompt longer than its context, a size its VAE cannot make) is checked on
    the replica."""
    check = family(kind).check
    if check is not None:
        check(kwargs)


class RemoteModel:
    """The ingress's stand-in for a model: ``.stream(**kwargs)`` streams from the model deployment,
    failing over to another replica when one dies."""

    # `.stream()` creates its pump task on the running loop: the server calls it there, not on a
    # worker thread as it does a local model's (`streams.starting.start_stream`).
    stream_needs_loop = True

    def __init__(self, kind: str, handle: Any, name: str = "", event_log: str | None = None) -> None:
        self.kind = kind
        self.handle = handle
        self.event_log = event_log if event_log and event_log.startswith(("redis://", "rediss://", "unix://")) else None
        self._redis: Any = None
        self.name = name or kind
        self.replica_of: dict[str, str] = {}  # stream id -> replica serving it now (for tests, metrics)
        self.replica_pid: dict[str, int] = {}  # stream id -> that replica's process (test hooks)
        self.failovers = 0
        self.capacity = DEFAULT_CAPACITY

    def stream(self, **kwargs: Any) -> Stream:
        _check_here(self.kind, kwargs)
        loop = asyncio.get_running_loop()
        if family(self.kind).checkpoints and kwargs.get("seed") is None and "generator" not in kwargs:
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
        # The server's edit routes look for this (`streams.edits.apply_edit`): edits travel to the replica.
        stream.forward_edit = functools.partial(self.forward_edit, stream.stream_id)  # type: ignore[attr-defined]
        return stream

    async def forward_edit(self, stream_id: str, command: str, args: list[Any],
                           kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """Send finish/steer/rewind to the replica generating ``stream_id`` (Redis control channel):
        its verdict, ``{"gone": True}``, or None when it did not answer in time."""
        from ..durable.event_log import control_request
        from ..http.problems import Problem

        if self.event_log is None:
            raise Problem(501, "edits_need_event_log", "on Ray Serve, finish/steer/rewind reach the model replica "
                          "through the shared event log; start with --event-log redis://HOST:PORT/DB")
        if self._redis is None:
            self._redis = redis_client(self.event_log)
        answer: dict[str, Any] | None = {"gone": True}
        seen = False
        for _ in range(10):  # not started on a replica yet, a failover in progress, a listener subscribing
            replica = self.replica_of.get(stream_id)
            if replica:
                seen = True
                try:
                    answer = await control_request(self._redis, PREFIX, f"replica:{replica}", {
                        "stream_id": stream_id, "command": command, "args": list(args), "kwargs": kwargs})
                except Exception as exc:  # noqa: BLE001
                    from ..durable.event_log import unavailable

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
        retryable, waiting = retryable_errors(), waiting_errors()
        waiting_since: float | None = None  # since when no healthy replica is up (a new one starts)
        while True:
            resume = {"tokens": ids, "chars": len(text), "step": step, "failover": bool(failures),
                      "inserted": [[e["at"], e["token_ids"]] for e in inserted if e.get("token_ids")]}
            gen = self.handle.options(stream=True).generate.remote(kwargs, resume, w.stream_id)
            try:
                async for item in gen:
                    waiting_since = None  # a replica answers
                    if isinstance(item, dict):
                        if "edit" in item:  # a steer or rewind took effect on the replica
                            edit = dict(item["edit"])
                            edits.append(edit)
                            inserted.append({**edit, "revision": base + int(edit.get("revision") or 0)})
                        elif "replica" in item:
                            self.replica_of[w.stream_id] = item.get("replica", "")
                            self.replica_pid[w.stream_id] = int(item.get("pid") or 0)
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
                    if family(self.kind).resumes_from_tokens:
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
                if isinstance(exc, waiting) and failures:
                    # The replica that failed is being replaced and the deployment has none healthy
                    # meanwhile: wait for the new one (a loaded machine took over 30 s to start an
                    # image replica, and eight quick retries used to end the stream in 2 s).
                    if waiting_since is None:
                        waiting_since = now
                        logger.warning("stream %s: no %s replica is up yet; waiting up to %.0f s for one",
                                       w.stream_id, self.kind, MODEL_WAIT_S)
                    if now - waiting_since > MODEL_WAIT_S:
                        w.fail(RuntimeError(f"no {self.kind} replica came back within {MODEL_WAIT_S:.0f} s"))
                        return
                    await asyncio.sleep(WAITING_POLL_S)
                    continue
                waiting_since = None
                failures = [t for t in failures if now - t < FAILOVER_WINDOW_S] + [now]
                self.failovers += 1
                if len(failures) > MAX_FAILOVERS:
                    w.fail(RuntimeError(f"the {self.kind} replicas kept failing ({type(exc).__name__})"))
                    return
                logger.warning("stream %s: %s replica %s failed (%s); resuming on another replica after %s",
                               w.stream_id, self.kind, self.replica_of.get(w.stream_id, "?"), type(exc).__name__,
                               f"{len(ids)} tokens" if family(self.kind).resumes_from_tokens else f"step {max(step, 0)}")
                await asyncio.sleep(min(0.5, 0.02 * 2 ** (len(failures) - 1)))
            except Exception as exc:  # noqa: BLE001
                w.fail(exc)
                return
