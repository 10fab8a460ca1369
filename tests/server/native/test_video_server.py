"""The video family on a real uvicorn: native ``POST /v1/video`` (SSE, resume, WebSocket binary
frames, cancel, steer, finish) and OpenAI's Videos API through the official SDK
(``client.videos.create_and_poll``, ``retrieve``, ``download_content`` for each variant, list,
delete; the 400 for a size the model cannot make). The scripted video model keeps these fast."""

from __future__ import annotations

import asyncio
import io
import json
import math
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import websockets
from PIL import Image

from multistream import VideoEvent, event_from_dict
from multistream.errors import InvalidArgumentError
from multistream.server import ServerSettings, create_app, decode_message
from multistream.server.families import family
from multistream.testing import ScriptedTextModel, ScriptedVideoModel

from server_fixtures import iter_events, iter_sse, live_server, wait_until


def _server(video: Any, **settings: Any) -> Any:
    return live_server(create_app(ScriptedTextModel(["hi"]), video_model=video, settings=ServerSettings(**settings)))


@pytest.fixture(scope="module")
def srv():  # type: ignore[no-untyped-def]
    with _server(ScriptedVideoModel(steps=4, num_frames=6, size=32, name="scripted-video")) as s:
        yield s


@pytest.fixture(scope="module")
def slow():  # type: ignore[no-untyped-def]
    # Long enough that a cancel, steer or finish sent after the first event lands mid-run.
    with _server(ScriptedVideoModel(steps=200, num_frames=4, size=32, delay_s=0.05)) as s:
        yield s


def _sdk(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


# -- native ------------------------------------------------------------------------------------------


def test_post_video_streams_every_frame_per_step_then_the_clip(srv: Any) -> None:
    with httpx.stream("POST", srv.url + "/v1/video", json={"prompt": "a red circle moving right on a blue background",
                                                           "preview_format": "sheet", "seed": 1}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-stream-id"] and r.headers["x-resume-token"]
        events = [event_from_dict(d) for d in iter_events(r)]
    assert [e.seq for e in events] == list(range(len(events))) and all(isinstance(e, VideoEvent) for e in events)
    previews, final = events[:-1], events[-1]
    # A reader slower than the model gets the newest preview only (never a backlog): steps may be skipped.
    steps = [e.step for e in previews]
    assert steps and steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] <= 4
    assert all(e.mime == "image/jpeg" and e.total_steps == 4 and len(e.frames) == 6 for e in previews)  # every frame
    assert final.is_final and final.finish_reason == "stop" and final.mime == "video/webm"
    assert len(final.frames) == 6 and final.frames[0].size == (32, 32)


def test_a_bad_native_body_is_a_400_with_the_models_message(srv: Any) -> None:
    r = httpx.post(srv.url + "/v1/video", json={"prompt": "p", "preview": "blurry"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_argument" and "preview" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/video", json={"prompt": "p", "num_frames": 100_000})
    assert r.status_code == 400 and "max_video_frames" in r.json()["error"]["message"]


def test_sse_resume_after_a_dropped_connection(srv: Any) -> None:
    with httpx.stream("POST", srv.url + "/v1/video", json={"prompt": "a green square moving up"}, timeout=60) as r:
        stream_id, token = r.headers["x-stream-id"], r.headers["x-resume-token"]
        first = []
        for d in iter_events(r):
            if "seq" not in d:
                continue  # a queued notice ({"position", "queued"}) while an earlier test's clip finishes
            first.append(d)
            if len(first) == 2:
                break  # the client goes away mid-stream
    with httpx.stream("GET", f"{srv.url}/v1/streams/{stream_id}/events", timeout=60,
                      headers={"Last-Event-ID": str(first[-1]["seq"]), "X-Resume-Token": token}) as r:
        assert r.status_code == 200
        rest = list(iter_events(r))
    seqs = [d["seq"] for d in first + rest]
    assert seqs == list(range(len(seqs))) and rest[-1]["is_final"] and rest[-1]["mime"] == "video/webm"


async def test_websocket_sends_video_events_as_binary_frames(srv: Any) -> None:
    async with websockets.connect(srv.ws_url + "/v1/ws", open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "video", "id": "v", "prompt": "a blue circle moving down",
                                  "preview_format": "webp"}))
        events: list[VideoEvent] = []
        while not (events and events[-1].is_final):
            raw = await asyncio.wait_for(ws.recv(), 60)
            msg = decode_message(raw)
            if isinstance(msg, dict):
                assert msg["type"] == "accepted", msg
                continue
            assert isinstance(raw, bytes) and isinstance(msg, VideoEvent)  # no base64
            events.append(msg)
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].mime == "image/webp" and len(events[0].frames) == 6
    assert events[-1].mime == "video/webm" and len(events[-1].frames) == 6


