"""OpenAI's Videos API translator without a server: VideoEvents -> the job object the SDK polls
(status, progress, error), the assets it downloads (clip, thumbnail, spritesheet), the job store."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from openai._models import construct_type
from openai.types import Video
from PIL import Image

from multistream.events import ErrorEvent, VideoEvent
from multistream.server.openai.videos.serving import (
    VideoJob,
    VideoJobStore,
    contact_sheet,
    video_id,
)
from multistream.server.problems import Problem

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]


def _clip(num_frames: int = 6, size: int = 32, codec: str = "libvpx-vp9", fmt: str = "webm") -> bytes:
    """A real clip whose frame i is one flat colour, so decoded frames can be told apart."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=8)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            rgb = np.zeros((size, size, 3), np.uint8) + np.array(COLOURS[i % len(COLOURS)], np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def _preview(seq: int, step: int, total: int = 4, eta: float | None = 1.0) -> VideoEvent:
    return VideoEvent(stream_id="s1", seq=seq, t=0.1 * seq, step=step, total_steps=total, num_frames=6, fps=8,
                      width=32, height=32, mime="image/webp", data=b"webp", eta_s=eta)


def _final(seq: int, reason: str = "stop", mime: str = "video/webm", data: bytes | None = None) -> VideoEvent:
    return VideoEvent(stream_id="s1", seq=seq, t=1.0, step=4, total_steps=4, num_frames=6, fps=8, width=32,
                      height=32, mime=mime, data=_clip() if data is None else data, is_final=True,
                      finish_reason=reason, metrics={"duration_ms": 1000.0}, eta_s=0.0)


def _job(**kw: object) -> VideoJob:
    fields = dict(id=video_id("s1"), stream_id="s1", model="shapes-video", prompt="a red circle moving right",
                  size="32x32", seconds="0.75", created_at=1_700_000_000)
    fields.update(kw)
    return VideoJob(**fields)  # type: ignore[arg-type]


def test_a_job_goes_queued_in_progress_completed_with_progress_from_the_steps() -> None:
    job = _job(retention_s=300)
    assert job.to_object()["status"] == "queued" and job.progress == 0
    seen = []
    events = [_preview(0, 1), _preview(1, 2), _preview(2, 4), _final(3)]
    for n in range(1, len(events) + 1):
        job.fold(events[:n], now=1_700_000_010)  # the whole list each time, as a poll hands it over
        seen.append((job.status, job.progress))
    assert seen == [("in_progress", 25), ("in_progress", 50), ("in_progress", 99), ("completed", 100)]
    obj = job.to_object()
    assert obj["completed_at"] == 1_700_000_010 and obj["expires_at"] == 1_700_000_310
    assert obj["error"] is None and obj["object"] == "video" and obj["id"] == "video_s1"


def test_the_object_is_what_the_official_sdk_reads() -> None:
    job = _job().fold([_preview(0, 2)], now=1_700_000_001)
    # The SDK builds its response objects without validating them (construct_type): a size outside
    # OpenAI's four comes through as it is.
    video = construct_type(type_=Video, value=job.to_object())
    assert isinstance(video, Video)
    assert (video.status, video.progress, video.size, video.seconds, video.model) == (
        "in_progress", 50, "32x32", "0.75", "shapes-video")
    # Every other field has the type the SDK declares (checked strictly, with one of OpenAI's sizes).
    Video.model_validate({**job.to_object(), "size": "720x1280"})
    job.fold([_preview(0, 2), _final(1)], now=1_700_000_002)
    assert Video.model_validate({**job.to_object(), "size": "720x1280"}).status == "completed"


def test_an_error_event_fails_the_job_with_its_type_and_message() -> None:
    job = _job().fold([_preview(0, 1), ErrorEvent(stream_id="s1", seq=1, t=0.2, error={
        "type": "RuntimeError", "message": "CUDA out of memory"})], now=5)
    assert job.status == "failed" and job.progress == 25
    assert job.error == {"code": "RuntimeError", "message": "CUDA out of memory"}
    assert construct_type(type_=Video, value=job.to_object()).error.code == "RuntimeError"  # type: ignore[union-attr]
    with pytest.raises(Problem) as info:
        job.content("video")
    assert info.value.status == 409 and "failed (RuntimeError)" in info.value.message


@pytest.mark.parametrize("reason", ["cancelled", "content_filter"])
def test_a_final_that_is_no_finished_clip_fails_the_job(reason: str) -> None:
    # A cancel the model answered (or a server-written final) carries the newest preview, not a clip.
    job = _job().fold([_preview(0, 1), _final(1, reason, mime="image/webp", data=b"webp")], now=5)
    assert job.status == "failed" and job.error is not None and job.error["code"] == reason
    assert job.final is None


def test_finished_early_is_a_completed_clip() -> None:
    job = _job().fold([_preview(0, 1), _final(1, "finished_early")], now=5)
    assert job.status == "completed" and job.content("video").media_type == "video/webm"


def test_content_before_the_end_is_a_409_that_says_how_far_it_is() -> None:
    job = _job().fold([_preview(0, 3)], now=1)
    with pytest.raises(Problem) as info:
        job.content(None)
    assert info.value.status == 409 and "in_progress (75%)" in info.value.message


