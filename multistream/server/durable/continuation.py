"""A restart continues what was running: with ``--event-log redis://...``, a text, image or video
generation whose server died (``kill -9``, a crash, a lost machine) or was redeployed (SIGTERM) is
picked up by the next server on the same Redis (the restarted one, or a peer) and continued where
its log ends, so a client resuming with ``Last-Event-ID`` (native SSE) or ``starting_after``
(Responses) gets the rest: no gap, no duplicate, greedy (or seeded) text equal to an uninterrupted
run, and an image equal to the uninterrupted run's.

How:

- each stream's request (the model's ``stream`` keyword arguments; an image's seed fixed first, so
  the continuation draws the same noise) is kept in its log's hash (``ms:m:{id}`` field ``req``)
  and its id in the set ``ms:live`` until its final event;
- an image stream's newest `ImageCheckpoint` (latents, scheduler state, step) is written to
  ``ms:ckpt:{id}`` every ``image_checkpoint_every`` steps (`image_checkpoints.CheckpointWriter`,
  the Ray image replicas' writer: newest only, from the event loop, so a slow Redis skips
  checkpoints and never delays a step; the embedded model's is 13 KB) and deleted at its end;
- each server process keeps a liveness key ``ms:proc:{instance}`` (``PX`` `LIVENESS_TTL_S`, renewed
  every `SCAN_EVERY_S`); a live stream whose ``proc`` has no liveness key is an orphan;
- every `SCAN_EVERY_S` a server claims the orphans of the kinds it serves (a compare-and-set of
  ``proc`` in one Lua call, so one process wins) and, once that model is loaded, continues each
  one: the logged events are the new record's first events (same id, same resume token and
  owner), and the new events follow with the next ``seq``. Text: the prompt and the logged tokens
  are prefilled (``TextModel.replica_stream(resume_tokens=...)``, the code a Ray replica's
  failover runs; a model without it regenerates and the logged part is trimmed, as a Ray replica
  does). Image: the run resumes from the newest checkpoint (``ImageModel.stream(resume_from=...)``,
  as a Ray image replica does; none yet, or one the model refuses: from step 0 with the same seed),
  and previews of steps the log already has are skipped; the final image is the uninterrupted
  run's, bit for bit where the denoiser is deterministic (fp32 on a CPU: the same PNG bytes).
  Video: the same, from the clip's newest checkpoint (``VideoModel.stream(resume_from=...)``);
  the final clip has the uninterrupted run's frames;
- bounded: each claim after a crash counts in ``restarts``; past `MAX_RESTARTS` the stream is
  ended in the log with an error event (a generation that keeps killing its server is not
  retried forever). A hand-off (below) does not count.

A graceful shutdown (SIGTERM) lets running streams finish for ``shutdown_deadline_s``; with a
Redis log, those still running then are handed off (`hand_off`), not ended: the model stops, the
events it made are flushed to the log (and an image's newest checkpoint to Redis), no final event
is written, the readers here are let go without one (their connections end; they resume on the
next server), the streams are marked ``handoff`` and this process's liveness key is deleted, so
the next server on the same log continues them at once (it may be already running: a rolling
deploy). With the in-memory log (or a stream whose request could not be kept, or whose log writes
failed) SIGTERM ends them as before (``finish_reason="cancelled"``).

Example:
    >>> # multistream serve --event-log redis://127.0.0.1:6379/0   (kill -9 it, start it again)
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ...events import ErrorEvent, Event, ImageEvent, TextEvent, VideoEvent, event_from_dict
from ...stream import Stream, StreamWriter
from ..families import FAMILIES, family
from ..streams.starting import start_stream
from .checkpoints import CheckpointWriter, already_sent
from .event_log import entry_id
from .resume import start_from_checkpoint, trim_text

__all__ = ["CONTINUED_HOOKS", "KINDS", "LIVENESS_TTL_S", "MAX_RESTARTS", "SCAN_EVERY_S", "Continuer", "DurablePlan",
           "checkpoint_continuation_stream", "continuation_stream", "durable_plan", "hand_off", "remember_request"]

logger = logging.getLogger("multistream.server")

LIVENESS_TTL_S = 5.0  # a live process stalled (GIL, GC, a slow Redis) this long looks dead
SCAN_EVERY_S = 0.5
MAX_RESTARTS = 2
KINDS = tuple(f.name for f in FAMILIES if f.continues)  # the families whose generations are continued

_PUMPS: set[asyncio.Task[None]] = set()
# Called with (state, record) for each stream continued here: the Responses route keeps a
# background response running and its stored entry at hand (`openai.responses.router`).
CONTINUED_HOOKS: list[Callable[[Any, Any], Awaitable[None]]] = []

# KEYS[1] = the stream's hash; ARGV = (the proc seen, this proc, now). Returns the restart count
# (a hand-off does not add one), or -1 when another process has it or it has ended.
_CLAIM = """
local proc = redis.call('HGET', KEYS[1], 'proc')
if proc ~= ARGV[1] or redis.call('HGET', KEYS[1], 'done') == '1' then return -1 end
redis.call('HSET', KEYS[1], 'proc', ARGV[2], 'hb', ARGV[3])
if redis.call('HGET', KEYS[1], 'handoff') == '1' then
  redis.call('HDEL', KEYS[1], 'handoff')
  return tonumber(redis.call('HGET', KEYS[1], 'restarts') or '0')
