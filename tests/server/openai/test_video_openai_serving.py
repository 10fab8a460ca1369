"""The video family's server pieces without a server: OpenAI's Videos API translator (VideoEvents ->
the job object the SDK polls, the assets it downloads, the job store), the `POST /v1/videos` body
and its mapping onto the model's sizes and frame rate, and the native `/v1/video` body, limits and
server-written final."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from openai._models import construct_type
from openai.types import Video
from PIL import Image
from starlette.datastructures import FormData, UploadFile

from multistream._spec import option_fields
from multistream.errors import InvalidArgumentError
from multistream.events import ErrorEvent, VideoEvent
from multistream.image import ImageSizes
from multistream.server import ServerSettings
from multistream.server.bodies import VideoBody, parse_video_body
from multistream.server.families import family
from multistream.server.http.problems import Problem
from multistream.server.openai.videos.protocol import (
    VIDEO_OPTION_FIELDS,
    VideoCreateBody,
    VideoFormat,
    form_body,
    parse_video_create,
)
from multistream.server.openai.videos.serving import (
    VideoJob,
    VideoJobStore,
    video_id,
)
from multistream.video import VIDEO_STREAM_ARGS, VideoOptions, encode_sheet

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


def test_a_job_is_in_progress_once_admitted_before_its_first_step() -> None:
    job = _job()
    job.admitted()
    assert (job.status, job.progress) == ("in_progress", 0)
    job.fold([_final(0)], now=1).admitted()
    assert job.status == "completed"  # an ended job stays ended


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


def test_the_store_drops_the_oldest_ended_clips_past_its_byte_budget() -> None:
    clip = _clip()
    store = VideoJobStore(max_jobs=10, retention_s=60, max_bytes=2 * len(clip) + 10, clock=lambda: 2.0)
    jobs = [store.add(_job(id=f"video_{i}", stream_id=str(i), created_at=i)) for i in range(4)]
    for job in jobs[:3]:
        job.fold([_final(0, data=clip)], now=1)
    # Three clips do not fit: the oldest ended job goes; the running one stays whatever its age.
    assert [j.id for j in store.jobs()] == ["video_1", "video_2", "video_3"]
    assert jobs[1].nbytes == len(clip) and jobs[3].nbytes == 0
    jobs[1].content("spritesheet")  # its assets count too
    assert [j.id for j in store.jobs()] == ["video_2", "video_3"]


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
    sheet = Image.open(io.BytesIO(encode_sheet(frames)))
    assert sheet.format == "JPEG" and sheet.size == (30, 12)
    with pytest.raises(ValueError, match="at least one frame"):
        encode_sheet([])


# -- POST /v1/videos: the body and its mapping onto the model (protocol.py) --------------------------



FMT = VideoFormat(sizes=ImageSizes(multiple=16, min_side=32, max_side=128, native=(64, 64),
                                   why="trained on 64x64 clips"), num_frames=16, fps=8.0)


def _problem_of(body: dict, fmt: VideoFormat = FMT, *, form: bool = False) -> Problem:
    with pytest.raises(Problem) as info:
        parse_video_create(body, fmt, form=form)
    return info.value


def test_a_bare_prompt_is_the_models_own_clip_as_mp4() -> None:
    req, kwargs = parse_video_create({"prompt": "a red circle moving right"}, FMT)
    assert kwargs == {"prompt": "a red circle moving right", "video_format": "mp4"}
    assert req.priority == 0  # type: ignore[attr-defined]
    assert (FMT.size_of(None, None), FMT.seconds_of(None)) == ("64x64", "2")


def test_size_and_seconds_map_onto_the_model() -> None:
    _, kwargs = parse_video_create({"prompt": "p", "size": "96x64", "seconds": "4"}, FMT)
    assert (kwargs["width"], kwargs["height"], kwargs["num_frames"]) == (96, 64, 32)
    assert FMT.size_of(96, 64) == "96x64" and FMT.seconds_of(32) == "4"
    _, kwargs = parse_video_create({"prompt": "p", "seconds": 2.5, "size": "auto"}, FMT)
    assert kwargs["num_frames"] == 20 and "width" not in kwargs and FMT.seconds_of(20) == "2.5"


def test_seconds_on_a_causal_vae_give_the_shortest_clip_that_lasts_them() -> None:
    """A causal VAE (Wan's, the embedded model's) makes 1 + t*k frames, which whole seconds never
    are at an even frame rate: seconds="2" at 8 fps is 17 frames, and the job says "2" as asked."""
    def odd_counts(n: int) -> int:
        if n % 2 != 1:
            raise InvalidArgumentError(f"num_frames={n} does not fit this model's VAE, which makes 1 + 2*k frames")
        return n

    causal = VideoFormat(sizes=FMT.sizes, num_frames=17, fps=8.0, check_num_frames=odd_counts)
    for seconds, frames in (("2", 17), ("4", 33), (2.5, 21), ("0.25", 3)):
        _, kwargs = parse_video_create({"prompt": "p", "seconds": seconds}, causal)
        assert kwargs["num_frames"] == frames, seconds
        assert causal.seconds_of(frames, seconds) == str(seconds)
    assert causal.seconds_of(17) == "2.125"  # the model's own length, when none was asked for

    def never(n: int) -> int:
        raise InvalidArgumentError("makes no clip of that length")

    problem = _problem_of({"prompt": "p", "seconds": "4"},
                          VideoFormat(sizes=FMT.sizes, num_frames=17, fps=8.0, check_num_frames=never))
    assert problem.status == 400 and problem.param == "seconds" and "pick seconds" in problem.message


def test_a_size_the_model_cannot_make_is_a_400_naming_the_sizes_it_can() -> None:
    problem = _problem_of({"prompt": "p", "size": "720x1280"})
    assert problem.status == 400 and problem.param == "size"
    assert "'720x1280' is not one this video model makes" in problem.message
    assert "multiples of 16 from 32 to 128 pixels" in problem.message and "size='64x64'" in problem.message
    for bad in ("big", "64x", "x64", "６４x64", "64*64"):
        problem = _problem_of({"prompt": "p", "size": bad})
        assert problem.param == "size" and "WIDTHxHEIGHT" in problem.message


@pytest.mark.parametrize("seconds", ["0", "-4", "nan", "inf", "four", "601", True])
def test_bad_seconds_are_a_400(seconds: object) -> None:
    problem = _problem_of({"prompt": "p", "seconds": seconds})
    assert problem.status == 400 and problem.param == "seconds"


def test_input_reference_is_refused_by_name() -> None:
    for value in ({"image_url": "https://example.com/a.png"}, {"file": "ref.png"}):
        problem = _problem_of({"prompt": "p", "input_reference": value})
        assert problem.status == 400 and problem.param == "input_reference" and "text prompt only" in problem.message


def test_the_extensions_are_the_specs_namesakes() -> None:
    schema = VideoCreateBody.model_json_schema()["properties"]
    declared = {f.name: f.metadata["option"].doc for f in option_fields(VideoOptions)}
    for name in VIDEO_OPTION_FIELDS:
        assert schema[name]["description"].endswith(declared[name]), name
    _, kwargs = parse_video_create({"prompt": "p", "steps": 8, "seed": 3, "guidance_scale": 2.5,
                                    "negative_prompt": "blurry", "video_format": "webm", "priority": 2,
                                    "user": "ignored like OpenAI's other fields"}, FMT)
    assert kwargs == {"prompt": "p", "video_format": "webm", "steps": 8, "seed": 3, "guidance_scale": 2.5,
                      "negative_prompt": "blurry"}


def test_json_is_strict_and_a_form_is_read_from_strings() -> None:
    problem = _problem_of({"prompt": "p", "steps": "8"})
    assert problem.status == 400 and problem.param == "steps"
    _, kwargs = parse_video_create({"prompt": "p", "steps": "8", "guidance_scale": "2.5", "seconds": "4"}, FMT,
                                   form=True)
    assert (kwargs["steps"], kwargs["guidance_scale"], kwargs["num_frames"]) == (8, 2.5, 32)
    assert _problem_of({"prompt": "p", "steps": "many"}, form=True).param == "steps"
    assert _problem_of({"seconds": "4"}).type == "missing_field"


def test_form_body_marks_a_file_part_without_reading_it() -> None:
    upload = UploadFile(io.BytesIO(b"\x89PNG..."), filename="ref.png")
    body = form_body(FormData([("prompt", "p"), ("seconds", "4"), ("input_reference", upload)]))
    assert body == {"prompt": "p", "seconds": "4", "input_reference": {"file": "ref.png"}}
    assert _problem_of(body, form=True).param == "input_reference"


# -- the native body (bodies.py) and the family's pieces (families.py) ----------------------------------



def _native_problem(body: dict, **settings: object) -> Problem:
    with pytest.raises(Problem) as info:
        parse_video_body(body, ServerSettings(**settings))  # type: ignore[arg-type]
    return info.value


def test_the_native_body_is_the_video_options() -> None:
    assert set(VideoBody.model_fields) == {"prompt", *VIDEO_STREAM_ARGS}
    schema = VideoBody.model_json_schema()["properties"]
    for f in option_fields(VideoOptions):
        assert schema[f.name]["description"] == f.metadata["option"].doc, f.name
    kwargs, priority = parse_video_body({"prompt": "p", "num_frames": 16, "preview": "latent", "priority": 3},
                                        ServerSettings())
    assert (kwargs, priority) == ({"prompt": "p", "num_frames": 16, "preview": "latent"}, 3)


def test_a_bad_option_gets_the_models_own_message_naming_it() -> None:
    problem = _native_problem({"prompt": "p", "preview_format": "gif"})
    assert (problem.status, problem.type, problem.param) == (400, "invalid_argument", "preview_format")
    assert "use 'webp' (an animated image) or 'sheet'" in problem.message
    problem = _native_problem({"prompt": "p", "fps": "eight"})
    assert (problem.type, problem.param) == ("invalid_type", "fps")
    problem = _native_problem({"prompt": "p", "frames": 16})
    assert (problem.type, problem.param) == ("unknown_field", "frames")


def test_the_servers_limits() -> None:
    problem = _native_problem({"prompt": "p", "steps": 500}, max_steps=50)
    assert (problem.type, problem.param) == ("limit_exceeded", "steps") and "max_steps" in problem.message
    problem = _native_problem({"prompt": "p", "width": 4096})
    assert (problem.type, problem.param) == ("limit_exceeded", "width")
    problem = _native_problem({"prompt": "p", "num_frames": 5000})
    assert (problem.type, problem.param) == ("limit_exceeded", "num_frames") and "max_video_frames" in problem.message
    problem = _native_problem({"prompt": "x" * 20}, max_prompt_chars=10)
    assert (problem.type, problem.param) == ("limit_exceeded", "prompt")


def test_check_video_is_the_familys_own_check() -> None:
    check_video = family("video").check
    assert check_video is not None
    check_video({"prompt": "p", "steps": 4})
    with pytest.raises(InvalidArgumentError, match="steps must be an integer from 1 to 1000"):
        check_video({"prompt": "p", "steps": 0})


class _Record:
    def __init__(self, events: list) -> None:
        self.events, self.stream_id = events, "s1"


def test_the_server_written_final_is_the_newest_preview_or_an_error() -> None:
    record = _Record([_preview(0, 1), _preview(1, 2)])
    video_final = family("video").server_final
    final = video_final(record, "cancelled", 2, 1.5)
    assert isinstance(final, VideoEvent) and final.is_final and final.finish_reason == "cancelled"
    assert (final.seq, final.step, final.mime, final.eta_s) == (2, 2, "image/webp", 0.0)
    # ... which a job reads as failed (a preview is not a clip)
    assert _job().fold([*record.events, final], now=1).status == "failed"
    error = video_final(record, "timeout", 2, 1.5)
    assert isinstance(error, ErrorEvent) and "timeout" in error.error["message"]
    assert isinstance(video_final(_Record([]), "cancelled", 0, 0.1), ErrorEvent)