def test_the_three_variants() -> None:
    clip = _clip()
    job = _job().fold([_final(0, data=clip)], now=1)
    video = job.content(None)
    assert video == job.content("video") and video.data == clip and video.media_type == "video/webm"

    thumb = job.content("thumbnail")
    assert thumb.media_type == "image/webp"
    image = Image.open(io.BytesIO(thumb.data)).convert("RGB")
    assert image.size == (32, 32)
    assert np.abs(np.asarray(image, np.int16)[8:24, 8:24] - COLOURS[0]).mean() < 20  # the first frame

    sheet = job.content("spritesheet")
    assert sheet.media_type == "image/jpeg"
    # The layout of a "sheet" preview, so VideoEvent cuts it back into the clip's frames, in order.
    as_preview = VideoEvent(stream_id="s1", seq=0, t=0, step=1, total_steps=1, num_frames=6, fps=8, width=32,
                            height=32, mime="image/jpeg", data=sheet.data)
    frames = as_preview.frames
    assert Image.open(io.BytesIO(sheet.data)).size == (3 * 32, 2 * 32) and len(frames) == 6
    for frame, colour in zip(frames, COLOURS):
        assert np.abs(np.asarray(frame, np.int16)[8:24, 8:24] - colour).mean() < 20
    assert job.content("spritesheet") is sheet  # made once


def test_an_mp4_clip_gives_the_same_assets() -> None:
    job = _job().fold([_final(0, mime="video/mp4", data=_clip(codec="libx264", fmt="mp4"))], now=1)
    assert job.content("video").media_type == "video/mp4"
    assert Image.open(io.BytesIO(job.content("thumbnail").data)).size == (32, 32)


def test_an_unknown_variant_is_a_400_naming_the_variants() -> None:
    job = _job().fold([_final(0)], now=1)
    with pytest.raises(Problem) as info:
        job.content("gif")
    assert info.value.status == 400 and info.value.param == "variant"
    assert "video, thumbnail, spritesheet" in info.value.message


def test_events_after_the_end_or_seen_twice_change_nothing() -> None:
    job = _job().fold([_preview(0, 2), _final(1)], now=1)
    job.fold([_preview(0, 1), _preview(2, 1), ErrorEvent(stream_id="s1", seq=3, t=2, error={"type": "X",
                                                                                           "message": "late"})], now=9)
    assert (job.status, job.progress, job.completed_at, job.error) == ("completed", 100, 1, None)


def test_poll_after_follows_the_eta_within_bounds() -> None:
    job = _job()
    assert job.poll_after_ms() == 250  # nothing known yet
    assert job.fold([_preview(0, 1, eta=0.05)], now=1).poll_after_ms() == 100
    assert job.fold([_preview(1, 2, eta=1.0)], now=1).poll_after_ms() == 500
    assert job.fold([_preview(2, 3, eta=60.0)], now=1).poll_after_ms() == 2000


def test_the_store_is_bounded_and_expires_ended_jobs() -> None:
    now = [1000.0]
    store = VideoJobStore(max_jobs=3, retention_s=60, clock=lambda: now[0])
    jobs = [store.add(_job(id=f"video_{i}", stream_id=str(i), created_at=i)) for i in range(4)]
    assert store.get("video_0") is None and [j.id for j in store.jobs()] == ["video_1", "video_2", "video_3"]
    jobs[1].fold([_final(0)], now=now[0])  # ends at 1000: kept until 1060
    assert jobs[1].expires_at == 1060
    now[0] = 1059.0
    assert store.get("video_1") is jobs[1]
    now[0] = 1060.0
    assert store.get("video_1") is None and [j.id for j in store.jobs()] == ["video_2", "video_3"]
    assert store.get("video_2") is jobs[2]  # still running: never expires
    assert store.delete("video_2") is jobs[2] and store.get("video_2") is None
    assert store.get(123) is None  # type: ignore[arg-type]


def test_the_page_lists_newest_first_with_a_cursor() -> None:
    store = VideoJobStore(max_jobs=10, retention_s=60)
    for i in range(5):
        store.add(_job(id=f"video_{i}", stream_id=str(i), created_at=i, owner="a" if i % 2 == 0 else "b"))
    page = store.page(limit=2)
    assert [v["id"] for v in page["data"]] == ["video_4", "video_3"] and page["has_more"] is True
    assert (page["first_id"], page["last_id"], page["object"]) == ("video_4", "video_3", "list")
    rest = store.page(after=page["last_id"], limit=10)
    assert [v["id"] for v in rest["data"]] == ["video_2", "video_1", "video_0"] and rest["has_more"] is False
    assert [v["id"] for v in store.page(order="asc", visible=lambda j: j.owner == "a")["data"]] == [
        "video_0", "video_2", "video_4"]
    assert store.page(visible=lambda j: False) == {"object": "list", "data": [], "first_id": None,
                                                    "last_id": None, "has_more": False}
    for bad, param in (({"order": "up"}, "order"), ({"limit": 0}, "limit"), ({"after": "video_9"}, "after")):
        with pytest.raises(Problem) as info:
            store.page(**bad)  # type: ignore[arg-type]
        assert info.value.param == param


def test_contact_sheet_layout() -> None:
    frames = [Image.new("RGB", (10, 6), c) for c in COLOURS[:5]]
    sheet = Image.open(io.BytesIO(contact_sheet(frames)))
    assert sheet.format == "JPEG" and sheet.size == (30, 12)
    with pytest.raises(ValueError, match="at least one frame"):
        contact_sheet([])
