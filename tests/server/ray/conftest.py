"""Fixtures of the Ray Serve tests: a real redis-server (the shared event log) and a local Ray
cluster (2 CPUs) serving the default models, two replicas of each deployment, on a loopback port.
Both are started once per module and stopped after it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from redis_fixtures import free_port, redis_server
from repo_paths import suite_path

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def redis() -> Iterator[Any]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(redis: Any) -> Iterator[str]:
    from multistream.server import ServerSettings
    from multistream.server.ray import APP_NAME, build_app

    # The workers import the package and the suite's fixture modules (tests/), as this process does.
    path = suite_path()
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
             _node_ip_address="127.0.0.1")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServerSettings(event_log=redis.url, enable_test_hooks=True)
        # The default model (int4 on the native kernels): the failover test compares with an
        # uninterrupted in-process run, which one arithmetic for decode and re-prefill makes exact.
        serve.run(build_app(settings, text_model="default", image_model="default", text_replicas=2,
                            image_replicas=2, ingress_replicas=2, text_actor_options={"num_cpus": 0.5},
                            image_actor_options={"num_cpus": 0.5}),
                  name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        status = None
        while time.monotonic() < deadline:
            try:
                status = httpx.get(f"{url}/readyz", timeout=2).status_code
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert status == 200, "/readyz did not answer 200 once every replica was up"
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
