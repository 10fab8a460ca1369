"""The one way a generation is continued elsewhere, used by the restart continuation
(`continuation`) and by the Ray failover (`ray._replica`): text from its logged tokens (prefilled
with ``resume_tokens``, or regenerated and trimmed with `trim_text`), an image from its newest
checkpoint (`start_from_checkpoint`, from step 0 when there is none or the model refuses it), and
the Redis names both read (`PREFIX`, `checkpoint_key`, `redis_client`).

Example:
    >>> checkpoint_key("9f2c")
    'ms:ckpt:9f2c'
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ...events import TextEvent

__all__ = ["PREFIX", "checkpoint_key", "redis_client", "start_from_checkpoint", "trim_text"]

logger = logging.getLogger("multistream.server")

PREFIX = "ms:"  # every key of the shared event log begins with it (`RedisEventLog`)
T = TypeVar("T")


def checkpoint_key(stream_id: str, prefix: str = PREFIX) -> str:
    """The Redis key of the newest image checkpoint of ``stream_id`` (``ms:ckpt:{id}``)."""
    return f"{prefix}ckpt:{stream_id}"


def redis_client(url: str, *, connect_timeout_s: float = 2.0, timeout_s: float | None = 5.0) -> Any:
    """An asyncio Redis client for ``url`` (``redis://``, ``rediss://`` or ``unix://``)."""
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s)


def trim_text(ev: TextEvent, tokens: int, chars: int) -> TextEvent | None:
    """The part of a regenerated event that comes after ``tokens`` tokens / ``chars`` characters
    (a model without ``resume_tokens`` makes the logged part again; readers already have it)."""
    end_tokens = ev.index + len(ev.token_ids)
    offset = ev.offset if ev.offset is not None else 0
    end_chars = offset + len(ev.delta)
    if end_tokens <= tokens and end_chars <= chars and not ev.is_final:
        return None
    delta = ev.delta[max(0, chars - offset):] if offset < chars else ev.delta
    ids = list(ev.token_ids[max(0, tokens - ev.index):]) if ev.index < tokens else list(ev.token_ids)
    return dataclasses.replace(ev, delta=delta, token_ids=ids, index=max(ev.index, tokens), offset=max(offset, chars))


def start_from_checkpoint(start: Callable[..., T], kwargs: dict[str, Any], checkpoint: bytes | None,
                          stream_id: str | None) -> tuple[T, bool]:
    """``start(**kwargs, resume_from=checkpoint)``, or ``start(**kwargs)`` (step 0, same seed) when
    there is no checkpoint or the model refuses it (another model version, a corrupt value).
    Returns the stream and whether it resumed from the checkpoint."""
    if checkpoint is not None:
        try:
            return start(**kwargs, resume_from=checkpoint), True
        except Exception as exc:  # noqa: BLE001 - the refusal is the model's; the run starts over instead
            logger.warning("stream %s: its image checkpoint is unusable (%s); denoising from step 0", stream_id, exc)
    return start(**kwargs), False
