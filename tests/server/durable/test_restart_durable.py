"""Durable generations, the rest of a restart (issue 27): real ``multistream serve`` subprocesses on
a real ``redis-server``.

- An image generation whose server is killed (-9) continues on the restarted server from its last
  checkpoint in Redis; the client resuming with ``Last-Event-ID`` gets the remaining previews and
  the final, and the final PNG is byte for byte the uninterrupted run's (the embedded model, fp32
  on a CPU, one request at a time: deterministic).
- SIGTERM (a redeploy) with a Redis log hands the streams still running at the drain deadline off
  to the next server instead of ending them: the connected client's stream ends without a final,
  it resumes on the new server, and the text equals an uninterrupted run's, with no gap or
  duplicate; a hand-off is not counted as a restart.
- With the in-memory log, SIGTERM still ends them (``finish_reason="cancelled"``).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from typing import Any

import httpx
import pytest

from redis_fixtures import free_port, needs_redis, redis_server
from server_fixtures import (
    SPEECH_AND_VIDEO_OFF,
    ScriptedTextModel,
    iter_events,
    make_server,
    serve_subprocess,
    wait_until,
)

WORDS = [f" w{i}" for i in range(50)]
PROMPT = "a red circle on a blue background"
STEPS = 12


def handoff_text_model() -> ScriptedTextModel:
    """Factory for the subprocess servers: 50 tokens, 60 ms apart (3 s in all)."""
    return ScriptedTextModel(WORDS, delay_s=0.06)


def restart_image_model() -> Any:
    """Factory for the subprocess servers: the embedded image model, each denoiser call held 0.1 s
    longer (so a kill lands mid-run however fast the machine)."""
    import multistream as ms

    model = ms.load_image_model(device="cpu")
    model.pipeline.unet.register_forward_hook(lambda *args: time.sleep(0.1))
    return model


def _serve(port: int, *args: str, wait_s: float = 120) -> subprocess.Popen[bytes]:
    return serve_subprocess(port, *args, wait_s=wait_s)


def _rest(client: httpx.Client, url: str, sid: str, token: str, last: int) -> list[dict[str, Any]]:
    with client.stream("GET", f"{url}/v1/streams/{sid}/events",
                       headers={"Last-Event-ID": str(last), "X-Resume-Token": token}) as r:
        assert r.status_code == 200, r.read()
        return list(iter_events(r))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _redis(url: str, command: str, key: str) -> Any:
    """One Redis command's answer, read straight from the server (what the log holds)."""
    import redis.asyncio as aioredis

    async def read() -> Any:
        client = aioredis.from_url(url, decode_responses=True)
        try:
            if command == "hget_restarts":
                return await client.hget(key, "restarts")
            return await getattr(client, command)(key)
        finally:
            await client.aclose()

    return asyncio.run(read())


@needs_redis
@pytest.mark.model
def test_killed_image_generation_continues_from_its_checkpoint() -> None:
    from multistream.image import EMBEDDED_MODEL_DIR

    if not (EMBEDDED_MODEL_DIR / "model_index.json").is_file():
        pytest.skip("the embedded image model is not installed")
    args = ("--text-model", "none", "--image-model", "test_restart_durable:restart_image_model", *SPEECH_AND_VIDEO_OFF)
    body = {"prompt": PROMPT, "steps": STEPS, "seed": 5, "preview": "x0", "preview_format": "png"}
    with redis_server() as redis:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(port, "--event-log", redis.url, *args)
        try:
            with httpx.Client(timeout=60) as client:
                with client.stream("POST", f"{url}/v1/image", json=body) as r:
                    assert r.status_code == 200, r.read()
                    sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                    first = []
                    for ev in iter_events(r):
                        first.append(ev)
                        if len(first) == 4:
                            break
                assert not first[-1]["is_final"] and first[-1]["step"] < STEPS
                # A checkpoint lands in Redis (any step will do) before the kill.
                wait_until(lambda: _redis(redis.url, "exists", f"ms:ckpt:{sid}"), what="a checkpoint in Redis")
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                proc = _serve(port, "--event-log", redis.url, *args)
                rest = _rest(client, url, sid, token, first[-1]["seq"])
                events = first + rest
                seqs = [e["seq"] for e in events]
                assert seqs == sorted(set(seqs)), "a duplicate or out-of-order event"
                # The seqs a resume skips can only be previews a newer one replaced (the log keeps
                # the newest preview per image): what follows such a gap is that newer preview.
                for a, b in zip(events, events[1:]):
                    if b["seq"] != a["seq"] + 1:
                        assert not b["is_final"] and b["step"] > a["step"], (a["seq"], b["seq"])
                steps = [e["step"] for e in events[:-1]]
                assert steps == sorted(set(steps)) and steps[-1] <= STEPS  # no preview twice
                final = events[-1]
                # An error final names what went wrong (it failed once in a loaded full run as an error event).
                assert final["is_final"] and final.get("finish_reason") == "stop" and final["step"] == STEPS, \
                    {k: v for k, v in final.items() if k != "data"}
                assert final["metrics"]["resumed_from_step"] >= 1  # from a checkpoint, not from step 0
                assert all(e["t"] <= f["t"] for e, f in zip(events, events[1:]))
                # The stream has ended in the log, and its checkpoint with it.
                assert _redis(redis.url, "hgetall", f"ms:m:{sid}").get("done") == "1"
                assert not _redis(redis.url, "exists", f"ms:ckpt:{sid}")
                # An uninterrupted run of the same request: the same PNG, byte for byte.
                with client.stream("POST", f"{url}/v1/image", json=body) as r:
                    whole = list(iter_events(r))
                assert whole[-1]["is_final"] and "resumed_from_step" not in whole[-1]["metrics"]
                assert whole[-1]["metrics"]["checkpoint_writes"] >= 1 and whole[-1]["metrics"]["checkpoint_bytes"] > 0
                assert final["data"] == whole[-1]["data"]
        finally:
            _stop(proc)


