"""The Ray application's HTTP ingress: the same FastAPI app as ``multistream serve``, its models
remote handles on the model deployments."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

from ...engine import DEFAULT_CAPACITY
from ..families import FAMILIES
from ..settings import ServerSettings
from ._common import APP_NAME, MODEL_WAIT_S
from ._handle import RemoteModel

logger = logging.getLogger("multistream.server")


def _wait_healthy(kind: str, timeout: float = 900.0) -> None:
    """Block until the deployment ``kind`` runs all its target replicas (for /readyz)."""
    from ray import serve

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            app = serve.status().applications.get(APP_NAME)
            dep = app.deployments.get(kind) if app is not None else None
            if dep is not None and str(getattr(dep.status, "value", dep.status)) == "HEALTHY":
                return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the {kind} deployment did not become healthy")


def replica_count(kind: str) -> int:
    from ray import serve

    try:
        dep = serve.status().applications[APP_NAME].deployments[kind]
        return int(dep.replica_states.get("RUNNING", 1))
    except Exception:  # noqa: BLE001
        return 1


class Ingress:
    """The HTTP ingress: ``create_app`` with `RemoteModel` proxies for the model deployments.

    The constructor is async and waits (up to ``MODEL_WAIT_S``) for every model deployment to run
    its target replicas: Serve routes traffic to an ingress replica only once its constructor has
    returned, so every ingress replica that answers already has its models (with two ingress
    replicas, one answering ``/readyz`` 200 must not leave the other answering 503). A deployment
    that is not up in time is resolved in the background instead, and ``/readyz`` says so.
    """

    async def __init__(self, settings: ServerSettings, text: Any = None, image: Any = None) -> None:
        self.settings = settings
        self.handles = {"text": text, "image": image}
        self.remote: dict[str, RemoteModel] = {}
        self.models: dict[str, Any] = {}
        for kind in (f.name for f in FAMILIES if f.on_ray):
            if self.handles[kind] is None:
                self.models[kind] = None
                continue
            try:
                self.models[kind] = await asyncio.wait_for(asyncio.to_thread(self._resolve, kind), MODEL_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - keep starting; the slot loads in the background
                logger.warning("the %s deployment is not up yet (%s); the ingress starts and keeps waiting",
                               kind, type(exc).__name__)
                self.models[kind] = functools.partial(self._resolve, kind)

    def _resolve(self, kind: str) -> RemoteModel:
        """Wait for the ``kind`` deployment's replicas, then build its proxy (blocking: a worker thread)."""
        handle = self.handles[kind]
        _wait_healthy(kind)
        info = handle.info.remote().result(timeout_s=60)
        model = RemoteModel(kind, handle, info.get("name", kind), self.settings.event_log)
        # The ingress admits what all replicas together take (engine capacity x replicas).
        model.capacity = int(info.get("capacity") or DEFAULT_CAPACITY) * max(1, replica_count(kind))
        self.remote[kind] = model
        return model

    def __serve_build_asgi_app__(self) -> Any:
        from ..app import create_app

        app = create_app(text_model=self.models["text"], image_model=self.models["image"], settings=self.settings)
        if self.settings.enable_test_hooks:
            async def replica_of(stream_id: str) -> Any:
                from starlette.responses import JSONResponse

                for model in self.remote.values():
                    if stream_id in model.replica_of:
                        return JSONResponse({"replica": model.replica_of[stream_id], "pid": os.getpid(),
                                             "replica_pid": model.replica_pid.get(stream_id)})
                return JSONResponse({"replica": None, "pid": os.getpid()}, status_code=404)

            app.add_api_route("/v1/_test/replica/{stream_id}", replica_of, methods=["GET"], include_in_schema=False)
        return app
