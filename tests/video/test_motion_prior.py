"""The motion prior's machinery (multistream/video/_motion_prior.py) on a small stand-in VAE;
the shipped model's clips with it are judged in test_shapes_video_model.py."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from multistream.errors import ModelLoadError  # noqa: E402
from multistream.video._layout import VideoLatents  # noqa: E402
from multistream.video._motion_prior import MOTION_PRIOR_FILE, MotionPrior  # noqa: E402


class _Latents:
    def __init__(self, mean: torch.Tensor) -> None:
        self._mean = mean

    def mode(self) -> torch.Tensor:
        return self._mean


class _Encoded:
    def __init__(self, mean: torch.Tensor) -> None:
        self.latent_dist = _Latents(mean)


class _AveragingVAE(torch.nn.Module):
    """Encodes a 64x64 frame to its 8x8 average pool, three channels plus one of ones."""

    class config:  # noqa: N801 - diffusers' attribute name
        scaling_factor = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.encoder = torch.nn.Identity()  # VideoLatents.encode asks for one
        self.calls = 0

    def encode(self, pixels: torch.Tensor) -> _Encoded:
        pooled = torch.nn.functional.avg_pool2d(pixels, 8)
        self.calls += 1
        return _Encoded(torch.cat([pooled, torch.ones_like(pooled[:, :1])], dim=1))


_VAE = _AveragingVAE()


_SCHEDULER = type("Scheduler", (), {"alphas_cumprod": torch.tensor([0.99, 0.5, 0.0047])})()
_PRIOR = MotionPrior(gain=4.0, clips=8)


def _latents(prompt: str, seed: int = 0, prior: MotionPrior = _PRIOR, **kw):
    layout = VideoLatents(_VAE, "ncthw", 1, 8, True, "animatediff")  # per-frame 2D VAE, as AnimateDiff's
    size = kw.pop("size", 64)
    return prior.initial_latents(layout, _SCHEDULER, prompt, num_frames=kw.pop("num_frames", 8), height=size,
                                 width=kw.pop("width", size), generator=torch.Generator().manual_seed(seed))


def test_the_prior_leans_the_noise_the_way_the_prompt_moves() -> None:
    right = _latents("a red circle moving right on a blue background")
    left = _latents("a red circle moving left on a blue background")
    assert right.shape == (1, 4, 8, 8, 8)
    lean = right - left  # the same seed: the noise cancels, the leaked mean clips remain
    # Moving right: red (channel 0) grows on the right of the last frame and on the left of the first.
    assert lean[0, 0, -1, :, 4:].sum() > 0 > lean[0, 0, -1, :, :4].sum()
    assert lean[0, 0, 0, :, :4].sum() > 0 > lean[0, 0, 0, :, 4:].sum()
    # The seed still chooses the clip, and a seed gives the same latents every time.
    assert not torch.equal(right, _latents("a red circle moving right on a blue background", seed=1))
    assert torch.equal(right, _latents("a red circle moving right on a blue background"))


def test_a_prior_encodes_each_description_once() -> None:
    prior = MotionPrior(gain=4.0, clips=8)
    before = _VAE.calls
    first = _latents("a green star moving up on a black background", prior=prior)
    after_first = _VAE.calls
    again = _latents("a green star moving up on a black background", seed=5, prior=prior)
    assert after_first > before and _VAE.calls == after_first  # the second request encodes nothing
    assert not torch.equal(first, again)  # but draws its own seed's noise


@pytest.mark.parametrize("prompt, kw", [
    ("a red circle on a blue background", {}),  # names no motion
    ("a fluffy dragon, flying sideways!", {}),
    ("a red circle moving up on a red background", {}),  # no clip has it
    ("a red circle moving up on a blue background", {"width": 32}),  # not square
])
def test_prompts_the_prior_cannot_describe_start_from_plain_noise(prompt, kw) -> None:
    assert _latents(prompt, **kw) is None


def test_a_folder_turns_the_prior_on_with_its_file(tmp_path) -> None:
    assert MotionPrior.from_folder(tmp_path) is None
    (tmp_path / MOTION_PRIOR_FILE).write_text(json.dumps({"gain": 2.5}))
    assert MotionPrior.from_folder(tmp_path) == MotionPrior(gain=2.5, clips=32)
    (tmp_path / MOTION_PRIOR_FILE).write_text("{gain: 2")
    with pytest.raises(ModelLoadError, match="motion_prior.json is not a motion prior"):
        MotionPrior.from_folder(tmp_path)