end
return redis.call('HINCRBY', KEYS[1], 'restarts', 1)
"""


@dataclass
class DurablePlan:
    """What a durable log adds to a new stream: ``kwargs`` is the request as kept in the log (an
    image's seed fixed), ``extra`` the model-only arguments (an image's ``on_checkpoint``)."""

    kwargs: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    checkpoints: CheckpointWriter | None = None


def _parameters(fn: Any) -> tuple[set[str], bool]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin: assume nothing
        return set(), False
    return set(params), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def durable_plan(log: Any, kind: str, model: Any, kwargs: dict[str, Any], checkpoint_every: int = 1,
                 resumable: bool = True) -> DurablePlan:
    """Prepare a stream's request for continuation elsewhere: an image run gets a fixed seed (a
    continuation must draw the same noise) and, where the model takes ``on_checkpoint``, a
    `CheckpointWriter` that keeps its newest checkpoint in Redis every ``checkpoint_every`` steps.
    A stream that is not ``resumable`` (an OpenAI-route one) is not continued: nothing changes."""
    kwargs = dict(kwargs)
    if not family(kind).checkpoints or not resumable:
        return DurablePlan(kwargs)
    names, var_kw = _parameters(model.stream)
    if kwargs.get("seed") is None and "generator" not in kwargs and ("seed" in names or var_kw):
        kwargs["seed"] = random.randrange(2**31)
    if "on_checkpoint" not in names:
        return DurablePlan(kwargs)
    writer = CheckpointWriter(log.redis, None, asyncio.get_running_loop())
    return DurablePlan(kwargs, {"on_checkpoint": writer.put, "checkpoint_every": max(1, int(checkpoint_every))}, writer)


def _keep_checkpoints(log: Any, record: Any, writer: CheckpointWriter | None) -> None:
    """Write ``record``'s checkpoints under its id; delete them when it ends here (a hand-off
    keeps them: `hand_off` flushes the newest for the next server)."""
    if writer is None:
        return
    record.checkpoints = writer
    writer.bind(log.key("ckpt", record.stream_id))
    loop = asyncio.get_running_loop()

    def done(r: Any) -> None:
        if not r.handed_off:
            task = loop.create_task(writer.close(delete=True))
            _PUMPS.add(task)
            task.add_done_callback(_PUMPS.discard)

    record.when_done(done)


def remember_request(log: Any, record: Any, kwargs: dict[str, Any], checkpoints: CheckpointWriter | None = None) -> None:
    """Keep a text or image stream's request with its log (so another process can continue it);
    ``checkpoints`` (from `durable_plan`) starts writing the image run's checkpoints."""
    if record.kind not in KINDS or not record.resumable:
        return
    try:
        req = json.dumps(kwargs, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return  # not JSON (a Python-only option): not continued after a crash
    _keep_checkpoints(log, record, checkpoints)

    async def write() -> None:
        try:
            await (log.redis.pipeline(transaction=False)
                   .hset(log.key("m", record.stream_id), mapping={"req": req, "proc": log.instance, "kind": record.kind})
                   .sadd(log.key("live"), record.stream_id).execute())
        except Exception as exc:  # noqa: BLE001 - the stream runs on; only its continuation is lost
            logger.warning("stream %s: keeping its request in the event log failed: %s", record.stream_id, exc)
            return
        record.continuable = True

    asyncio.get_running_loop().create_task(write())


def _answer(events: list[Event]) -> tuple[list[int], str]:
    """The answer's token ids and text after the logged events (edits applied)."""
    ids: list[int] = []
    text = ""
    for ev in events:
        if isinstance(ev, TextEvent):
            offset = ev.offset if ev.offset is not None else len(text)
            text = text[:offset] + ev.delta
            ids = ids[: ev.index] + list(ev.token_ids)
    return ids, text


def _relay(kind: str, inner: Stream, stream_id: str, events: list[Event],
           keep: Callable[[Event], Event | None], start: Callable[[StreamWriter], None] | None = None) -> Stream:
    """A stream with id ``stream_id`` that forwards what ``keep`` keeps of ``inner``'s events; its
    clock goes on from the last logged event (``t`` never goes back)."""
    loop = asyncio.get_running_loop()

    def submit(w: StreamWriter) -> None:
        async def pump() -> None:
            if start is not None:
                start(w)
            try:
                async for ev in inner:
                    kept = keep(ev)
                    if kept is None:
                        continue
                    w.forward(kept)
                    if kept.is_final:
                        return
            except asyncio.CancelledError:
                inner.cancel()
                raise
            except Exception as exc:  # noqa: BLE001
                w.fail(exc)

        task = loop.create_task(pump(), name=f"multistream-continue-{stream_id[:8]}")
        _PUMPS.add(task)
        task.add_done_callback(_PUMPS.discard)
        w.on_cancel(lambda: loop.call_soon_threadsafe(inner.cancel))

    stream = Stream(kind=kind, stream_id=stream_id, submit=submit)
    if events:
        stream._channel.started_at -= max(ev.t for ev in events)
    return stream


async def continuation_stream(model: Any, kwargs: dict[str, Any], events: list[Event], stream_id: str) -> Stream:
    """A stream with id ``stream_id`` that continues the answer ``events`` began: the prompt and
    the logged tokens prefilled (``replica_stream(resume_tokens=)``), only what follows sent;
    its first event follows the last logged one (``offset``, ``index``). The model's stream
    starts off the event loop where the model allows (`start_stream`)."""
    ids, text = _answer(events)
    native = callable(getattr(model, "replica_stream", None))
    if native and ids:
        inner = await start_stream(model, lambda m: m.replica_stream(**kwargs, resume_tokens=ids))
    else:
        inner = await start_stream(model, lambda m: m.stream(**kwargs))

    def keep(ev: Event) -> Event | None:
        if isinstance(ev, TextEvent) and not (native and ids):
            return trim_text(ev, len(ids), len(text))
        return ev

    return _relay("text", inner, stream_id, events, keep, start=lambda w: w.continue_text(len(text)))


async def checkpoint_continuation_stream(model: Any, kwargs: dict[str, Any], events: list[Event], stream_id: str,
                                         checkpoint: bytes | None = None, extra: dict[str, Any] | None = None, *,
                                         kind: str) -> Stream:
    """A stream with id ``stream_id`` that continues the denoising run (an image or a clip:
    ``kind``) ``events`` began: from ``checkpoint`` (``stream(resume_from=)``; None, or one the model refuses: from
    step 0 with the same seed), skipping previews of the steps the log already has. The model's
    stream starts off the event loop where the model allows (`start_stream`)."""
    extra = dict(extra or {})
    sent = max((ev.step for ev in events if isinstance(ev, (ImageEvent, VideoEvent)) and not ev.is_final), default=0)
    inner = await start_stream(model, lambda m: start_from_checkpoint(m.stream, {**kwargs, **extra}, checkpoint,
                                                                      stream_id)[0])
    return _relay(kind, inner, stream_id, events, lambda ev: None if already_sent(ev, sent) else ev)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Continuer:
    """This process's side: liveness, the orphan scan, claims and continuations."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.log = state.registry.log
        self.task: asyncio.Task[None] | None = None
        self.continued: list[str] = []  # stream ids continued here (tests, logs)
        self.ended: list[str] = []  # ended with an error after too many restarts
        self.pending: dict[str, tuple[str, dict[str, Any]]] = {}  # claimed: (kind, request), waiting for the model
        self._claim: Any = None
        state.continuer = self  # the drain hands streams off through it (`hand_off`)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name="multistream-continuer")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def stopped(self) -> None:
        """Stop, and wait until no liveness write is in flight (before the key is deleted)."""
        self.stop()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    def _serves(self, kind: str) -> bool:
        slot = self.state.models.get(kind)
        return slot is not None and slot.state in ("ready", "loading", "pending")

    async def _run(self) -> None:
        log = self.log
        self._claim = log.redis.register_script(_CLAIM)
        while True:
            try:
                await log.redis.set(log.key("proc", log.instance), "1", px=int(LIVENESS_TTL_S * 1000))
                if not self.state.draining and any(self._serves(kind) for kind in KINDS):
                    await self.scan()
                    await self._run_pending()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away: try again in a moment
                logger.debug("continuation scan failed: %s", exc)
            await asyncio.sleep(SCAN_EVERY_S)

    async def scan(self) -> None:
        """Claim the live streams whose process is gone (two pipelined reads per scan)."""
        log = self.log
        sids = [_text(m) for m in await log.redis.smembers(log.key("live"))]
        sids = [sid for sid in sids if sid not in self.state.registry.live and sid not in self.pending]
        if not sids:
            return
        pipe = log.redis.pipeline(transaction=False)
        for sid in sids:
            pipe.hmget(log.key("m", sid), ["proc", "done", "req", "kind"])
        metas = await pipe.execute()
        procs = sorted({_text(m[0]) for m in metas if m[0] is not None})
        pipe = log.redis.pipeline(transaction=False)
        for proc in procs:
            pipe.exists(log.key("proc", proc))
        alive = {proc for proc, up in zip(procs, await pipe.execute()) if up} | {log.instance}
        for sid, (proc, done, req, kind) in zip(sids, metas):
            if proc is None or done in (b"1", "1") or req is None:
                await log.redis.srem(log.key("live"), sid)
                continue
            kind_s = _text(kind) if kind is not None else "text"
            proc_s = _text(proc)
            if proc_s in alive or kind_s not in KINDS or not self._serves(kind_s):
                continue  # its process is alive (or it is ours), or another server's model must take it
            restarts = await self._claim(keys=[log.key("m", sid)], args=[proc_s, log.instance, time.time()])
            if int(restarts) < 0:
                continue  # another process claimed it first
            if int(restarts) > MAX_RESTARTS:
                await self._give_up(sid, int(restarts) - 1)
                continue
            self.pending[sid] = (kind_s, json.loads(req))

    async def _run_pending(self) -> None:
        """Continue the claimed streams once their model is ready; until then keep their readers
        (following the log from any process) from taking them for lost."""
        if not self.pending:
            return
        log = self.log
        waiting = {sid: v for sid, v in self.pending.items() if self.state.models[v[0]].state != "ready"}
        if waiting:
            pipe = log.redis.pipeline(transaction=False)
            for sid in waiting:
                pipe.hset(log.key("m", sid), "hb", time.time())
            await pipe.execute()
        ready = {sid: v for sid, v in self.pending.items() if sid not in waiting}
        self.pending = waiting
        for sid, (kind, kwargs) in ready.items():
            try:
                await self._continue(sid, kind, kwargs)
            except Exception as exc:  # noqa: BLE001 - it cannot be continued: end it for its readers
                logger.exception("stream %s: continuing it failed", sid)
                await self._give_up(sid, 0, f"it could not be continued after its server went away "
                                    f"({type(exc).__name__})")

    async def _give_up(self, sid: str, restarts: int, why: str | None = None) -> None:
        log = self.log
        record = await log.load(sid)
        seq = record.last_seq + 1 if record is not None else 0
        message = why or (f"the server running this generation went away {restarts} times; it is not continued "
                          "again")
        ev = ErrorEvent(stream_id=sid, seq=seq, t=0.0, error={"type": "generation_lost", "message": message})
        ttl = max(1, int(log.settings.retention_s + 1))
        await (log.redis.pipeline(transaction=False)
               .xadd(log.key("s", sid), {"j": ev.to_json(), "f": 1}, id=entry_id(seq))
               .hset(log.key("m", sid), mapping={"done": 1, "finish_reason": "error", "last": seq})
               .expire(log.key("s", sid), ttl).expire(log.key("m", sid), ttl)
               .zadd(log.key("finished"), {sid: time.time()}).srem(log.key("live"), sid)
               .delete(log.key("ckpt", sid)).execute())
        self.ended.append(sid)
        logger.warning("stream %s: ended with an error: %s", sid, message)

    async def _continue(self, sid: str, kind: str, kwargs: dict[str, Any]) -> None:
        state, log = self.state, self.log
        remote = await log.load(sid)
        if remote is None:
            return
        logged = {seq: event_from_dict(json.loads(remote.json(seq))) for seq in sorted(remote._wire)}
        events = list(logged.values())
        if any(ev.is_final for ev in events):
            return
        fam = family(kind)
        model = state.models[fam.name].get()
        plan = DurablePlan(kwargs)
        if not fam.checkpoints:  # continued from its tokens: re-prefilled
            stream = await continuation_stream(model, kwargs, events, sid)
        else:
            try:
                raw = await log.redis.get(log.key("ckpt", sid))
            except Exception as exc:  # noqa: BLE001 - no checkpoint: the run starts from step 0
                logger.warning("stream %s: reading its image checkpoint failed (%s); denoising from step 0", sid, exc)
                raw = None
            plan = durable_plan(log, kind, model, kwargs, state.settings.image_checkpoint_every)
            stream = await checkpoint_continuation_stream(model, plan.kwargs, events, sid, bytes(raw) if raw else None,
                                                          plan.extra, kind=fam.name)
        registry = state.registry
        # The content filter goes on reading the output (primed below with what was sent before).
        record = registry.start(stream, kind=fam.name, resumable=True, model_name=state.models[fam.name].name,
                                owner=remote.owner, owner_keyed=remote.owner_keyed,
                                content_filter=state.content_filter if fam.filters_output else None)
        record.request = dict(kwargs)
        # Before the pump's first event (it runs at the next await): the logged events come first,
        # at their own seq (an image log keeps only its newest preview: the older ones are holes).
        record.token = remote.token
        record.created = remote.created or record.created
        record.events = [logged.get(seq) for seq in range(remote.last_seq + 1)]
        record._json = [remote.json(seq) if seq in logged else None for seq in range(remote.last_seq + 1)]
        record.durable = len(record.events)  # they are in the log already
        # (The registry's estimate, so dropping a logged preview for a newer one keeps it right.)
        record.bytes = sum(len(ev.data) * 2 + 300 if isinstance(ev, (ImageEvent, VideoEvent)) else
                           len(getattr(ev, "delta", "")) * 2 + 200 for ev in events)
        if not fam.checkpoints:
            ids, text = _answer(events)
            record.continue_text(len(ids), text)
        else:
            newest = {ev.index: seq for seq, ev in logged.items() if isinstance(ev, ImageEvent) and not ev.is_final}
            record._newest_preview = dict(newest)
            if record._log is not None:
                record._log.newest_preview = dict(newest)  # the next preview deletes the logged one
        record.continuable = True  # its request is in the log: a SIGTERM here hands it off again
        _keep_checkpoints(log, record, plan.checkpoints)
        registry.remote.pop(sid, None)
        self.continued.append(sid)
        logger.warning("stream %s: continuing it here after its server went away (%d events logged)", sid,
                       len(record.events))
        for hook in CONTINUED_HOOKS:
            await hook(state, record)


async def hand_off(state: Any) -> list[str]:
    """SIGTERM with a durable log, after the drain deadline: stop the streams still running that
    another server can continue, without ending them (see the module docstring); their ids.

    The model stops; the events it made are flushed to the log and an image's newest checkpoint
    to Redis; then, in one transaction, each is marked ``handoff`` (its next claim is not counted
    as a restart) and this process's liveness key is deleted, so the next server claims them at
    its next scan. Those not continuable are left to the caller (cancelled as before)."""
    registry, log = state.registry, state.registry.log
    records = [r for r in list(registry.live.values())
               if r.continuable and not r.done and r._log is not None and not r._log.failed]
    continuer = getattr(state, "continuer", None)
    claimed = list(continuer.pending) if continuer is not None else []
    if not records and not claimed:
        return []
    logger.warning("draining: handing %d running streams off to the next server on the event log", len(records))
    for record in records:
        record.hand_off()
    end = time.monotonic() + state.settings.cancel_timeout_s + 1
    while any(not r.done for r in records) and time.monotonic() < end:
        await asyncio.sleep(0.02)
    for record in records:
        if not record.done:
            record.force_finish()  # the pump's final (a server-written one) is dropped as well
    await asyncio.sleep(0)
    for record in records:
        await record._log.drain(5.0)
        if record.checkpoints is not None:
            await record.checkpoints.flush()
            await record.checkpoints.close(delete=False)
    handed = [r.stream_id for r in records if not r._log.failed and not r._log.pending]
    if continuer is not None:
        await continuer.stopped()
    pipe = log.redis.pipeline(transaction=True)
    now = time.time()
    for sid in handed + claimed:
        pipe.hset(log.key("m", sid), mapping={"handoff": 1, "hb": now})
        log.live_writers.pop(sid, None)
    pipe.delete(log.key("proc", log.instance))
    await pipe.execute()
    return handed
