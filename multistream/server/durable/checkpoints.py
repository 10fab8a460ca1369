"""An image stream's newest checkpoint kept in Redis, for whoever continues the stream after its
process went away: a Ray image replica that takes over (`ray._replica`), or a restarted server
(`continuation`). One writer per stream; the key is ``{prefix}ckpt:{stream id}`` (``ms:ckpt:...``).

``put`` runs on the model's engine thread and only hands the checkpoint over; one task on the
event loop serializes and writes the newest one (a checkpoint superseded before its turn is never
written, so a slow Redis costs checkpoints, never denoising time). The embedded 64 px model's
checkpoint is about 13 KB (one ``SET`` a step: well under a millisecond on a local Redis); an SD
1.5 512 px fp16 run's about 100 KB.

Example:
    >>> w = CheckpointWriter(redis, "ms:ckpt:" + stream_id, asyncio.get_running_loop())  # doctest: +SKIP
    >>> stream = sd.stream("a red circle", seed=0, on_checkpoint=w.put, checkpoint_every=1)    # doctest: +SKIP
    >>> await w.close(delete=True)          # the stream ended: nothing left to continue       # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from ...events import Event, ImageEvent, VideoEvent

__all__ = ["CHECKPOINT_TTL_S", "CheckpointWriter", "already_sent"]

logger = logging.getLogger("multistream.server")

CHECKPOINT_TTL_S = 600  # an image checkpoint outlives its last write by this much (a stream not ended cleanly)


def already_sent(ev: Event, step: int) -> bool:
    """A preview of a step at or before ``step``, which the stream's readers already had (a run
    continued from a checkpoint older than its last preview makes those steps again)."""
    return (isinstance(ev, (ImageEvent, VideoEvent)) and not ev.is_final and ev.finish_reason is None
            and ev.step <= step)


class CheckpointWriter:
    """Keeps the newest checkpoint of one image stream in Redis (see the module docstring).

    ``key`` may be bound later (`bind`), once the stream, and so its id, exists: checkpoints put
    before that wait for it. ``close`` waits for the write in flight (``flush`` first to write the
    newest one too) and, with ``delete``, deletes the key: the stream has ended.
    """

    def __init__(self, client: Any, key: str | None, loop: asyncio.AbstractEventLoop) -> None:
        self.client, self.key, self.loop = client, key, loop
        self._lock = threading.Lock()
        self._newest: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.writes = 0
        self.write_s = 0.0
        self.nbytes = 0
        self.failed = 0
        self.step = 0  # the step of the newest checkpoint written

    def bind(self, key: str) -> None:
        """Name the key (on the event loop's thread); a checkpoint already put is written now."""
        self.key = key
        self._kick()

    def put(self, checkpoint: Any) -> None:
        with self._lock:
            self._newest = checkpoint
        try:
            self.loop.call_soon_threadsafe(self._kick)
        except RuntimeError:  # the loop closed (a server shutting down): nothing will read it
            pass

    def _kick(self) -> None:
        if self.key is not None and not self._closed and (self._task is None or self._task.done()):
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
                await self.client.set(self.key, data, ex=CHECKPOINT_TTL_S)
            except Exception as exc:  # noqa: BLE001 - a lost checkpoint only makes a continuation start earlier
                self.failed += 1
                logger.debug("writing image checkpoint %s failed: %s", self.key, exc)
                continue
            self.writes += 1
            self.write_s += time.perf_counter() - started
            self.nbytes = len(data)
            self.step = int(getattr(checkpoint, "step", 0))

    def metrics(self) -> dict[str, float]:
        out = {"checkpoint_writes": float(self.writes)}
        if self.writes:
            out["checkpoint_write_ms"] = self.write_s * 1e3 / self.writes
            out["checkpoint_bytes"] = float(self.nbytes)
        return out

    async def flush(self, timeout: float = 5.0) -> None:
        """Write the newest checkpoint put so far (a hand-off: the next server continues from it)."""
        self._kick()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except Exception:  # noqa: BLE001 - an older checkpoint (or none) only costs steps again
                pass

    async def close(self, delete: bool) -> None:
        """Stop writing; ``delete`` the key once the stream has ended (else it expires)."""
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except Exception:  # noqa: BLE001
                pass
        if not delete or self.key is None:
            return
        try:
            await self.client.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            logger.debug("deleting image checkpoint %s failed: %s", self.key, exc)
