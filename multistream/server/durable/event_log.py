"""A shared event log in Redis: every event of every stream, readable for resume from any process.

The in-memory `Registry` stays the source of truth for the process that runs a stream (its
subscribers read memory, never Redis); each appended event is also written, in order and batched,
to a Redis Stream keyed by stream id. Another process (a second server, a Ray ingress replica,
this server after a restart) that is asked to resume a stream it does not hold reads that log:
``XRANGE`` for what happened, then blocking ``XREAD`` for what comes. The writer never makes the
model or the local clients wait: a Redis that is slow or down only costs the log.

Keys (``prefix`` defaults to ``ms:``):

- ``ms:s:{id}`` - the Redis Stream; the entry for event ``seq`` has id ``0-{seq+1}`` (so a resume
  after ``seq`` is ``XREAD ... 0-{seq+1}``) and fields ``j`` (the wire JSON) and ``f`` (final).
- ``ms:m:{id}`` - a hash: owner, resume token, kind, model, done, finish_reason, bytes, hb (the
  producer's heartbeat, seconds since the epoch).
- ``ms:finished`` - a sorted set of finished streams by finish time (count/byte/time retention);
  ``ms:bytes`` - approximate bytes held by all logs; ``ms:cancel`` - a pub/sub channel: a cancel
  received by a process that does not run the stream reaches the one that does.
- ``ms:ctl:{process}`` - a pub/sub channel per process (the ``proc`` field of ``ms:m:{id}``; a Ray
  model replica listens on ``ms:ctl:replica:{name}``): edits (finish, steer, rewind) of a stream
  that process runs, sent by any other; the owner applies the command and pushes its verdict
  (``{"status": 200, "accepted": ...}`` or a 4xx with the model's message) on ``ms:r:{reply id}``,
  which the sender waits on for ``CONTROL_WAIT_S`` (``BLPOP``).

Retention mirrors the in-memory log: a live image stream keeps only its newest preview per image
(the older entry is ``XDEL``-ed); finished streams expire after ``retention_s`` (``EXPIRE``), and
the oldest finished ones are deleted beyond ``max_retained_streams`` or ``max_retained_bytes``;
``MAXLEN`` bounds any one log. A live stream whose producer stopped beating for
``stale_after_s`` (a crashed process) ends for its readers with a server-written final event.

Example:
    >>> log = RedisEventLog("redis://127.0.0.1:6379/0")        # doctest: +SKIP
    >>> app = create_app(text_model=..., settings=ServerSettings(event_log="redis://127.0.0.1:6379/0"))  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ...errors import InvalidArgumentError
from ...events import ErrorEvent, Event, ImageEvent, TextEvent, event_from_dict
from ..http.problems import Problem
from ..settings import ServerSettings
from ..streams.view import SharedAccess
from .resume import PREFIX

if TYPE_CHECKING:
    from ..streams.registry import StreamRecord

__all__ = ["CONTROL_WAIT_S", "RedisEventLog", "RemoteRecord", "apply_command", "control_request", "entry_id",
           "serve_control"]

logger = logging.getLogger("multistream.server")

MAXLEN = 100_000  # entries per stream: far above any real stream (a text event per token, newest previews only)
_STALE_AFTER_S = 20.0
_HEARTBEAT_S = 5.0
READER_FRESH_FACTOR = 2.5  # a reader's mark counts for this many of its heartbeats (it renews it every one)
CONTROL_WAIT_S = 2.0  # how long a forwarded edit waits for the owner's verdict before answering 202


def entry_id(seq: int) -> str:
    """The Redis Stream entry id of event ``seq`` (ids must be > 0-0, so seq 0 is ``0-1``)."""
    return f"0-{seq + 1}"


def _seq_of(entry: bytes | str) -> int:
    s = entry.decode() if isinstance(entry, bytes) else entry
    return int(s.partition("-")[2]) - 1


def _event_bytes(ev: Event) -> int:  # the same estimate as the in-memory registry
    if isinstance(ev, TextEvent):
        return len(ev.delta) * 2 + 200
    if isinstance(ev, ImageEvent):
        return len(ev.data) * 2 + 300
    return 300


def unavailable(action: str, exc: BaseException | None = None) -> Problem:
    if exc is not None:
        logger.warning("event log (Redis) unavailable while %s: %s: %s", action, type(exc).__name__, exc)
    return Problem(503, "event_log_unavailable", f"the event log (Redis) is unavailable, so this server cannot "
                   f"{action}; retry shortly", {"Retry-After": "2"})


class _Writer:
    """Appends one stream's events to Redis in order; batches whatever arrived while a write was in flight."""

    def __init__(self, log: RedisEventLog, record: StreamRecord) -> None:
        self.log = log
        self.record = record
        self.pending: list[tuple[Event, str]] = []
        self.task: asyncio.Task[None] | None = None
        self.failed = False
        self.created = False
        self.newest_preview: dict[int, int] = {}
        self.bytes = 0

    async def remote_readers(self) -> bool:
        """Whether a client read this stream through the log on another server within the last two
        marks (`RedisEventLog.mark_reader`): asked by the stream's record when its grace period ends
        without a subscriber of its own (a client that resumed elsewhere while it runs here)."""
        try:
            mark = await self.log.redis.hget(self.log.key("m", self.record.stream_id), "rd")
        except Exception:  # noqa: BLE001 - Redis down: no reader can be reading through it
            return False
        return mark is not None and time.time() - float(mark) < READER_FRESH_FACTOR * self.log.heartbeat_s

    def append(self, ev: Event, wire: str) -> None:
        if self.failed:
            return
        self.pending.append((ev, wire))
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        log, rec = self.log, self.record
        skey, mkey = log.key("s", rec.stream_id), log.key("m", rec.stream_id)
        while self.pending and not self.failed:
            batch, self.pending = self.pending, []
            pipe = log.redis.pipeline(transaction=False)
            if not self.created:
                pipe.hset(mkey, mapping={"token": rec.token, "owner": rec.owner or "", "proc": log.instance, "keyed": int(rec.owner_keyed),
                                         "kind": rec.kind, "model": rec.model_name, "resumable": int(rec.resumable),
                                         "created": rec.created, "done": 0, "hb": time.time()})
            added = 0
            final: Event | None = None
            for ev, wire in batch:
                pipe.xadd(skey, {"j": wire, "f": int(ev.is_final)}, id=entry_id(ev.seq), maxlen=MAXLEN,
                          approximate=True)
                size = _event_bytes(ev)
                added += size
                if isinstance(ev, ImageEvent) and not ev.is_final and ev.finish_reason is None:
                    older = self.newest_preview.get(ev.index)
                    if older is not None:
                        pipe.xdel(skey, entry_id(older))
                        added -= len(ev.data) * 2 + 300  # about the size of the frame it replaces
                    self.newest_preview[ev.index] = ev.seq
                elif isinstance(ev, ImageEvent):
                    self.newest_preview.pop(ev.index, None)
                if ev.is_final:
                    final = ev
            self.bytes += added
            pipe.incrby(log.key("bytes"), added)
            if final is not None:
                reason = "error" if isinstance(final, ErrorEvent) else (getattr(final, "finish_reason", None) or "stop")
                pipe.hset(mkey, mapping={"done": 1, "finish_reason": reason, "bytes": self.bytes, "last": final.seq})
                ttl = max(1, int(log.settings.retention_s + 1))
                pipe.expire(skey, ttl)
                pipe.expire(mkey, ttl)
                pipe.zadd(log.key("finished"), {rec.stream_id: time.time()})
                pipe.srem(log.key("live"), rec.stream_id)  # nothing left to continue (`continuation`)
            elif not self.created:
                ttl = int(log.settings.request_timeout_s + log.settings.retention_s + 60)
                pipe.expire(skey, ttl)
                pipe.expire(mkey, ttl)
            try:
                t0 = time.perf_counter()
                await pipe.execute()
                log.write_latency.append(time.perf_counter() - t0)
                if len(log.write_latency) > 4096:
                    del log.write_latency[:2048]
            except Exception as exc:  # noqa: BLE001 - Redis trouble must never touch the live stream
                self.failed = True
                log.write_failures += 1
                wake = getattr(rec, "_wake", None)
                if wake is not None:
                    wake()  # the events held back for the log go out now
                logger.warning("stream %s: writing the event log failed (%s: %s); this stream is not resumable "
                               "from other processes", rec.stream_id, type(exc).__name__, exc)
                return
            self.created = True
            logged = getattr(rec, "logged", None)
            if logged is not None:
                logged(batch[-1][0].seq + 1)  # subscribers may now see them (`StreamRecord.durable`)
            if final is not None:
                log.live_writers.pop(rec.stream_id, None)
                await log.evict()

    async def drain(self, timeout: float = 5.0) -> None:
        if self.task is not None:
            await asyncio.wait({self.task}, timeout=timeout)


