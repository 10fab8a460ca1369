"""Each diffusers family streams: SD 1.x (in test_image.py), SDXL, SD3 and Flux, with tiny
random-weight components built here (offline tokenizers included)."""

from __future__ import annotations

import pytest

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import Lockstep, cancel_at, one_thread  # noqa: F401

import multistream as ms
from multistream.image import ImageModel
from multistream.testing import _random_pipelines as rp


@pytest.fixture(scope="module")
def sdxl() -> ImageModel:
    return ms.load_image_model(rp.tiny_sdxl_pipeline())


@pytest.fixture(scope="module")
def sd3() -> ImageModel:
    return ms.load_image_model(rp.tiny_sd3_pipeline())


@pytest.fixture(scope="module")
def flux() -> ImageModel:
    return ms.load_image_model(rp.tiny_flux_pipeline())


def _check_stream(model: ImageModel, preview: str, size: int, preview_size: int, steps: int = 3, **kw) -> list:
    lock = Lockstep()  # no preview skipped, however busy the machine
    events = lock.events(model.stream("a red circle", steps=steps, seed=0, preview=preview, callback_on_step_end=lock.callback, **kw))
    previews, final = events[:-1], events[-1]
    assert final.is_final and final.finish_reason == "stop", getattr(final, "error", None)
    assert [e.step for e in previews] == list(range(1, steps + 1))
    assert all(e.total_steps == steps and e.image.size == (preview_size, preview_size) for e in previews)
    assert final.image.size == (final.width, final.height) == (size, size)
    assert "step" not in vars(model.pipeline.scheduler)
    return events


@pytest.mark.parametrize("preview", ["latent", "x0", "vae"])
def test_sdxl_streams(sdxl: ImageModel, preview: str) -> None:
    _check_stream(sdxl, preview, 64, 32 if preview != "vae" else 64)


def test_sdxl_uses_a_fitted_map_for_its_test_vae(sdxl: ImageModel) -> None:
    # The tiny VAE is not SDXL's (scaling factor 0.18215, not 0.13025): SDXL's published map
    # would be wrong for it, so it gets one fitted to the VAE.
    assert sdxl.family is None and sdxl.latent_rgb.source == "fitted"


@pytest.mark.parametrize("preview", ["latent", "x0", "vae"])
def test_sd3_streams(sd3: ImageModel, preview: str) -> None:
    _check_stream(sd3, preview, 32, 32)


def test_sd3_x0_is_the_flow_matching_estimate(sd3: ImageModel) -> None:
    from multistream.diffusion._previews import x0_strategy

    assert x0_strategy(sd3.pipeline.scheduler) == "flow"
    assert sd3.latent_rgb.channels == 4


@pytest.mark.parametrize("preview", ["latent", "x0", "vae", "x0+vae"])
def test_flux_streams_packed_latents(flux: ImageModel, preview: str) -> None:
    # Flux packs 2x2 latent patches into tokens; previews unpack them with the pipeline's own code.
    _check_stream(flux, preview, 32, 32, height=32, width=32)


def test_flux_size_must_fit_the_packing(flux: ImageModel) -> None:
    assert flux.size_multiple == 2 * flux.pipeline.vae_scale_factor
    with pytest.raises(ms.InvalidArgumentError, match="height=33 is not a multiple of 8"):
        flux.stream("x", height=33, width=32)


def test_flux_cancel_skips_the_decode(flux: ImageModel) -> None:
    calls = []
    original = flux.pipeline.vae.decode
    cancel = cancel_at(2)
    flux.pipeline.vae.decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        cancel.stream = flux.stream("x", steps=20, seed=0, height=32, width=32, callback_on_step_end=cancel)
        events = list(cancel.stream)
    finally:
        del flux.pipeline.vae.decode
    assert events[-1].finish_reason == "cancelled" and events[-1].metrics["steps"] == 3 and calls == []


def test_published_maps_are_chosen_by_family() -> None:
    from types import SimpleNamespace

    from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline

    from multistream.diffusion._latent_rgb import PUBLISHED, latent_rgb_for

    def fake(cls, channels, scale, shift=None):
        pipe = cls.__new__(cls)  # no components needed: only the class and the VAE config matter
        object.__setattr__(pipe, "vae", SimpleNamespace(config=SimpleNamespace(
            latent_channels=channels, scaling_factor=scale, shift_factor=shift)))  # fmt: skip
        return pipe

    assert latent_rgb_for(fake(StableDiffusionXLPipeline, 4, 0.13025)) is PUBLISHED["sdxl"]
    assert latent_rgb_for(fake(StableDiffusion3Pipeline, 16, 1.5305, 0.0609)) is PUBLISHED["sd3"]
    assert latent_rgb_for(fake(FluxPipeline, 16, 0.3611, 0.1159)) is PUBLISHED["flux"]
    assert latent_rgb_for(fake(FluxPipeline, 16, 1.0), fit=False) is None
