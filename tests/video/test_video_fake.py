"""ScriptedVideoModel, the fake that the video surfaces' tests run on: real previews and clips, edits."""

from __future__ import annotations

import pytest

from multistream.errors import InvalidArgumentError
from multistream.events import VideoEvent, event_from_dict
from multistream.testing import ScriptedVideoModel


def _centre_x(frame) -> float:  # type: ignore[no-untyped-def]
    """The red shape's mean column (the fake draws a red circle unless told otherwise)."""
    px = frame.load()
    xs = [x for x in range(frame.width) for y in range(frame.height) if px[x, y][0] > 150 and px[x, y][2] < 100]
    return sum(xs) / len(xs)


def test_previews_hold_every_frame_and_the_final_is_a_clip() -> None:
    vm = ScriptedVideoModel(steps=4, num_frames=6, size=32)
    events = list(vm.stream("a red circle moving right on a blue background", preview_max_side=16))
    previews, final = events[:-1], events[-1]
    steps = [ev.step for ev in previews]  # a slow reader gets the newest preview only: some may be skipped
    assert steps == sorted(set(steps)) and steps[-1] == 4
    assert all(ev.mime == "image/webp" and len(ev.frames) == 6 and ev.frames[0].size == (16, 16) for ev in previews)
    assert final.is_final and final.mime == "video/webm" and final.finish_reason == "stop"
    assert len(final.frames) == 6 and final.frames[0].size == (32, 32)
    xs = [_centre_x(f) for f in final.frames]
    assert xs == sorted(xs) and xs[-1] - xs[0] > 8  # moving right
    assert event_from_dict(final.to_dict()) == final


def test_sheet_previews_and_mp4() -> None:
    vm = ScriptedVideoModel(steps=2, num_frames=5, size=32)
    events = list(vm.stream("a red circle moving left", preview_format="sheet", video_format="mp4"))
    assert events[0].mime == "image/jpeg" and len(events[0].frames) == 5
    assert events[-1].mime == "video/mp4" and len(events[-1].frames) == 5
    xs = [_centre_x(f) for f in events[-1].frames]
    assert xs == sorted(xs, reverse=True)


def test_finish_early_keeps_the_current_clip_and_cancel_stops() -> None:
    vm = ScriptedVideoModel(steps=500, num_frames=4, size=16, delay_s=0.01)
    stream = vm.stream("a red circle")
    for ev in stream:
        if not ev.is_final and ev.step == 2:
            stream.finish_early()
    final = stream.final
    assert isinstance(final, VideoEvent) and final.finish_reason == "finished_early" and 2 <= final.step < 500
    assert len(final.frames) == 4
    stream = vm.stream("a red circle")
    next(iter(stream))
    stream.cancel()
    assert stream.wait().finish_reason == "cancelled"


def test_steer_changes_the_motion() -> None:
    vm = ScriptedVideoModel(steps=6, num_frames=6, size=32)
    stream = vm.stream("a red circle moving right")
    stream.steer(prompt="a red circle moving left")  # before the first step: as if started with it
    stream.wait()
    xs = [_centre_x(f) for f in stream.final.frames]  # type: ignore[union-attr]
    assert xs == sorted(xs, reverse=True) and stream.final.metrics["steers"] == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"num_frames": 0}, {"fps": 0}, {"preview": "taesd"},
                                    {"preview_format": "gif"}, {"video_format": "avi"}, {"preview_every": 0}])
def test_bad_arguments_are_refused_at_once(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        ScriptedVideoModel().stream("a red circle", **kwargs)


def test_a_slow_reader_gets_the_newest_preview_and_the_final() -> None:
    stream = ScriptedVideoModel(steps=6, num_frames=4, size=16).stream("a red circle")
    assert stream.join(timeout=30)  # the producer finished before anything was read
    events = list(stream)
    assert [ev.step for ev in events] == [6, 6] and events[-1].is_final and events[0].mime == "image/webp"
    assert [ev.seq for ev in events] == [0, 1]


@pytest.mark.parametrize("prompt", ["a yellow star moving up on a black background",
                                    "a green triangle moving left on a white background",
                                    "a purple square moving down on an orange background"])
def test_the_clip_is_what_the_prompt_says_by_the_shapes_judge(prompt: str) -> None:
    from multistream._shapes._judge import judge_clip

    final = ScriptedVideoModel(steps=2, num_frames=8, size=64).generate(prompt)
    verdict = judge_clip(final.frames, prompt)
    assert verdict.ok, verdict


@pytest.mark.parametrize("model", ["fake", pytest.param("real", marks=pytest.mark.model)])
def test_fake_and_real_models_keep_one_contract(model: str) -> None:
    """What a test written on the fake relies on holds on a real `VideoModel` (a tiny random Wan 2.1)."""
    if model == "fake":
        vm = ScriptedVideoModel(num_frames=9, size=16)
    else:
        from multistream.testing._random_video import tiny_wan_pipeline
        from multistream.video import load_video_model

        vm = load_video_model(tiny_wan_pipeline(), defaults={"num_frames": 9, "height": 16, "width": 16})
    try:
        stream = vm.stream("a red circle moving right", steps=3, preview="latent", preview_every=2)
        events = list(stream)
        assert [ev.seq for ev in events] == list(range(len(events))) and all(ev.type == "video" for ev in events)
        assert [ev.is_final for ev in events].count(True) == 1 and events[-1].is_final
        previews, final = events[:-1], events[-1]
        assert {ev.step for ev in previews} <= {1, 3} and previews[-1].step == 3  # preview_every=2: steps 1, 3
        assert all(ev.mime == "image/webp" and ev.num_frames == 9 and len(ev.frames) == 9 for ev in previews)
        assert final.mime == "video/webm" and final.finish_reason == "stop" and final.step == 3 and final.eta_s == 0.0
        assert (final.width, final.height, final.num_frames, len(final.frames)) == (16, 16, 9, 9)
        assert {"duration_ms", "previews", "steps", "seed", "ttfp_ms", "bytes", "encode_ms",
                "preview_bytes_mean", "step_ms_median"} <= set(final.metrics or {})
        for bad, message in (({"steps": 0}, "steps must be an integer from 1 to 1000"), ({"preview": "taesd"}, "unknown preview"),
                             ({"video_format": "avi"}, "unknown video_format"), ({"cfg": 1}, "takes no 'cfg' argument")):
            with pytest.raises(InvalidArgumentError, match=message):
                vm.stream("a red circle", **bad)
        stream = vm.stream("a red circle", steps=50)
        stream.finish_early()  # before the first step: the clip of the starting estimate, never an error
        assert stream.wait().finish_reason == "finished_early"
    finally:
        close = getattr(vm, "close", None)
        if close is not None:
            close()
