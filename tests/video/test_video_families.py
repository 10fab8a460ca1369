"""Real diffusers video families on random weights (built offline): Wan 2.1, CogVideoX, LTX-Video and
AnimateDiff stream previews of every frame in every preview mode, and their final clip decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multistream as ms
from multistream.errors import InvalidArgumentError
from multistream.testing._random_video import RANDOM_VIDEO_FAMILIES, tiny_video_pipeline
from multistream.video import VideoLatents, VideoModel, VideoPreviewNet, fit_video_preview_decoder

FAMILIES = list(RANDOM_VIDEO_FAMILIES)
MODES = ["latent", "x0", "tiny", "vae", "none"]
# Small fits keep the suite quick; the decoders' quality is the benchmark's business.
VIDEO_FIT = dict(steps=20, num_clips=2, latent_size=2)
IMAGE_FIT = dict(num_images=4, latent_size=8, steps=30, width=8, blocks=1)


@pytest.fixture(scope="module")
def models():
    built = {}
    for family in FAMILIES:
        pipe = tiny_video_pipeline(family)
        if VideoLatents.of(pipe).per_frame:
            decoder = ms.fit_preview_decoder(pipe.vae, cache=False, **IMAGE_FIT)
        else:
            decoder = ms.fit_preview_decoder(pipe.vae, **VIDEO_FIT)
        built[family] = VideoModel(pipe, preview_decoder=decoder)
    yield built
    for model in built.values():
        model.close()


def _call(family: str) -> dict:
    return dict(RANDOM_VIDEO_FAMILIES[family][1])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preview_mode_streams_every_frame_and_the_final_clip_decodes(models, family):
    vm = models[family]
    call = _call(family)
    for mode in MODES:
        events = list(vm.stream("a red circle moving right", steps=3, seed=0, preview=mode, **call))
        final = events[-1]
        assert final.type == "video" and final.is_final and final.finish_reason == "stop", (mode, final)
        previews = events[:-1]
        if mode == "none":
            assert previews == []
        else:
            assert previews, mode
            assert [p.step for p in previews] == sorted(p.step for p in previews)
            for ev in previews:
                assert ev.mime == "image/webp" and ev.total_steps == 3
                assert ev.num_frames == call["num_frames"] and len(ev.frames) == call["num_frames"]
                assert ev.frames[0].size == (ev.width, ev.height)
        assert final.mime == "video/webm"
        assert len(final.frames) == call["num_frames"]
        assert final.frames[0].size == (call["width"], call["height"])


@pytest.mark.parametrize("family", ["wan", "ltx"])
def test_contact_sheet_and_mp4(models, family):
    call = _call(family)
    events = list(models[family].stream("a cat", steps=2, seed=1, preview="vae", preview_format="sheet",
                                        video_format="mp4", **call))
    sheet, final = events[0], events[-1]
    assert sheet.mime == "image/jpeg" and len(sheet.frames) == call["num_frames"]
    assert final.mime == "video/mp4" and len(final.frames) == call["num_frames"]


def test_the_three_layouts_read_as_one():
    expected = {"wan": "ncthw", "cogvideox": "ntchw", "ltx": "packed", "animatediff": "ncthw", "animatediff_sdxl": "ncthw"}
    for family, (builder, call) in RANDOM_VIDEO_FAMILIES.items():
        pipe = builder(0)
        layout = VideoLatents.of(pipe)
        assert layout.layout == expected[family]
        seen = {}

        def grab(p, i, t, kw, seen=seen):
            seen["latents"] = kw["latents"]
            return {}

        out = pipe("x", num_inference_steps=2, output_type="pt", callback_on_step_end=grab,
                   generator=torch.Generator().manual_seed(0), **call)
        ncthw = layout.to_ncthw(seen["latents"], num_frames=call["num_frames"], height=call["height"], width=call["width"])
        assert ncthw.ndim == 5 and ncthw.shape[2] == layout.latent_frames(call["num_frames"])
        # The full VAE through the layout gives exactly the pipeline's own final decode.
        decoded = layout.decode(ncthw)
        assert torch.allclose(decoded, out.frames.permute(0, 2, 1, 3, 4).float(), atol=1e-4), family


def test_video_vae_gets_a_fitted_video_decoder():
    pipe = tiny_video_pipeline("wan")
    net = fit_video_preview_decoder(pipe.vae, **VIDEO_FIT)
    assert isinstance(net, VideoPreviewNet)
    assert ms.fit_preview_decoder(pipe.vae) is net  # cached per VAE
    from multistream.video import _tiny

    _tiny._memory.clear()  # a new process: the fit comes back from the disk cache, the same weights
    again = fit_video_preview_decoder(pipe.vae, **VIDEO_FIT)
    assert again is not net
    assert all(a.equal(b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))
    latents = torch.randn(1, 16, 3, 2, 2)
    assert net(latents).shape == VideoLatents.of(pipe).decode(latents).shape == (1, 3, 9, 16, 16)


def test_a_pipeline_without_step_callbacks_is_named():
    class NoCallbackPipeline:
        scheduler = object()

        def __call__(self, prompt, num_frames=16):
            raise AssertionError("never called")

    with pytest.raises(InvalidArgumentError, match="NoCallbackPipeline takes no callback_on_step_end"):
        VideoModel(NoCallbackPipeline())


def test_frame_counts_the_vae_cannot_make_are_refused(models):
    with pytest.raises(InvalidArgumentError, match=r"num_frames=10 .* 1 \+ 4\*k .* num_frames=9 or 13"):
        models["wan"].stream("x", num_frames=10, height=16, width=16)
    with pytest.raises(InvalidArgumentError, match="height=20 is not a multiple of 16"):
        models["wan"].stream("x", num_frames=9, height=20, width=16)


def test_previews_converge_to_the_final(models):
    """The clean estimate through the full VAE at the last step is the final clip (up to the codecs)."""
    call = _call("wan")
    events = list(models["wan"].stream("x", steps=4, seed=3, preview="vae", preview_max_side=None, **call))
    final = np.stack([np.asarray(f, float) for f in events[-1].frames])
    last = np.stack([np.asarray(f, float) for f in events[-2].frames])
    assert events[-2].step == 4
    assert np.abs(last - final).mean() < 12.0


def test_the_standin_previews_converge_to_the_final_in_every_mode():
    """The embedded model's stand-in (the image model per frame, with a motion adapter): each mode's
    preview at the last step is nearer the final clip than its first one, the VAE's nearly the clip."""
    from multistream.testing._random_video import standin_video_model

    with standin_video_model() as vm:
        for mode in ("latent", "x0", "tiny", "vae"):
            events = list(vm.stream("a red circle moving right on a blue background", steps=4, num_frames=4, seed=0,
                                    preview=mode))
            final = np.stack([np.asarray(f, dtype=np.float64) for f in events[-1].frames])
            size = events[-1].frames[0].size
            errors = [np.abs(np.stack([np.asarray(f.resize(size), dtype=np.float64) for f in ev.frames]) - final).mean()
                      for ev in events[:-1]]
            assert events[-2].step == 4, mode
            assert errors[-1] < errors[0], (mode, errors)
            if mode == "vae":
                assert errors[-1] < 10.0, errors
