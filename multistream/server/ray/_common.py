"""What the Ray application's parts share: names, key prefixes, limits and the errors worth a retry."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...events import TextEvent

logger = logging.getLogger("multistream.server")

APP_NAME = "multistream"
PREFIX = "ms:"  # the event log's key prefix (`RedisEventLog`)
MAX_FAILOVERS = 8
FAILOVER_WINDOW_S = 60.0
MODEL_WAIT_S = 600.0  # how long an ingress replica waits for its model deployments before it starts



def checkpoint_key(stream_id: str) -> str:
    """The Redis key of the newest image checkpoint of ``stream_id`` (``ms:ckpt:{id}``)."""
    return f"{PREFIX}ckpt:{stream_id}"


def retryable_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, ReplicaUnavailableError, DeploymentUnavailableError)


def trim_text(ev: TextEvent, tokens: int, chars: int) -> TextEvent | None:
    """The part of a regenerated event that comes after ``tokens`` tokens / ``chars`` characters."""
    end_tokens = ev.index + len(ev.token_ids)
    offset = ev.offset if ev.offset is not None else 0
    end_chars = offset + len(ev.delta)
    if end_tokens <= tokens and end_chars <= chars and not ev.is_final:
        return None
    delta = ev.delta[max(0, chars - offset):] if offset < chars else ev.delta
    ids = list(ev.token_ids[max(0, tokens - ev.index):]) if ev.index < tokens else list(ev.token_ids)
    return dataclasses.replace(ev, delta=delta, token_ids=ids, index=max(ev.index, tokens), offset=max(offset, chars))