def _start(srv: Any, body: dict[str, Any]) -> tuple[httpx.Response, Any, str, str]:
    client = httpx.Client(timeout=60)
    request = client.build_request("POST", srv.url + "/v1/video", json=body)
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return response, iter_events(response), response.headers["x-stream-id"], response.headers["x-resume-token"]


@pytest.mark.parametrize("edit, reason, mime", [("cancel", "cancelled", "image/webp"),
                                               ("finish", "finished_early", "video/webm")])
def test_cancel_and_finish_end_a_running_clip(slow: Any, edit: str, reason: str, mime: str) -> None:
    response, events, stream_id, token = _start(slow, {"prompt": "a red circle moving left"})
    try:
        first = next(events)
        assert first["step"] == 1
        headers = {"X-Resume-Token": token}
        if edit == "cancel":
            r = httpx.delete(f"{slow.url}/v1/streams/{stream_id}", headers=headers)
            assert r.json()["cancelled"] is True
        else:
            r = httpx.post(f"{slow.url}/v1/streams/{stream_id}/finish", headers=headers)
            assert r.json() == {"stream_id": stream_id, "command": "finish", "accepted": True}
        final = [d for d in events][-1]
    finally:
        response.close()
    assert final["is_final"] and final["finish_reason"] == reason and final["step"] < 200
    # Cancelled: the newest preview (every frame so far); finished early: the clip, fully decoded.
    assert final["mime"] == mime


def test_steer_changes_the_prompt_from_the_next_step(slow: Any) -> None:
    response, events, stream_id, token = _start(slow, {"prompt": "a red circle moving left on a blue background",
                                                       "steps": 30, "preview_format": "sheet"})
    try:
        next(events)
        r = httpx.post(f"{slow.url}/v1/streams/{stream_id}/steer", headers={"X-Resume-Token": token},
                       json={"prompt": "a yellow circle moving left on a blue background"})
        assert r.status_code == 200 and r.json()["command"] == "steer"
        final = event_from_dict([d for d in events][-1])
    finally:
        response.close()
    assert final.finish_reason == "stop" and final.metrics is not None and final.metrics["steers"] == 1.0
    rgb = np.asarray(final.frames[len(final.frames) // 2].convert("RGB"), dtype=np.int16).reshape(-1, 3)
    yellow = (rgb[:, 0] > 180) & (rgb[:, 1] > 160) & (rgb[:, 2] < 110)
    red = (rgb[:, 0] > 160) & (rgb[:, 1] < 90)
    assert yellow.mean() > 0.05 and red.mean() < 0.01  # the steered shape, not the first one


# -- OpenAI's Videos API -----------------------------------------------------------------------------


def test_sdk_create_and_poll_retrieve_and_download_each_variant(srv: Any) -> None:
    client = _sdk(srv)
    video = client.videos.create_and_poll(prompt="a red circle moving right on a blue background", seconds="1",
                                          size="32x32")
    assert (video.status, video.progress, video.object) == ("completed", 100, "video")
    assert (video.size, video.seconds, video.model) == ("32x32", "1", "scripted-video")
    assert video.completed_at is not None and video.expires_at is not None and video.error is None
    assert client.videos.retrieve(video.id).status == "completed"

    clip = client.videos.download_content(video.id)  # the default variant: the clip
    assert clip.response.headers["content-type"] == "video/mp4"  # OpenAI's format
    frames = VideoEvent(stream_id="x", seq=0, t=0, step=1, total_steps=1, num_frames=8, fps=8, width=32, height=32,
                        mime="video/mp4", data=clip.content).frames
    assert len(frames) == 8  # seconds=1 at the model's 8 fps

    thumb = client.videos.download_content(video.id, variant="thumbnail")
    assert thumb.response.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(thumb.content)).size == (32, 32)
    sheet = client.videos.download_content(video.id, variant="spritesheet")
    assert sheet.response.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(sheet.content)).size == (3 * 32, 3 * 32)  # 8 frames, 3 per row


