"""A video stream whose server is killed, with a shared event log: it is not continued (the video
engine keeps no checkpoint to resume a clip from, so the video family is not ``continues``), and a
client resuming it from another server gets what was logged, then one server-written final that
says why, with no gap and no duplicate. Real ``multistream serve`` subprocesses on a real
``redis-server``."""

from __future__ import annotations

import signal

import httpx
from redis_fixtures import free_port, needs_redis, redis_server
from server_fixtures import iter_events, serve_subprocess

from multistream.server.families import family
from multistream.testing import ScriptedVideoModel

pytestmark = needs_redis


def slow_video_model() -> ScriptedVideoModel:
    """Factory for the subprocess servers: 400 steps, 50 ms apart (20 s in all)."""
    return ScriptedVideoModel(steps=400, num_frames=4, size=16, delay_s=0.05)


def _serve(redis_url: str, port: int):  # type: ignore[no-untyped-def]
    return serve_subprocess(port, "--video-model", "test_video_restart:slow_video_model", "--text-model", "none",
                            "--image-model", "none", "--speech-model", "none", "--event-log", redis_url, wait_s=60)


def test_a_killed_servers_video_stream_ends_for_its_reader_with_a_server_final() -> None:
    assert not family("video").continues and not family("video").checkpoints
    with redis_server() as redis:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(redis.url, port)
        try:
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", f"{url}/v1/video", json={"prompt": "a red circle moving right",
                                                                     "preview_format": "sheet"}) as r:
                    sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                    first = []
                    for ev in iter_events(r):
                        first.append(ev)
                        if len(first) == 3:
                            break
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                proc = _serve(redis.url, port)
                with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                                   headers={"Last-Event-ID": str(first[-1]["seq"]), "X-Resume-Token": token}) as r:
                    assert r.status_code == 200
                    rest = list(iter_events(r))
        finally:
            proc.terminate()
            proc.wait(30)
    events = first + rest
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(len(events)))  # no gap, no duplicate
    final = events[-1]
    assert final["is_final"] and final["type"] == "error" and "went away" in final["error"]["message"]
    assert all(e["type"] == "video" and not e["is_final"] for e in events[:-1])
    assert max(e["step"] for e in events[:-1]) < 400  # it was not run to the end anywhere