@needs_redis
def test_sigterm_hands_running_generations_off_to_the_next_server() -> None:
    # At info level (the later flag wins): a failure's captured stderr shows how far the shutdown got
    # (CI once saw this server not exit within 30 s after "handing 1 running streams off", and no more).
    args = ("--text-model", "test_restart_durable:handoff_text_model", "--image-model", "none",
            "--shutdown-deadline", "0.3", *SPEECH_AND_VIDEO_OFF, "--log-level", "info")
    with redis_server() as redis:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _serve(port, "--event-log", redis.url, *args)
        try:
            with httpx.Client(timeout=30) as client:
                with client.stream("POST", f"{url}/v1/text", json={"prompt": "hi", "max_new_tokens": 50}) as r:
                    assert r.status_code == 200
                    sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                    first = []
                    for ev in iter_events(r):
                        first.append(ev)
                        if len(first) == 5:
                            proc.send_signal(signal.SIGTERM)  # a redeploy, with this client still reading
                # The old server let its reader go without a final event, and exited cleanly.
                assert first and not first[-1]["is_final"] and len(first) < len(WORDS)
                assert proc.wait(30) == 0
                meta = _redis(redis.url, "hgetall", f"ms:m:{sid}")
                assert meta.get("done") == "0" and meta.get("handoff") == "1"
                proc = _serve(port, "--event-log", redis.url, *args)
                rest = _rest(client, url, sid, token, first[-1]["seq"])
                events = first + rest
                assert [e["seq"] for e in events] == list(range(len(events)))  # no gap, no duplicate
                assert all(a["t"] <= b["t"] for a, b in zip(events, events[1:]))
                assert events[-1]["is_final"] and events[-1]["finish_reason"] == "length"
                # The uninterrupted run's text (the scripted model is deterministic, as greedy is).
                assert "".join(e["delta"] for e in events) == events[-1]["text"] == "".join(WORDS)
                meta = _redis(redis.url, "hgetall", f"ms:m:{sid}")
                assert meta.get("restarts", "0") == "0" and "handoff" not in meta  # not counted as a crash
        finally:
            _stop(proc)


