"""What the Ray application's parts share: names, limits and the errors worth a retry (the Redis names and
the resume itself are `durable.resume`'s)."""

from __future__ import annotations

import logging

logger = logging.getLogger("multistream.server")

APP_NAME = "multistream"
MAX_FAILOVERS = 8
FAILOVER_WINDOW_S = 60.0
MODEL_WAIT_S = 600.0  # how long an ingress replica waits for its model deployments before it starts



def waiting_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean no healthy replica is up yet (one is starting: a model loads for seconds
    or minutes): a stream waits for it, up to `MODEL_WAIT_S`, instead of counting a failure."""
    from ray.serve.exceptions import DeploymentUnavailableError

    return (DeploymentUnavailableError,)


def retryable_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, ReplicaUnavailableError, DeploymentUnavailableError)