def test_the_create_answers_at_once_and_the_poll_header_is_set(srv: Any) -> None:
    client = _sdk(srv)
    raw = client.videos.with_raw_response.create(prompt="a green circle moving up")
    created = raw.parse()
    assert created.status in ("queued", "in_progress", "completed") and created.id.startswith("video_")
    assert 100 <= int(raw.headers["openai-poll-after-ms"]) <= 2000
    done = client.videos.poll(created.id)
    assert done.status == "completed" and done.seconds == "0.75"  # the model's own 6 frames at 8 fps
    page = client.videos.list(limit=100)
    assert created.id in [v.id for v in page.data]
    deleted = client.videos.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(created.id)


def test_a_size_the_model_cannot_make_is_a_400_naming_the_sizes_it_can(srv: Any) -> None:
    client = _sdk(srv)
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a red circle", size="720x1280")
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "size"
    assert "'720x1280' is not one this video model makes" in error["message"] and "32x32" in error["message"]


def test_openai_refusals(srv: Any) -> None:
    client = _sdk(srv)
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="p", input_reference=("ref.png", b"\x89PNG", "image/png"))
    assert info.value.body["param"] == "input_reference"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as info:
        client.videos.create(prompt="p", model="veo-3")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    created = client.videos.create(prompt="p", model="sora-2")
    assert created.model == "sora-2"
    with pytest.raises(openai.BadRequestError) as info:  # it was a bare 404 "no route POST /v1/videos/.../remix"
        client.videos.remix(created.id, prompt="p, but blue")
    assert info.value.body["code"] == "unsupported" and "remixing a video is not supported" in info.value.body[  # type: ignore[index]
        "message"]
    with pytest.raises(openai.NotFoundError):
        client.videos.remix("video_nope", prompt="p")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    r = httpx.get(f"{srv.url}/v1/videos/video_nope/content?variant=gif")
    assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"