@needs_redis
@pytest.mark.model
def test_drain_hands_an_image_generation_off_with_its_checkpoint() -> None:
    """A drain (what SIGTERM starts) on server A, with server B already running on the same Redis
    (a rolling deploy): A's reader is let go without a final, B continues the run from the
    checkpoint A flushed, and the final image is the uninterrupted run's (one process here, the
    same model object behind both servers, one run at a time)."""
    import multistream as ms
    from multistream.image import EMBEDDED_MODEL_DIR

    if not (EMBEDDED_MODEL_DIR / "model_index.json").is_file():
        pytest.skip("the embedded image model is not installed")
    model = restart_image_model()
    body = {"prompt": PROMPT, "steps": STEPS, "seed": 7, "preview": "x0", "preview_format": "png"}
    try:
        with redis_server() as redis, make_server(image=model, event_log=redis.url, shutdown_deadline_s=0) as a, \
                make_server(image=model, event_log=redis.url) as b, httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{a.url}/v1/image", json=body) as r:
                assert r.status_code == 200, r.read()
                sid, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
                first = []
                for ev in iter_events(r):
                    first.append(ev)
                    if len(first) == 3:
                        a.state.loop.call_soon_threadsafe(a.state.begin_drain)
            assert first and not first[-1]["is_final"]
            rest = _rest(client, b.url, sid, token, first[-1]["seq"])
            assert sid in b.app.state.continuer.continued
            events = first + rest
            seqs = [e["seq"] for e in events]
            assert seqs == sorted(set(seqs))
            steps = [e["step"] for e in events[:-1]]
            assert steps == sorted(set(steps))
            final = ms.event_from_dict(events[-1])
            assert final.is_final and final.finish_reason == "stop" and final.metrics["resumed_from_step"] >= 1
            assert _redis(redis.url, "hget_restarts", f"ms:m:{sid}") in (None, "0")  # a hand-off is no crash
        whole = model.generate(PROMPT, **{k: v for k, v in body.items() if k != "prompt"})
        assert final.data == whole.data
    finally:
        model.close()


def test_sigterm_with_the_in_memory_log_still_ends_running_streams() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, "--text-model", "test_restart_durable:handoff_text_model", "--image-model", "none",
                  "--shutdown-deadline", "0.3", *SPEECH_AND_VIDEO_OFF)
    try:
        with httpx.stream("POST", f"{url}/v1/text", json={"prompt": "hi", "max_new_tokens": 50}, timeout=30) as r:
            assert r.status_code == 200
            events = []
            for ev in iter_events(r):
                events.append(ev)
                if len(events) == 5:
                    proc.send_signal(signal.SIGTERM)
        assert [e["seq"] for e in events] == list(range(len(events)))
        final = events[-1]
        assert final["is_final"] and final["finish_reason"] == "cancelled"
        assert final["text"] == "".join(e["delta"] for e in events) and len(final["text"]) < len("".join(WORDS))
        assert proc.wait(30) == 0
    finally:
        _stop(proc)


@needs_redis
async def test_a_websocket_client_is_told_of_a_hand_off_and_resumes_on_the_next_server() -> None:
    """SIGTERM's drain on server A with a Redis log, server B on the same log: A's WebSocket client
    gets ``{"type": "handed_off", "after": N, ...}`` instead of silence, sends ``resume`` to B with
    that ``after``, and gets the rest with no gap or duplicate: the whole script's text."""
    import json

    import websockets

    from multistream.server import decode_message

    with redis_server() as redis, \
            make_server(handoff_text_model(), event_log=redis.url, shutdown_deadline_s=0) as a, \
            make_server(handoff_text_model(), event_log=redis.url) as b:
        async with websockets.connect(a.ws_url + "/v1/ws", open_timeout=30) as ws:
            await ws.send(json.dumps({"type": "text", "id": "c1", "prompt": "hi", "max_new_tokens": len(WORDS)}))
            first: list[Any] = []
            handed: dict[str, Any] = {}
            while not handed:
                msg = decode_message(await asyncio.wait_for(ws.recv(), 60))
                if isinstance(msg, dict):
                    if msg["type"] == "handed_off":
                        handed = msg
                    else:
                        assert msg["type"] == "accepted", msg
                        accepted = msg
                    continue
                first.append(msg)
                assert not msg.is_final, "the stream ended on the draining server"
                if len(first) == 5:
                    a.state.loop.call_soon_threadsafe(a.state.begin_drain)
        assert handed["id"] == "c1" and handed["stream_id"] == accepted["stream_id"]
        assert handed["after"] == first[-1].seq and handed["resume_token"] == accepted["resume_token"]
        rest: list[Any] = []
        async with websockets.connect(b.ws_url + "/v1/ws", open_timeout=30) as ws:
            await ws.send(json.dumps({"type": "resume", "stream_id": handed["stream_id"], "after": handed["after"],
                                      "token": handed["resume_token"]}))
            while not (rest and rest[-1].is_final):
                msg = decode_message(await asyncio.wait_for(ws.recv(), 60))
                if not isinstance(msg, dict):
                    rest.append(msg)
        events = first + rest
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[-1].text == "".join(WORDS) == "".join(e.delta for e in events)
