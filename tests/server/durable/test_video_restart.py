"""A video stream whose server is killed, with a shared event log, is continued by the next server
from the clip's newest checkpoint (as an image is): a client resuming it gets the rest with no gap
and no duplicate, and the final clip has the uninterrupted run's frames. Real ``multistream serve``
subprocesses on a real ``redis-server``, the embedded video model."""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import numpy as np
import pytest

import multistream as ms
from multistream.server.families import family

from redis_fixtures import free_port, needs_redis, redis_server
from server_fixtures import iter_events, serve_subprocess, wait_until

pytestmark = needs_redis

STEPS = 12
BODY = {"prompt": "a red circle moving right on a blue background", "steps": STEPS, "seed": 4, "preview": "x0"}


def restart_video_model() -> Any:
    """Factory for the subprocess servers: the embedded video model, each denoiser call held 0.1 s
    longer (so a kill lands mid-run however fast the machine)."""
    model = ms.load_video_model()
    model.pipeline.unet.register_forward_hook(lambda *args: time.sleep(0.1))
    return model


def _serve(redis_url: str, port: int):  # type: ignore[no-untyped-def]
    return serve_subprocess(port, "--video-model", "test_video_restart:restart_video_model", "--text-model", "none",
                            "--image-model", "none", "--speech-model", "none", "--event-log", redis_url, wait_s=120)


def _frames(event: dict[str, Any]) -> np.ndarray:
    ev = ms.event_from_dict(event)
    return np.stack([np.asarray(f) for f in ev.frames])  # type: ignore[attr-defined]


def _exists(url: str, key: str) -> bool:
    import asyncio

    import redis.asyncio as aioredis

    async def read() -> bool:
        client = aioredis.from_url(url)
        try:
            return bool(await client.exists(key))
        finally:
            await client.aclose()

    return asyncio.run(read())


@pytest.mark.model
def test_a_killed_servers_video_stream_continues_from_its_checkpoint() -> None:
    assert family("video").continues and family("video").checkpoints
    with redis_server() as redis:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(redis.url, port)
        try:
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", f"{url}/v1/video", json=BODY) as r:
                    assert r.status_code == 200, r.read()
                    sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                    first = []
                    for ev in iter_events(r):
                        first.append(ev)
                        if len(first) == 3:
                            break
                assert not first[-1]["is_final"] and first[-1]["step"] < STEPS
                wait_until(lambda: _exists(redis.url, f"ms:ckpt:{sid}"), what="a checkpoint in Redis")
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                proc = _serve(redis.url, port)
                with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                                   headers={"Last-Event-ID": str(first[-1]["seq"]), "X-Resume-Token": token}) as r:
                    assert r.status_code == 200
                    rest = list(iter_events(r))
                events = first + rest
                assert [e["seq"] for e in events] == list(range(len(events)))  # no gap, no duplicate
                steps = [e["step"] for e in events[:-1]]
                assert steps == sorted(set(steps))  # no preview twice
                final = events[-1]
                assert final["type"] == "video" and final["is_final"] and final["finish_reason"] == "stop"
                assert final["step"] == STEPS and final["metrics"]["resumed_from_step"] >= 1
                assert not _exists(redis.url, f"ms:ckpt:{sid}")  # ended: its checkpoint goes with it
                with client.stream("POST", f"{url}/v1/video", json=BODY) as r:
                    whole = list(iter_events(r))
                assert "resumed_from_step" not in whole[-1]["metrics"] and whole[-1]["metrics"]["checkpoint_writes"] >= 1
                assert np.array_equal(_frames(final), _frames(whole[-1]))  # the uninterrupted run's clip
        finally:
            proc.terminate()
            proc.wait(30)
