"""multistream as a Ray Serve application: one HTTP ingress, one deployment per model kind.

- ``ingress`` (FastAPI, the same app as ``multistream serve``: native SSE and WebSocket routes,
  resume, OpenAI routes, metrics): admission, quotas, content filter and the event log run here;
  its models are proxies (`RemoteModel`) that stream from the model deployments through
  deployment handles (``handle.options(stream=True)``).
- ``text`` and ``image``: each replica loads its model once and runs its engine (continuous
  batching inside the replica); ``num_replicas`` or an autoscaling config per kind.

Failover: when a model replica dies mid-stream (a crash, a lost node, ``ray.kill``), the ingress
resubmits the request to a live replica and continues from what it already sent: for text the
prompt plus the tokens already emitted are prefilled (``TextModel.replica_stream(resume_tokens=...)``; a
model without it regenerates and the replica skips what was sent, exact for greedy and seeded
sampling since draws depend only on (seed, position)). For images, with ``event_log`` the image
replica writes the stream's newest `ImageCheckpoint` to Redis every ``image_checkpoint_every``
steps (`checkpoint_key`: ``ms:ckpt:{stream id}``, deleted when the stream ends); the replica
taking over continues from it (``ImageModel.stream(resume_from=...)``, the final event's
``metrics["resumed_from_step"]``) and ends with the uninterrupted run's picture (bit for bit on
the same device when steps are not batched with other requests, ``max_batch=1``; within float
rounding when they are); with no usable checkpoint it denoises from step 0 with the same seed
(fixed by the ingress). Previews up to the last step sent are skipped. The client sees one
stream: no duplicate, nothing out of order, no text or final missing (a preview that a newer one
replaced while the client was away is skipped, as on one server). With several
ingress replicas, ``event_log`` (Redis) makes a resume work on any of them.

Edits (finish, steer, rewind) reach the replica generating the stream through the event log's
control channel (``ms:ctl:replica:{name}``; `RemoteModel.forward_edit`), so they need
``event_log``; a cancel cancels the replica's streaming call. The text replica reports each
edit as it takes effect (a ``{"edit": ...}`` item in its handle stream, before the events after
it); after a failover the new replica gets the instruction tokens still in the context
(``TextModel.replica_stream(resume_inserted=...)``), so the answer goes on as the uninterrupted steered
one would, and ``revision`` numbers and the final ``revisions`` span all replicas. An image
steer travels in the checkpoint (its conditioning). A rewind's new sampling options are not
carried over.

Example:
    $ multistream serve --ray --text-replicas 2 --image-replicas 0 --event-log redis://127.0.0.1:6379/0
    >>> from multistream.server.ray import build_app                       # doctest: +SKIP
    >>> serve.run(build_app(ServerSettings(event_log="redis://..."), text_replicas=2), route_prefix="/")  # doctest: +SKIP
"""


from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from ..durable.resume import checkpoint_key
from ..families import FAMILIES, family
from ..settings import ServerSettings
from ._common import APP_NAME
from ._handle import RemoteModel
from ._ingress import Ingress
from ._replica import ModelReplica

__all__ = ["APP_NAME", "Ingress", "ModelReplica", "RemoteModel", "app_builder", "build_app", "checkpoint_key", "serve_ray"]

logger = logging.getLogger("multistream.server")


