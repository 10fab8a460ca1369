"""What the Ray application's parts share: names, limits and the errors worth a retry (the Redis names and
the resume itself are `durable.resume`'s)."""

from __future__ import annotations

import logging

logger = logging.getLogger("multistream.server")

APP_NAME = "multistream"
MAX_FAILOVERS = 8
FAILOVER_WINDOW_S = 60.0
MODEL_WAIT_S = 600.0  # how long an ingress replica waits for its model deployments before it starts



def retryable_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, ReplicaUnavailableError, DeploymentUnavailableError)