def test_a_job_is_its_owners_on_a_keyed_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("k-alice name=alice\nk-bob name=bob\n")
    with _server(ScriptedVideoModel(steps=2, num_frames=2, size=16), keys_file=str(keys)) as srv:
        alice = openai.OpenAI(base_url=srv.url + "/v1", api_key="k-alice", max_retries=0)
        bob = openai.OpenAI(base_url=srv.url + "/v1", api_key="k-bob", max_retries=0)
        video = alice.videos.create_and_poll(prompt="a red circle")
        assert alice.videos.retrieve(video.id).status == "completed"
        for call in (lambda: bob.videos.retrieve(video.id), lambda: bob.videos.download_content(video.id),
                     lambda: bob.videos.delete(video.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert [v.id for v in bob.videos.list().data] == [] and [v.id for v in alice.videos.list().data] == [video.id]


def test_json_body_content_before_the_end_and_delete_stops_the_job() -> None:
    vm = ScriptedVideoModel(steps=200, num_frames=4, size=32, delay_s=0.05)
    with _server(vm, video_concurrency=1) as srv:
        r = httpx.post(srv.url + "/v1/videos", json={"prompt": "a red circle moving left", "steps": 100,
                                                     "video_format": "webm"})
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["status"] == "in_progress" and r.headers["x-stream-id"] == job["id"][len("video_"):]
        r = httpx.get(f"{srv.url}/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
        assert "%)" in r.json()["error"]["message"]  # how far it is
        # A second job waits for the one slot: it answers at once, queued.
        waiting = httpx.post(srv.url + "/v1/videos", json={"prompt": "a green square moving up"}).json()
        assert waiting["status"] == "queued" and waiting["progress"] == 0
        gate = srv.state.gates["video"]
        wait_until(lambda: gate.queued == 1, what="the second job to join the queue")
        # Deleting a queued job gives up its place; deleting a running one stops its stream.
        assert httpx.delete(f"{srv.url}/v1/videos/{waiting['id']}").json()["deleted"] is True
        wait_until(lambda: gate.queued == 0, what="the deleted job to leave the queue")
        assert httpx.delete(f"{srv.url}/v1/videos/{job['id']}").json()["deleted"] is True
        wait_until(lambda: vm.finish_reasons == ["cancelled"], what="the deleted job's stream to be cancelled")
        assert len(vm.calls) == 1 and vm.calls[0]["video_format"] == "webm" and vm.calls[0]["steps"] == 100


def test_a_bad_option_is_a_400_also_when_the_job_would_wait_for_a_slot() -> None:
    """A create that would queue answered 200 and its job failed later with the message a free
    slot's create gave as a 400 (``steps=0``, ``seed=-1``, ``video_format="gif"``)."""
    vm = ScriptedVideoModel(steps=200, num_frames=4, size=32, delay_s=0.05)
    with _server(vm, video_concurrency=1) as srv:
        client = _sdk(srv)
        running = client.videos.create(prompt="a red circle moving left")
        assert running.status == "in_progress"
        for extra, message in (({"steps": 0}, "steps must be an integer from 1"),
                               ({"seed": -1}, "seed must be an integer in [0, 2**63)"),
                               ({"video_format": "gif"}, "unknown video_format='gif'")):
            with pytest.raises(openai.BadRequestError) as info:
                client.videos.create(prompt="p", extra_body=extra)
            error = info.value.body
            assert isinstance(error, dict) and error["param"] == next(iter(extra)) and message in error["message"]
        assert srv.state.gates["video"].queued == 0 and len(vm.calls) == 1
        client.videos.delete(running.id)


def test_a_size_the_model_cannot_make_is_a_400_also_when_the_request_would_wait() -> None:
    """The served model's own checks (its sizes, its frame counts) ran only when it started: a
    native request that had to wait answered 200, ``event: queued``, then an error event."""
    vm = ScriptedVideoModel(steps=200, num_frames=4, size=32, delay_s=0.05)
    with _server(vm, video_concurrency=1) as srv:
        with httpx.stream("POST", srv.url + "/v1/video", json={"prompt": "a red circle"}, timeout=60) as running:
            assert running.status_code == 200
            wait_until(lambda: srv.state.gates["video"].would_wait(), what="the one slot to be taken")
            with httpx.stream("POST", srv.url + "/v1/video", json={"prompt": "p", "width": 100}, timeout=10) as r:
                assert r.status_code == 400  # not 200 with `event: queued`
                assert "width=100 is not a multiple of 8" in json.loads(r.read())["error"]["message"]
            assert srv.state.gates["video"].queued == 0 and len(vm.calls) == 1
            httpx.delete(f"{srv.url}/v1/streams/{running.headers['x-stream-id']}",
                         headers={"X-Resume-Token": running.headers["x-resume-token"]})


def test_the_video_familys_model_checks_are_the_models_own() -> None:
    check_model = family("video").check_model
    assert check_model is not None

    class Causal:
        sizes = ScriptedVideoModel(size=32).sizes

        def check_num_frames(self, n: int) -> int:
            if n % 4 != 1:
                raise InvalidArgumentError(f"num_frames={n} does not fit this model's VAE")
            return n

    check_model(Causal(), {"prompt": "p", "num_frames": 9, "width": 64})
    with pytest.raises(InvalidArgumentError, match="num_frames=8 does not fit"):
        check_model(Causal(), {"prompt": "p", "num_frames": 8})
    with pytest.raises(InvalidArgumentError, match="height=1000 is above 128"):
        check_model(Causal(), {"prompt": "p", "height": 1000})


def test_openapi_publishes_both_bodies(srv: Any) -> None:
    doc = httpx.get(srv.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "VideoBody" in schemas and "VideoCreateBody" in schemas
    create = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert set(create) == {"application/json", "multipart/form-data"}
    assert "/v1/video" in doc["paths"] and "/v1/videos/{video_id}/content" in doc["paths"]
    health = httpx.get(srv.url + "/healthz").json()
    assert "video" in health["models"]
    listed = {m.id: m.model_extra for m in _sdk(srv).models.list().data}
    assert listed["scripted-video"]["kind"] == "video" and "sora-2" in listed["scripted-video"]["aliases"]


def test_sse_is_json_per_event(srv: Any) -> None:
    # Every data line is one event's wire JSON, named by its type.
    with httpx.stream("POST", srv.url + "/v1/video", json={"prompt": "p"}, timeout=60) as r:
        frames = [f for f in iter_sse(r) if "comment" not in f]
    assert {f["event"] for f in frames} == {"video"} and [int(f["id"]) for f in frames] == list(range(len(frames)))


# -- a real VideoModel (random Wan 2.1 weights: a causal 3D VAE makes 1 + 4k frames) -----------------


@pytest.fixture(scope="module")
def wan():  # type: ignore[no-untyped-def]
    from multistream.testing._random_video import tiny_wan_pipeline
    from multistream.video import load_video_model

    vm = load_video_model(tiny_wan_pipeline(), name="tiny-wan",
                          defaults={"height": 16, "width": 16, "num_frames": 9, "steps": 3, "fps": 8})
    vm.generate("warm up", preview="latent")  # fits the latent map once (cached per VAE), before any test
    with _server(vm) as s:
        yield s
    vm.close()


def test_a_real_video_model_streams_natively_and_as_an_openai_job(wan: Any) -> None:
    with httpx.stream("POST", wan.url + "/v1/video", json={"prompt": "a cat", "preview": "latent",
                                                           "preview_format": "sheet"}, timeout=120) as r:
        events = [event_from_dict(d) for d in iter_events(r)]
    assert events[-1].is_final and events[-1].mime == "video/webm" and len(events[-1].frames) == 9
    assert all(e.num_frames == 9 and e.mime == "image/jpeg" for e in events[:-1])

    client = _sdk(wan)
    video = client.videos.create_and_poll(prompt="a cat", seconds="1.125", size="32x32")
    assert (video.status, video.size, video.seconds, video.model) == ("completed", "32x32", "1.125", "tiny-wan")
    assert len(VideoEvent(stream_id="x", seq=0, t=0, step=1, total_steps=1, num_frames=9, fps=8, width=32, height=32,
                          mime="video/mp4", data=client.videos.download_content(video.id).content).frames) == 9
    # A size it cannot make is refused, naming the ones it can.
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a cat", size="24x24")
    assert "multiples of 16 from 16 to 32 pixels" in info.value.body["message"]  # type: ignore[index]
    # Whole seconds, as OpenAI's clients send them, are 8 frames at 8 fps, which Wan's causal VAE
    # (1 + 4k frames) cannot make: the clip is the shortest that lasts them, 9 frames.
    video = client.videos.create_and_poll(prompt="a cat", seconds="1", size="32x32")
    assert (video.status, video.seconds) == ("completed", "1")
    clip = client.videos.download_content(video.id).content
    assert len(VideoEvent(stream_id="x", seq=0, t=0, step=1, total_steps=1, num_frames=9, fps=8, width=32, height=32,
                          mime="video/mp4", data=clip).frames) == 9


# -- multistream serve --video-model ------------------------------------------------------------------


def test_video_flags_of_serve() -> None:
    import argparse

    from multistream.cli import serve as serve_cli
    from multistream.server.families import family, installed
    from multistream.video import EMBEDDED_VIDEO_DIR

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--video-model", "none", "--video-concurrency", "2", "--max-video-frames", "64"])
    assert (args.video_model, args.video_concurrency, args.max_video_frames) == ("none", 2, 64)
    assert parser.parse_args(["serve"]).video_model == "auto"
    assert serve_cli.model_spec("video", "none") is None and serve_cli.model_spec("video", "my/pipe") == "my/pipe"
    # 'auto' serves the embedded model exactly when it is installed (its weights folder included).
    assert serve_cli.model_spec("video", "auto") == ("default" if installed(family("video")) else None)
    assert installed(family("video")) == EMBEDDED_VIDEO_DIR.is_dir()


# -- the embedded default model -----------------------------------------------------------------------


@pytest.mark.model
def test_the_embedded_video_model_is_served_by_default_name() -> None:
    from multistream.video import EMBEDDED_VIDEO_DIR

    if not EMBEDDED_VIDEO_DIR.is_dir():
        pytest.skip(f"the embedded video model is not installed ({EMBEDDED_VIDEO_DIR.name}/ is missing)")
    with _server("default") as srv:
        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, timeout=300, what="the video model")
        with httpx.stream("POST", srv.url + "/v1/video", timeout=300, json={
                "prompt": "a red circle moving right on a blue background", "seed": 0, "preview": "latent",
                "preview_format": "sheet"}) as r:
            events = [event_from_dict(d) for d in iter_events(r)]
        final = events[-1]
        assert final.is_final and final.finish_reason == "stop" and final.mime == "video/webm"
        assert len(events) > 2 and all(e.mime == "image/jpeg" for e in events[:-1])
        assert len(final.frames) == final.num_frames >= 16 and final.frames[0].size == (final.width, final.height)

        client = _sdk(srv)
        video = client.videos.create_and_poll(prompt="a blue square moving up on a yellow background", seconds="2")
        assert (video.status, video.progress, video.seconds) == ("completed", 100, "2")
        assert video.size == f"{final.width}x{final.height}"
        sheet = Image.open(io.BytesIO(client.videos.download_content(video.id, variant="spritesheet").content))
        assert sheet.size[0] == final.width * math.ceil(math.sqrt(final.num_frames))  # ceil(sqrt(F)) per row
