"""The scripted video fake: the real model's options, events and controls, without a pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from multistream.errors import InvalidArgumentError
from multistream.testing import ScriptedVideoModel


def test_previews_of_every_frame_then_the_clip_moving_as_the_prompt_says():
    vm = ScriptedVideoModel(steps=4, num_frames=6, size=32)
    events = list(vm.stream("a red circle moving right on a blue background", preview_format="sheet"))
    final = events[-1]
    # A busy consumer may get only the newest of several previews (the stream's backpressure), so
    # any of them can be missing, never out of order.
    steps = [e.step for e in events[:-1]]
    assert steps and steps == sorted(set(steps)) and set(steps) <= {1, 2, 3, 4}
    assert all(e.mime == "image/jpeg" and len(e.frames) == 6 for e in events[:-1])
    assert final.mime == "video/webm" and final.finish_reason == "stop" and len(final.frames) == 6
    red = [np.asarray(f, dtype=float)[..., 0] > 150 for f in (final.frames[0], final.frames[-1])]
    xs = [np.nonzero(m)[1].mean() for m in red]
    assert xs[1] > xs[0] + 4  # the disc moved right


def test_cancel_finish_early_and_steer():
    vm = ScriptedVideoModel(steps=50, num_frames=4, size=16, delay_s=0.01)
    s = vm.stream("a red circle", preview="latent")
    next(s)
    s.finish_early()
    final = list(s)[-1]
    assert final.finish_reason == "finished_early" and final.mime == "video/webm"
    s = vm.stream("a red circle", preview="latent")
    next(s)
    s.cancel()
    assert list(s)[-1].finish_reason == "cancelled"
    vm = ScriptedVideoModel(steps=3, num_frames=4, size=16, delay_s=0.05)  # still running when steered
    s = vm.stream("a red circle on a blue background", preview="none")
    s.steer(prompt="a green circle on a yellow background")
    final = s.wait()
    assert final.metrics["steers"] == 1.0
    with pytest.raises(InvalidArgumentError, match="takes keywords"):
        vm.stream("x").steer("make it green")


def test_the_fake_refuses_what_the_real_model_refuses():
    vm = ScriptedVideoModel(size=32)
    with pytest.raises(InvalidArgumentError, match="unknown preview_format='gif'"):
        vm.stream("x", preview_format="gif")
    with pytest.raises(InvalidArgumentError, match="height=20 is not a multiple of 8"):
        vm.stream("x", height=20)
    with pytest.raises(InvalidArgumentError, match="takes no 'eta' argument"):
        vm.stream("x", eta=0.1)
    assert vm.generate("x", video_format="mp4", preview="none").mime == "video/mp4"


def test_save_writes_the_bytes_under_a_suffix_of_their_format(tmp_path):
    """``clip.mp4`` holding a WebM was written silently (a newcomer's ``final.save("clip.mp4")``); the
    suffix must name the bytes' format, and the error says which, and how to get an MP4."""
    vm = ScriptedVideoModel(steps=2, num_frames=4, size=16)
    final = vm.generate("a red circle moving right on a blue background")
    assert final.save(tmp_path / "clip.webm").read_bytes() == final.data
    with pytest.raises(InvalidArgumentError, match=r"video/webm as 'clip\.mp4'.*\.webm.*video_format='mp4'"):
        final.save(tmp_path / "clip.mp4")
    mp4 = vm.generate("a red circle moving right on a blue background", video_format="mp4")
    assert mp4.mime == "video/mp4" and mp4.save(tmp_path / "clip.MP4").stat().st_size == len(mp4.data)
    preview = next(iter(vm.stream("a red circle", preview_format="sheet")))
    assert preview.save(tmp_path / "sheet.jpg").exists()
    with pytest.raises(InvalidArgumentError, match=r"\.jpg or \.jpeg"):
        preview.save(tmp_path / "sheet.gif")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.MP4", "clip.webm", "sheet.jpg"]
