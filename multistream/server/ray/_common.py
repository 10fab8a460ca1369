"""What the Ray application's parts share: names, key prefixes, limits and the errors worth a retry."""

from __future__ import annotations

import logging

logger = logging.getLogger("multistream.server")

APP_NAME = "multistream"
PREFIX = "ms:"  # the event log's key prefix (`RedisEventLog`)
MAX_FAILOVERS = 8
FAILOVER_WINDOW_S = 60.0
MODEL_WAIT_S = 600.0  # how long an ingress replica waits for its model deployments before it starts
CHECKPOINT_TTL_S = 600  # an image checkpoint outlives its last write by this much (a stream not ended cleanly)



def checkpoint_key(stream_id: str) -> str:
    """The Redis key of the newest image checkpoint of ``stream_id`` (``ms:ckpt:{id}``)."""
    return f"{PREFIX}ckpt:{stream_id}"


def retryable_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, ReplicaUnavailableError, DeploymentUnavailableError)