class RemoteRecord(SharedAccess):
    """A stream that another process runs (or ran), read from the log: what `StreamRecord` offers
    to readers (``subscribe``, ``json``, ``allows``, ``events``, ``done``...), backed by Redis."""

    def __init__(self, log: RedisEventLog, stream_id: str, meta: dict[str, str], entries: list[tuple[Any, Any]]) -> None:
        self.log = log
        self.stream_id = stream_id
        self.token = meta.get("token", "")
        self.owner = meta.get("owner") or None
        self.proc = meta.get("proc") or ""  # the process that runs it (its control channel)
        self.owner_keyed = meta.get("keyed") == "1"
        self.kind = meta.get("kind", "text")
        self.model_name = meta.get("model", "")
        self.resumable = meta.get("resumable", "1") == "1"
        self.created = float(meta.get("created") or 0)
        self.hb = float(meta.get("hb") or 0)
        self.finish_reason: str | None = meta.get("finish_reason") or None
        self.subscribers = 0
        self.remote = True
        self._wire: dict[int, str] = {}
        self.last_seq = -1
        self.done = False
        for eid, fields in entries:
            self._add(eid, fields)
        if meta.get("done") == "1":
            self.done = True

    @property
    def max_followers(self) -> int:
        return self.log.settings.max_followers

    @property
    def events(self) -> list[Event | None]:
        """Only its length matters to callers (``len(record.events)`` = the next seq)."""
        return [None] * (self.last_seq + 1)

    def _add(self, eid: Any, fields: dict[Any, Any]) -> Event:
        seq = _seq_of(eid)
        wire = fields.get(b"j", fields.get("j"))
        wire = wire.decode() if isinstance(wire, bytes) else wire
        self._wire[seq] = wire
        self.last_seq = max(self.last_seq, seq)
        ev = event_from_dict(json.loads(wire))
        if ev.is_final:
            self.done = True
            self.finish_reason = "error" if isinstance(ev, ErrorEvent) else (getattr(ev, "finish_reason", None) or "stop")
        return ev

    def json(self, seq: int) -> str:
        return self._wire[seq]

    @property
    def final(self) -> Event | None:
        return event_from_dict(json.loads(self._wire[self.last_seq])) if self.done and self._wire else None

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the process that runs the stream to cancel it (pub/sub)."""
        if not self.done:
            asyncio.get_running_loop().create_task(self.log.publish_cancel(self.stream_id))

    def drop_subscribers(self) -> None:  # test hook parity with StreamRecord
        pass

    async def subscribe(self, after: int = -1) -> AsyncIterator[Event]:
        """Events with ``seq > after`` from the log, then live ones (blocking XREAD) up to the final."""
        self.subscribers += 1
        try:
            log = self.log
            skey = log.key("s", self.stream_id)
            # Replay with XRANGE (a fresh read: the log may have grown since it was loaded), then
            # follow with blocking XREAD from the last entry seen.
            from redis.exceptions import TimeoutError as ReadTimeout

            cursor = entry_id(after)
            replay, finishing = True, False
            slow_since: float | None = None
            marked = 0.0
            while True:
                if time.monotonic() - marked >= log.heartbeat_s:
                    # A client reads this stream here, through the log: the process that runs it
                    # has no subscriber of its own, and must not end it when its grace period ends.
                    marked = time.monotonic()
                    await log.mark_reader(self.stream_id)
                try:
                    if replay:
                        entries = await log.redis.xrange(skey, "(" + cursor, "+")
                        replay = False
                    else:
                        got = await log.redis.xread({skey: cursor}, count=512, block=log.block_ms)
                        entries = got[0][1] if got else []
                    slow_since = None
                except Exception as exc:  # noqa: BLE001
                    now = time.monotonic()
                    if isinstance(exc, (ReadTimeout, asyncio.TimeoutError)) and now - (slow_since or now) < log.stale_after_s:
                        # A late answer, not a Redis that is down: this process was busy (a model
                        # loading, say, so its event loop missed the read's deadline). Read again.
                        slow_since = slow_since or now
                        logger.debug("stream %s: reading the event log timed out; reading again", self.stream_id)
                        continue
                    logger.warning("stream %s: reading the event log failed: %s", self.stream_id, exc)
                    yield self._server_final("the event log (Redis) became unavailable; resume again shortly",
                                             "event_log_unavailable")
                    return
                for eid, fields in entries:
                    cursor = eid.decode() if isinstance(eid, bytes) else eid
                    ev = self._add(eid, fields)
                    yield ev
                    if ev.is_final:
                        return
                if entries:
                    continue
                # Nothing new within the block: is the producer still there?
                try:
                    meta = await log.redis.hmget(log.key("m", self.stream_id), ["hb", "done"])
                except Exception:  # noqa: BLE001 - the next XREAD reports it
                    continue
                if meta[0] is None:
                    yield self._server_final("the stream's log expired before it ended", "stream_lost")
                    return
                if meta[1] in (b"1", "1"):
                    if not finishing:  # it may have ended just after our read: one more look
                        finishing = replay = True
                        continue
                    return  # the final is at or before the cursor: nothing more will come
                if time.time() - float(meta[0]) > log.stale_after_s:
                    yield self._server_final("the server that ran this stream went away before it ended",
                                             "producer_lost")
                    return
        finally:
            self.subscribers -= 1

    def _server_final(self, message: str, kind: str) -> ErrorEvent:
        seq = self.last_seq + 1
        self.last_seq = seq
        ev = ErrorEvent(stream_id=self.stream_id, seq=seq, t=0.0, error={"type": kind, "message": message})
        self._wire[seq] = ev.to_json()
        self.done = True
        self.finish_reason = "error"
        return ev


class RedisEventLog:
    """The Redis side of the registry: writers for local streams, readers for remote ones."""

    def __init__(self, url: str, settings: ServerSettings | None = None, *, prefix: str = PREFIX,
                 stale_after_s: float = _STALE_AFTER_S, heartbeat_s: float = _HEARTBEAT_S, block_ms: int = 1000,
                 timeout_s: float = 2.0, connect_timeout_s: float = 5.0) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError:  # pragma: no cover - depends on the install
            raise InvalidArgumentError("the Redis event log needs the redis client: pip install 'multistream[scale]'") from None
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgumentError(f"--event-log must be redis://HOST:PORT/DB (or 'memory'), got {url!r}")
        self.url = url
        self.settings = settings or ServerSettings()
        self.prefix = prefix
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.block_ms = block_ms
        # Short timeouts and no retries: when Redis is down a request gets a 503 in about a second,
        # never a hang; the client reconnects by itself once Redis is back. A connect to a Redis
        # that is down is refused at once; its timeout only fires when this process's event loop
        # was held up (a server just restarted, resuming a run while it loads), where 2 s once
        # turned a resume into a 503 on a busy 2-core machine: so it is longer.
        self.redis = aioredis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s + block_ms / 1000,
                                       retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.live_writers: dict[str, _Writer] = {}
        self.write_latency: list[float] = []
        self.write_failures = 0
        self.up = True
        self._tasks: list[asyncio.Task[None]] = []
        self._cancel_handler: Any = None
        self.instance = secrets.token_hex(8)  # this process's name on the control channel

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, on_cancel: Any = None, on_control: Any = None) -> None:
        """Start the heartbeat, the cancel listener and (with ``on_control``, an async function
        from a command message to a verdict dict) this process's edit listener."""
        self._cancel_handler = on_cancel
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat(), name="multistream-log-heartbeat"),
                       loop.create_task(self._listen_cancels(), name="multistream-log-cancels")]
        if on_control is not None:
            self._tasks.append(loop.create_task(serve_control(self.redis, self.prefix, self.instance, on_control),
                                                name="multistream-log-control"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in list(self.live_writers.values()):
            await writer.drain(2.0)
        try:
            await self.redis.aclose()
        except Exception:  # noqa: BLE001
            pass

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.live_writers:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                now = time.time()
                for sid, writer in self.live_writers.items():
                    if writer.created and not writer.failed:
                        pipe.hset(self.key("m", sid), "hb", now)
                await pipe.execute()
                self.up = True
            except Exception as exc:  # noqa: BLE001
                self.up = False
                logger.debug("event log heartbeat failed: %s", exc)

    async def _listen_cancels(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(self.key("cancel"))
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg and self._cancel_handler is not None:
                        data = msg.get("data")
                        self._cancel_handler(data.decode() if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down: try again in a moment
                logger.debug("event log cancel listener: %s", exc)
                await asyncio.sleep(1.0)

    async def publish_cancel(self, stream_id: str) -> None:
        try:
            await self.redis.publish(self.key("cancel"), stream_id)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not forward a cancel for stream %s: %s", stream_id, exc)

    async def forward_edit(self, record: RemoteRecord, command: str, args: list[Any],
                           kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """Send an edit to the process that runs ``record``'s stream; its verdict, ``{"gone":
        True}`` when no process listens there, or None when none came within ``CONTROL_WAIT_S``."""
        if not record.proc:
            return {"gone": True}
        try:
            return await control_request(self.redis, self.prefix, record.proc, {
                "stream_id": record.stream_id, "command": command, "args": list(args), "kwargs": kwargs})
        except Exception as exc:  # noqa: BLE001
            raise unavailable("forward the edit", exc) from None

    # -- writing -------------------------------------------------------------------------------

    async def check(self, action: str = "start a stream") -> None:
        """Raise a 503 `Problem` at once when Redis does not answer (checked before admitting)."""
        try:
            await self.redis.ping()
            self.up = True
        except Exception as exc:  # noqa: BLE001
            self.up = False
            raise unavailable(action, exc) from None

    async def mark_reader(self, stream_id: str) -> None:
        """Note that a client reads ``stream_id`` through the log now (`RemoteRecord.subscribe`, every
        ``heartbeat_s``); best effort, as the heartbeat is."""
        try:
            await self.redis.hset(self.key("m", stream_id), "rd", time.time())
        except Exception as exc:  # noqa: BLE001 - the read itself reports a Redis that is down
            logger.debug("event log reader mark failed: %s", exc)

    def writer(self, record: StreamRecord) -> _Writer:
        writer = _Writer(self, record)
        self.live_writers[record.stream_id] = writer
        return writer

    async def evict(self) -> None:
        """Delete the oldest finished logs beyond the time, count and byte bounds."""
        s = self.settings
        zkey, bkey = self.key("finished"), self.key("bytes")
        try:
            for _ in range(1000):  # bounded: a handful per call in practice
                count, total, oldest = await (self.redis.pipeline(transaction=False).zcard(zkey).get(bkey)
                                              .zrange(zkey, 0, 0, withscores=True).execute())
                if not oldest:
                    return
                sid, finished_at = oldest[0]
                sid = sid.decode() if isinstance(sid, bytes) else sid
                expired = time.time() - finished_at > s.retention_s
                if not (expired or count > s.max_retained_streams or int(total or 0) > s.max_retained_bytes):
                    return
                size = await self.redis.hget(self.key("m", sid), "bytes")
                await (self.redis.pipeline(transaction=False).zrem(zkey, sid).delete(self.key("s", sid))
                       .delete(self.key("m", sid)).decrby(bkey, int(size or 0)).execute())
        except Exception as exc:  # noqa: BLE001 - eviction is best effort; EXPIRE is the safety net
            logger.debug("event log eviction failed: %s", exc)

    # -- reading -------------------------------------------------------------------------------

    async def load(self, stream_id: str) -> RemoteRecord | None:
        """The stream's log as a `RemoteRecord`, or None; a 503 `Problem` when Redis is down."""
        if not isinstance(stream_id, str) or not 0 < len(stream_id) <= 128:
            return None
        try:
            meta, entries = await (self.redis.pipeline(transaction=False).hgetall(self.key("m", stream_id))
                                   .xrange(self.key("s", stream_id), "-", "+").execute())
        except Exception as exc:  # noqa: BLE001
            self.up = False
            raise unavailable("resume streams", exc) from None
        if not meta:
            return None
        meta = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else str(v))
                for k, v in meta.items()}
        return RemoteRecord(self, stream_id, meta, entries)

    async def refresh(self, record: RemoteRecord) -> None:
        """Add to ``record`` (read earlier, still live) the entries appended since; a 503 `Problem`
        when Redis is down."""
        try:
            done, entries = await (self.redis.pipeline(transaction=False).hget(self.key("m", record.stream_id), "done")
                                   .xrange(self.key("s", record.stream_id), entry_id(record.last_seq + 1), "+").execute())
        except Exception as exc:  # noqa: BLE001
            self.up = False
            raise unavailable("resume streams", exc) from None
        for eid, fields in entries:
            record._add(eid, fields)
        if done in (b"1", "1"):
            record.done = True

    async def get_meta(self, stream_id: str, name: str) -> bytes | None:
        """A field a surface keeps beside a stream's log (the Responses route's stored response)."""
        return await self.redis.hget(self.key("m", stream_id), name)

    async def set_meta(self, stream_id: str, name: str, value: str) -> None:
        await self.redis.hset(self.key("m", stream_id), name, value)

    async def delete_meta(self, stream_id: str, name: str) -> None:
        await self.redis.hdel(self.key("m", stream_id), name)

    def stats(self) -> dict[str, Any]:
        lat = sorted(self.write_latency)
        pick = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6, 1)) if lat else (lambda q: None)
        return {"up": self.up, "live": len(self.live_writers), "write_failures": self.write_failures,
                "write_us_p50": pick(0.5), "write_us_p95": pick(0.95)}


# -- control: edits for a stream another process runs ---------------------------------------------


def apply_command(stream: Any, command: str, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Apply an already-parsed edit to a model `Stream`; True when queued (a finish of an ended
    stream: False). Raises `Problem`: 409 for an ended stream, 400 with the model's message."""
    from ...errors import StreamFinishedError
    from ..http.problems import problem_from_exception

    try:
        if command == "finish":
            if stream._channel.final_put:
                return False
            stream.finish_early()
        elif command == "steer":
            stream.steer(*args, **kwargs)
        elif command == "rewind":
            stream.rewind(*args, **kwargs)
        else:
            raise Problem(400, "invalid_message", f"unknown command {command!r}")
    except StreamFinishedError as exc:
        raise Problem(409, "stream_finished", str(exc)) from None
    except Problem:
        raise
    except Exception as exc:  # noqa: BLE001 - a model's refusal is a 4xx with its message
        raise problem_from_exception(exc) from None
    return True


def verdict(problem: Problem | None = None, accepted: bool = True, status: int = 200) -> dict[str, Any]:
    """The owner's answer to a forwarded edit (JSON-ready)."""
    if problem is not None:
        return {"status": problem.status, "type": problem.type, "message": problem.message}
    return {"status": status, "accepted": accepted}


async def control_request(redis: Any, prefix: str, target: str, message: dict[str, Any],
                          wait_s: float = CONTROL_WAIT_S) -> dict[str, Any] | None:
    """Publish ``message`` on ``{prefix}ctl:{target}`` and wait for the verdict: a dict,
    ``{"gone": True}`` when nobody listens on that channel, None when none came in ``wait_s``."""
    reply = secrets.token_hex(12)
    receivers = await redis.publish(f"{prefix}ctl:{target}", json.dumps({**message, "reply": reply}))
    if not receivers:
        return {"gone": True}
    got = await redis.blpop([f"{prefix}r:{reply}"], timeout=wait_s)
    if not got:
        return None
    raw = got[1]
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)  # type: ignore[no-any-return]


async def serve_control(redis: Any, prefix: str, target: str, handler: Any) -> None:
    """Forever: answer the commands published on ``{prefix}ctl:{target}`` with ``await
    handler(message)`` (a verdict dict), pushed on the sender's reply list."""
    async def answer(raw: Any) -> None:
        try:
            message = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            reply = message.get("reply")
            if not isinstance(reply, str):
                return
            try:
                result = await handler(message)
            except Problem as problem:
                result = verdict(problem)
            except Exception:  # noqa: BLE001
                logger.exception("applying a forwarded edit failed")
                result = verdict(Problem(500, "internal_error", "the owner failed to apply the edit"))
            key = f"{prefix}r:{reply}"
            await redis.pipeline(transaction=False).rpush(key, json.dumps(result)).expire(key, 30).execute()
        except Exception as exc:  # noqa: BLE001 - the sender times out and answers 202
            logger.warning("answering a forwarded edit failed: %s", exc)

    tasks: set[asyncio.Task[None]] = set()
    while True:
        pubsub = None
        try:
            pubsub = redis.pubsub()
            await pubsub.subscribe(f"{prefix}ctl:{target}")
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg:
                    task = asyncio.get_running_loop().create_task(answer(msg.get("data")))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Redis down: try again in a moment
            logger.debug("control listener %s: %s", target, exc)
            await asyncio.sleep(1.0)
        finally:
            if pubsub is not None:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass
