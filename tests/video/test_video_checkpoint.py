"""Resumable video runs: ``VideoModel.stream(on_checkpoint=, resume_from=)`` continues a clip after
the checkpoint's step and ends with the uninterrupted run's frames, exactly, on the embedded model
and on the random-weight families (the image family's checkpoints, on a clip's latents).

The frames are compared, not the WebM bytes: two identical runs' containers differ (libwebm
writes a fresh segment UID into each file)."""

from __future__ import annotations

import numpy as np
import pytest

import multistream as ms
from multistream.errors import InvalidArgumentError
from multistream.image import ImageCheckpoint
from multistream.testing._random_video import RANDOM_VIDEO_FAMILIES, tiny_video_pipeline
from multistream.video import VideoModel

PROMPT = "a red circle moving right on a blue background"


def _frames(ev: ms.VideoEvent) -> np.ndarray:
    return np.stack([np.asarray(f) for f in ev.frames])


def test_a_resumed_clip_is_the_uninterrupted_one_with_its_own_step_numbers(video_model) -> None:
    saved: list[ImageCheckpoint] = []
    full = video_model.generate(PROMPT, seed=3, steps=12, preview="none", on_checkpoint=saved.append, checkpoint_every=4)
    assert [c.step for c in saved] == [4, 8, 12] and full.metrics["checkpoints"] == 3
    assert saved[0].request["num_frames"] == full.num_frames == 16
    # A resume takes its latents from the checkpoint: the motion prior's mean clip (32 clips encoded)
    # is not made again, as a restarted server meeting the description for the first time would.
    means = video_model._motion_prior._means
    kept = dict(means)
    means.clear()
    for checkpoint in saved[:2]:
        events: list[ms.Event] = []
        again = video_model.stream(PROMPT, seed=3, steps=12, preview="x0", resume_from=checkpoint.to_bytes())
        final = again.wait(events.append)
        assert np.array_equal(_frames(final), _frames(full))
        assert final.metrics["resumed_from_step"] == checkpoint.step and final.step == 12
        previews = [ev.step for ev in events if not ev.is_final]
        assert previews == list(range(checkpoint.step + 1, 13))  # the steps it made, numbered as the original's
    assert not means, "a resumed run computed the motion prior"
    means.update(kept)


def test_a_steered_clip_resumes_under_its_new_prompt(video_model) -> None:
    saved: list[ImageCheckpoint] = []
    s = video_model.stream(PROMPT, seed=5, steps=10, preview="none", on_checkpoint=saved.append)
    s.steer(prompt="a green square moving up on a black background")  # before step 1's callback: from step 2
    steered = s.wait()
    assert steered.metrics["steers"] == 1
    resumed = video_model.generate(PROMPT, seed=5, steps=10, preview="none", resume_from=saved[5])
    assert np.array_equal(_frames(resumed), _frames(steered)) and resumed.metrics["steers"] == 1
    plain = video_model.generate(PROMPT, seed=5, steps=10, preview="none")
    assert not np.array_equal(_frames(plain), _frames(steered))  # the steer did change the clip


def test_a_checkpoint_of_another_run_is_refused_by_name(video_model) -> None:
    saved: list[ImageCheckpoint] = []
    video_model.generate(PROMPT, seed=1, steps=4, preview="none", on_checkpoint=saved.append)
    with pytest.raises(InvalidArgumentError, match=r"num_frames=16; this call has 8"):
        video_model.stream(PROMPT, seed=1, steps=4, num_frames=8, resume_from=saved[1])
    with pytest.raises(InvalidArgumentError, match="prompt, negative_prompt and guidance_scale"):
        video_model.stream("a blue star moving up", seed=1, steps=4, resume_from=saved[1])
    with pytest.raises(InvalidArgumentError, match="not a multistream image checkpoint"):
        video_model.stream(PROMPT, seed=1, steps=4, resume_from=b"not a checkpoint")
    with pytest.raises(InvalidArgumentError, match="on_checkpoint must be callable"):
        video_model.stream(PROMPT, on_checkpoint="file.bin")


@pytest.mark.parametrize("family", list(RANDOM_VIDEO_FAMILIES))
def test_each_family_resumes_exactly(family: str) -> None:
    call = dict(RANDOM_VIDEO_FAMILIES[family][1])
    with VideoModel(tiny_video_pipeline(family)) as model:
        saved: list[ImageCheckpoint] = []
        full = model.generate("a cat", seed=2, steps=4, preview="none", on_checkpoint=saved.append, **call)
        resumed = model.generate("a cat", seed=2, steps=4, preview="none", resume_from=saved[1].to_bytes(), **call)
        assert np.array_equal(_frames(resumed), _frames(full)), family
        assert resumed.metrics["resumed_from_step"] == 2


def test_the_embedded_models_sizes_are_the_ones_the_command_line_checks(video_model) -> None:
    """`EMBEDDED_VIDEO_SIZES` is what `multistream video` checks before loading; the loaded model
    serves exactly those, and they are what its pipeline's own factors give."""
    from multistream.diffusion._sizes import sizes_for
    from multistream.video import EMBEDDED_VIDEO_SIZES

    assert video_model.sizes == EMBEDDED_VIDEO_SIZES
    derived = sizes_for(video_model.size_multiple, video_model.default_size, EMBEDDED_VIDEO_SIZES.why)
    assert (derived.multiple, derived.max_side, derived.native) == (
        EMBEDDED_VIDEO_SIZES.multiple, EMBEDDED_VIDEO_SIZES.max_side, EMBEDDED_VIDEO_SIZES.native)
    with pytest.raises(InvalidArgumentError, match="width=100 is not a multiple of 16"):
        video_model.stream("a red circle", width=100)
