"""A restart continues what was running: with ``--event-log redis://...``, a text generation whose
server died (``kill -9``, a crash, a lost machine) is picked up by the next server on the same
Redis (the restarted one, or a peer) and continued where its log ends, so a client resuming with
``Last-Event-ID`` (native SSE) or ``starting_after`` (Responses) gets the rest: no gap, no
duplicate, and greedy (or seeded) text equal to an uninterrupted run.

How:

- each text stream's request (the ``TextModel.stream`` keyword arguments) is kept in its log's
  hash (``ms:m:{id}`` field ``req``) and its id in the set ``ms:live`` until its final event;
- each server process keeps a liveness key ``ms:proc:{instance}`` (``PX`` `LIVENESS_TTL_S`, renewed
  every `SCAN_EVERY_S`); a live stream whose ``proc`` has no liveness key is an orphan;
- every `SCAN_EVERY_S` a server with its text model loaded claims orphans (a compare-and-set
  of ``proc`` in one Lua call, so one process wins) and continues each one: the logged events
  are the new record's first events (same id, same resume token and owner), the prompt and the
  logged tokens are prefilled (``TextModel.replica_stream(resume_tokens=...)``, the code a Ray
  replica's failover runs; a model without it regenerates and the logged part is trimmed, as a
  Ray replica does), and the new events follow with the next ``seq``;
- bounded: each claim counts in ``restarts``; past `MAX_RESTARTS` the stream is ended in the log
  with an error event (a generation that keeps killing its server is not retried forever).

A graceful shutdown (SIGTERM) still ends its streams (``finish_reason="cancelled"``): only a
process that vanished leaves work to continue. Image generations are not continued here (a Ray
image replica continues from its checkpoint); theirs end as before for resuming readers.

Example:
    >>> # multistream serve --event-log redis://127.0.0.1:6379/0   (kill -9 it, start it again)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..events import ErrorEvent, Event, TextEvent, event_from_dict
from ..stream import Stream, StreamWriter
from .event_log import entry_id

__all__ = ["CONTINUED_HOOKS", "LIVENESS_TTL_S", "MAX_RESTARTS", "SCAN_EVERY_S", "Continuer", "continuation_stream", "remember_request"]

logger = logging.getLogger("multistream.server")

LIVENESS_TTL_S = 5.0  # a live process stalled (GIL, GC, a slow Redis) this long looks dead
SCAN_EVERY_S = 0.5
MAX_RESTARTS = 2

# KEYS[1] = the stream's hash; ARGV = (the proc seen, this proc). Returns the new restart count, or -1.
_PUMPS: set[asyncio.Task[None]] = set()
# Called with (state, record) for each stream continued here: the Responses route keeps a
# background response running and its stored entry at hand (`openai_responses`).
CONTINUED_HOOKS: list[Callable[[Any, Any], Awaitable[None]]] = []

_CLAIM = """
local proc = redis.call('HGET', KEYS[1], 'proc')
if proc ~= ARGV[1] or redis.call('HGET', KEYS[1], 'done') == '1' then return -1 end
redis.call('HSET', KEYS[1], 'proc', ARGV[2], 'hb', ARGV[3])
return redis.call('HINCRBY', KEYS[1], 'restarts', 1)
"""


def remember_request(log: Any, record: Any, kwargs: dict[str, Any]) -> None:
    """Keep a text stream's request with its log (so another process can continue it)."""
    if record.kind != "text" or not record.resumable:
        return
    try:
        req = json.dumps(kwargs, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return  # not JSON (a Python-only option): not continued after a crash

    async def write() -> None:
        try:
            await (log.redis.pipeline(transaction=False).hset(log.key("m", record.stream_id), mapping={"req": req, "proc": log.instance})
                   .sadd(log.key("live"), record.stream_id).execute())
        except Exception as exc:  # noqa: BLE001 - the stream runs on; only its continuation is lost
            logger.warning("stream %s: keeping its request in the event log failed: %s", record.stream_id, exc)

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


def continuation_stream(model: Any, kwargs: dict[str, Any], events: list[Event], stream_id: str) -> Stream:
    """A stream with id ``stream_id`` that continues the answer ``events`` began: the prompt and
    the logged tokens prefilled (``replica_stream(resume_tokens=)``), only what follows sent;
    its first event follows the last logged one (``offset``, ``index``)."""
    from .ray._common import trim_text as trim  # the Ray failover's own trim

    ids, text = _answer(events)
    native = callable(getattr(model, "replica_stream", None))
    if native and ids:
        inner = model.replica_stream(**kwargs, resume_tokens=ids)
    else:
        inner = model.stream(**kwargs)
    loop = asyncio.get_running_loop()

    def submit(w: StreamWriter) -> None:
        async def pump() -> None:
            w.continue_text(len(text))
            try:
                async for ev in inner:
                    if isinstance(ev, TextEvent) and not (native and ids):
                        trimmed = trim(ev, len(ids), len(text))
                        if trimmed is None:
                            continue
                        ev = trimmed
                    w.forward(ev)
                    if ev.is_final:
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

    stream = Stream(kind="text", stream_id=stream_id, submit=submit)
    if events:  # its clock goes on from the last logged event (``t`` never goes back)
        stream._channel.started_at -= max(ev.t for ev in events)
    return stream


class Continuer:
    """This process's side: liveness, the orphan scan, claims and continuations."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.log = state.registry.log
        self.task: asyncio.Task[None] | None = None
        self.continued: list[str] = []  # stream ids continued here (tests, logs)
        self.ended: list[str] = []  # ended with an error after too many restarts
        self.pending: dict[str, dict[str, Any]] = {}  # claimed, waiting for the text model to load
        self._claim: Any = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name="multistream-continuer")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        log = self.log
        self._claim = log.redis.register_script(_CLAIM)
        while True:
            try:
                await log.redis.set(log.key("proc", log.instance), "1", px=int(LIVENESS_TTL_S * 1000))
                if self.state.models["text"].state in ("ready", "loading", "pending") and not self.state.draining:
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
        sids = [m.decode() if isinstance(m, bytes) else str(m) for m in await log.redis.smembers(log.key("live"))]
        sids = [sid for sid in sids if sid not in self.state.registry.live and sid not in self.pending]
        if not sids:
            return
        pipe = log.redis.pipeline(transaction=False)
        for sid in sids:
            pipe.hmget(log.key("m", sid), ["proc", "done", "req"])
        metas = await pipe.execute()
        procs = sorted({(m[0].decode() if isinstance(m[0], bytes) else str(m[0])) for m in metas if m[0] is not None})
        pipe = log.redis.pipeline(transaction=False)
        for proc in procs:
            pipe.exists(log.key("proc", proc))
        alive = {proc for proc, up in zip(procs, await pipe.execute()) if up} | {log.instance}
        for sid, (proc, done, req) in zip(sids, metas):
            if proc is None or done in (b"1", "1") or req is None:
                await log.redis.srem(log.key("live"), sid)
                continue
            proc_s = proc.decode() if isinstance(proc, bytes) else str(proc)
            if proc_s in alive:
                continue  # its process is alive (or it is ours)
            restarts = await self._claim(keys=[log.key("m", sid)], args=[proc_s, log.instance, time.time()])
            if int(restarts) < 0:
                continue  # another process claimed it first
            if int(restarts) > MAX_RESTARTS:
                await self._give_up(sid, int(restarts) - 1)
                continue
            self.pending[sid] = json.loads(req)

    async def _run_pending(self) -> None:
        """Continue the claimed streams once the model is ready; until then keep their readers
        (following the log from any process) from taking them for lost."""
        if not self.pending:
            return
        log = self.log
        if self.state.models["text"].state != "ready":
            pipe = log.redis.pipeline(transaction=False)
            for sid in self.pending:
                pipe.hset(log.key("m", sid), "hb", time.time())
            await pipe.execute()
            return
        pending, self.pending = self.pending, {}
        for sid, kwargs in pending.items():
            try:
                await self._continue(sid, kwargs)
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
               .zadd(log.key("finished"), {sid: time.time()}).srem(log.key("live"), sid).execute())
        self.ended.append(sid)
        logger.warning("stream %s: ended with an error: %s", sid, message)

    async def _continue(self, sid: str, kwargs: dict[str, Any]) -> None:
        state, log = self.state, self.log
        remote = await log.load(sid)
        if remote is None:
            return
        events = [event_from_dict(json.loads(remote.json(s))) for s in sorted(remote._wire)]
        if any(ev.is_final for ev in events):
            return
        model = state.models["text"].get()
        stream = continuation_stream(model, kwargs, events, sid)
        registry = state.registry
        record = registry.start(stream, kind="text", resumable=True, model_name=state.models["text"].name,
                                owner=remote.owner, owner_keyed=remote.owner_keyed)
        # (No content filter on a continuation: its holdback would start from an empty text.)
        # Before the pump's first event (it runs at the next await): the logged events come first.
        record.token = remote.token
        record.created = remote.created or record.created
        record.events = list(events)
        record._json = [remote.json(ev.seq) for ev in events]
        record.durable = len(events)  # they are in the log already
        record._n_tokens, record._text = len(_answer(events)[0]), _answer(events)[1]
        registry.remote.pop(sid, None)
        self.continued.append(sid)
        logger.warning("stream %s: continuing it here after its server went away (%d events logged)", sid, len(events))
        for hook in CONTINUED_HOOKS:
            await hook(state, record)