def build_app(settings: ServerSettings, *, text_model: Any = "default", image_model: Any = "default",
              text_replicas: int | dict[str, Any] = 1, image_replicas: int | dict[str, Any] = 1,
              ingress_replicas: int = 1, text_actor_options: dict[str, Any] | None = None,
              image_actor_options: dict[str, Any] | None = None, image_checkpoint_every: int = 1) -> Any:
    """The Serve application: ``ingress`` bound to the ``text`` and ``image`` deployments.

    ``*_replicas``: a count (0: that model is not served) or an autoscaling config
    (``{"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 8}``).
    ``*_actor_options``: Ray resources per replica, e.g. ``{"num_gpus": 1}`` (default ``num_cpus=1``).
    ``image_checkpoint_every``: with ``event_log``, image replicas write a stream's checkpoint to
    Redis every this many denoising steps (a failover continues from the newest one).
    """
    from ray import serve

    if isinstance(image_checkpoint_every, bool) or not isinstance(image_checkpoint_every, int) or image_checkpoint_every < 1:
        from ...errors import InvalidArgumentError

        raise InvalidArgumentError(f"image_checkpoint_every must be an integer >= 1, got {image_checkpoint_every!r}")

    def model_deployment(kind: str, spec: Any, replicas: int | dict[str, Any], options: dict[str, Any] | None) -> Any:
        if spec is None or replicas == 0:
            return None
        scale: dict[str, Any] = ({"autoscaling_config": replicas} if isinstance(replicas, dict)
                                 else {"num_replicas": int(replicas)})
        dep = serve.deployment(ModelReplica).options(
            name=kind, ray_actor_options=options or {"num_cpus": 1}, max_ongoing_requests=64,
            health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5, **scale)
        return dep.bind(kind, spec, settings.event_log, image_checkpoint_every if family(kind).checkpoints else 1)

    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress", num_replicas=ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=settings.max_connections)
    return ingress.bind(settings, model_deployment("text", text_model, text_replicas, text_actor_options),
                        model_deployment("image", image_model, image_replicas, image_actor_options))


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files and KubeRay's RayService (``import_path: multistream.server.ray:app_builder``).

    ``args``: ``text_model``, ``image_model`` (``"none"`` to skip), ``text_replicas``,
    ``image_replicas``, ``ingress_replicas``, ``text_actor_options``, ``image_actor_options``,
    ``image_checkpoint_every``;
    every other key is a `ServerSettings` field (``event_log: redis://...``), after
    ``MULTISTREAM_*`` environment variables.
    """
    args = dict(args or {})
    own = {k: args.pop(k) for k in ("text_model", "image_model", "text_replicas", "image_replicas",
                                    "ingress_replicas", "text_actor_options", "image_actor_options",
                                    "image_checkpoint_every") if k in args}
    for kind in (f"{f.name}_model" for f in FAMILIES if f.on_ray):
        if str(own.get(kind, "default")).lower() in ("none", "off", ""):
            own[kind] = None
    return build_app(ServerSettings.from_env(**args), **own)


def serve_ray(settings: ServerSettings, *, text_model: Any = "default", image_model: Any = "default",
              text_replicas: int = 1, image_replicas: int = 1, ingress_replicas: int = 1, autoscale: bool = False,
              host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
              image_checkpoint_every: int = 1) -> int:
    """``multistream serve --ray``: run the application on a local or existing Ray cluster until SIGINT/SIGTERM."""
    import httpx
    import ray
    from ray import serve

    if ingress_replicas > 1 and not settings.event_log:
        logger.warning("several ingress replicas without --event-log: a resume works only on the replica that "
                       "runs the stream; use --event-log redis://...")
    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})

    def count(n: int) -> int | dict[str, Any]:
        return {"min_replicas": 1, "max_replicas": n, "target_ongoing_requests": 8} if autoscale and n > 1 else n

    serve.run(build_app(settings, text_model=text_model, image_model=image_model, text_replicas=count(text_replicas),
                        image_replicas=count(image_replicas), ingress_replicas=ingress_replicas,
                        image_checkpoint_every=image_checkpoint_every),
              name=APP_NAME, route_prefix="/", blocking=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = f"http://{host}:{port}/readyz"
    announced = False
    while not stop.wait(1.0):
        if not announced:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    print(f"multistream on Ray Serve: ready at http://{host}:{port}", flush=True)
                    announced = True
            except httpx.HTTPError:
                pass
    serve.delete(APP_NAME)
    serve.shutdown()
    return 0
