"""Fitted preview decoders (`multistream.diffusion._preview_decoder`): fitting, caching, files, and the
``preview="tiny"`` mode end to end. Fits here are tiny (a few hundred steps) to keep CI fast."""

from __future__ import annotations

import pytest
import torch

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import one_thread  # noqa: F401

import multistream as ms
from multistream.diffusion import _preview_decoder as pd
from multistream.diffusion._latent_rgb import fit_latent_rgb, latents_to_rgb
from multistream.errors import InvalidArgumentError, ModelLoadError
from multistream.image import EMBEDDED_MODEL_DIR

TINY_FIT = dict(num_images=12, latent_size=8, steps=250, width=16, blocks=1)




@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTISTREAM_CACHE", str(tmp_path / "cache"))
    pd._memory.clear()


def _vae(latent_channels: int = 4, seed: int = 0, **kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config = dict(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        layers_per_block=1, norm_num_groups=4, scaling_factor=0.5,
    )  # fmt: skip
    config.update(kw)
    return AutoencoderKL(**config).eval()


def _errors(vae, net, channels: int, seed: int = 7) -> tuple[float, float]:
    """Mean absolute error on held-out latents: (fitted decoder, linear map), both vs the VAE."""
    from multistream.diffusion._latent_rgb import latents_from_vae_space, latents_to_vae_space, synthetic_images

    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        images = synthetic_images(6, 16, gen)
        scaled = latents_from_vae_space(vae.encode(images).latent_dist.mode(), vae.config)
        target = vae.decode(latents_to_vae_space(scaled, vae.config)).sample.clamp(-1, 1)
        fitted = net(scaled).clamp(-1, 1)
        linear = latents_to_rgb(scaled, fit_latent_rgb(vae, cache=False)) * 2 - 1
        linear = torch.nn.functional.interpolate(linear, size=target.shape[-2:], mode="nearest")
    return float((fitted - target).abs().mean()), float((linear - target).abs().mean())


def test_net_shapes_for_any_channels_and_factor() -> None:
    for channels, factor, stages in ((4, 8, 0), (16, 8, 1), (1, 1, 0), (16, 2, 3)):
        net = pd.PreviewDecoderNet(channels, factor, width=8, blocks=1, stages=stages)
        assert net(torch.zeros(2, channels, 3, 5)).shape == (2, 3, 3 * factor, 5 * factor)
    with pytest.raises(InvalidArgumentError, match="power of two"):
        pd.PreviewDecoderNet(4, 6)


@pytest.mark.parametrize("channels", [4, 16])
def test_fitting_beats_the_linear_map_and_an_unfitted_net(channels: int) -> None:
    vae = _vae(channels)
    reports: list[pd.FitProgress] = []
    net = ms.fit_preview_decoder(vae, cache=False, progress=reports.append, **TINY_FIT)
    fitted, linear = _errors(vae, net, channels)
    torch.manual_seed(0)
    unfitted, _ = _errors(vae, pd.PreviewDecoderNet(channels, 2, width=16, blocks=1), channels)
    assert fitted < linear and fitted < 0.8 * unfitted, (fitted, linear, unfitted)
    assert reports[-1].stage == "done" and any(r.stage == "fit" for r in reports)
    losses = [r.loss for r in reports if r.stage == "fit"]
    assert losses[-1] < losses[0]
    assert net.num_parameters() <= 300_000


def test_second_call_is_a_cache_hit(tmp_path) -> None:
    vae = _vae()
    calls: list[pd.FitProgress] = []
    first = ms.fit_preview_decoder(vae, progress=calls.append, **TINY_FIT)
    assert calls
    assert ms.fit_preview_decoder(vae, **TINY_FIT) is first  # in memory
    files = list((tmp_path / "cache" / "preview_decoders").glob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith(pd.vae_fingerprint(vae)[:32])

    pd._memory.clear()  # as in a new process: from the file, no fitting
    again: list[pd.FitProgress] = []
    second = ms.fit_preview_decoder(vae, progress=again.append, **TINY_FIT)
    assert not again and second is not first
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name

    other = _vae(seed=1)  # other weights: another fit
    assert pd.vae_fingerprint(other) != pd.vae_fingerprint(vae)


def test_save_and_load_round_trip(tmp_path) -> None:
    net = pd.PreviewDecoderNet(16, 8, width=8, blocks=1, stages=1)
    path = tmp_path / "dec.safetensors"
    pd.save_preview_decoder(net, path, vae_hash="abc")
    back = pd.load_preview_decoder(path)
    assert back.config() == net.config() and back.vae_hash == "abc"
    x = torch.randn(1, 16, 2, 2)
    assert torch.allclose(back(x), net(x))
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ModelLoadError, match="fit_preview_decoder"):
        pd.load_preview_decoder(tmp_path / "bad.safetensors")


def test_fit_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="steps"):
        ms.fit_preview_decoder(_vae(), steps=0)
    with pytest.raises(InvalidArgumentError, match="diffusers VAE"):
        ms.fit_preview_decoder(object())


def test_shipped_decoder_is_small_and_matches_the_embedded_vae() -> None:
    path = EMBEDDED_MODEL_DIR / pd.PREVIEW_DECODER_FILE
    assert path.is_file() and path.stat().st_size <= 1_000_000
    net = pd.load_preview_decoder(path)
    assert net.num_parameters() <= 300_000 and net.latent_channels == 4 and net.scale_factor == 4


@pytest.mark.model
def test_tiny_preview_end_to_end_on_the_embedded_model() -> None:
    from PIL import ImageStat

    sd = ms.load_image_model()
    assert sd.default_preview == "tiny"
    events = list(sd.stream("a red circle on a blue background", steps=6, seed=0, preview_format="png"))
    previews, final = events[:-1], events[-1]
    assert final.is_final and final.finish_reason == "stop"
    assert previews and all(ev.width == 64 and ev.height == 64 for ev in previews)
    # The last preview is the final image, nearly: the fitted decoder, not a linear map.
    last = previews[-1].image.convert("RGB")
    diff = [abs(a - b) for a, b in zip(last.tobytes(), final.image.convert("RGB").tobytes())]
    assert sum(diff) / len(diff) <= 12, sum(diff) / len(diff)
    assert ImageStat.Stat(last).mean[2] > ImageStat.Stat(last).mean[1]  # a blue background shows blue
    # Explicit names still work, "x0+tiny" is the same mode.
    assert list(sd.stream("a red circle", steps=2, seed=0, preview="x0+tiny"))[-1].finish_reason == "stop"
    assert list(sd.stream("a red circle", steps=2, seed=0, preview="latent"))[-1].finish_reason == "stop"


def test_tiny_preview_on_a_pipeline_without_a_shipped_decoder_fits_once(monkeypatch) -> None:
    from multistream.testing import _random_pipelines as rp

    monkeypatch.setattr(pd, "_DEFAULTS", {**pd._DEFAULTS, **TINY_FIT})
    monkeypatch.setattr(pd.fit_preview_decoder, "__kwdefaults__", {**pd.fit_preview_decoder.__kwdefaults__, **TINY_FIT})
    model = ms.load_image_model(rp.tiny_sd_pipeline(scheduler="ddim"))
    assert model.default_preview == "latent"
    final = model.generate("x", steps=2, seed=0, preview="tiny")
    assert final.finish_reason == "stop", getattr(final, "error", None)
    assert model._preview_net is not None


def _preview_sides(model, preview: str) -> set[int]:
    """The preview widths of a 2-step run (the tiny SD pipeline: 32 px latents, 64 px images)."""
    events = list(model.stream("x", steps=2, seed=0, preview=preview, preview_format="png", preview_max_side=None))
    assert events[-1].finish_reason == "stop", getattr(events[-1], "error", None)
    return {ev.width for ev in events[:-1]}


def test_x0_uses_a_fitted_decoder_where_one_is_at_hand_else_the_linear_map(monkeypatch) -> None:
    from multistream.testing import _random_pipelines as rp

    monkeypatch.setattr(pd, "_DEFAULTS", {**pd._DEFAULTS, **TINY_FIT})
    monkeypatch.setattr(pd.fit_preview_decoder, "__kwdefaults__", {**pd.fit_preview_decoder.__kwdefaults__, **TINY_FIT})
    pipe = rp.tiny_sd_pipeline(scheduler="ddim")
    plain = ms.load_image_model(pipe)
    # Nothing fitted for this VAE: "x0" is the linear map (latent-sized) and fits nothing.
    assert _preview_sides(plain, "x0") == {32} and plain._preview_net is None
    assert not list((pd.preview_decoder_cache_path("x").parent).glob("*.safetensors"))
    assert _preview_sides(plain, "latent") == {32}

    # A decoder given with preview_decoder=: "x0" uses it (image-sized).
    torch.manual_seed(0)
    given = ms.load_image_model(rp.tiny_sd_pipeline(scheduler="ddim"), preview_decoder=pd.PreviewDecoderNet(4, 2, width=8, blocks=1))
    assert _preview_sides(given, "x0") == {64}

    # Fitted after the model was made (in memory): "x0" picks it up; "latent" stays the map.
    net = ms.fit_preview_decoder(pipe.vae)
    assert _preview_sides(plain, "x0") == {64} and plain._preview_net is net
    assert _preview_sides(plain, "latent") == {32}

    # In a new process, the disk cache: a fresh model of the same VAE finds the fit there.
    pd._memory.clear()
    fresh = ms.load_image_model(rp.tiny_sd_pipeline(scheduler="ddim"))
    assert _preview_sides(fresh, "x0") == {64}
    assert fresh._preview_net is not None and fresh._preview_net.vae_hash == pd.vae_fingerprint(fresh.pipeline.vae)


@pytest.mark.model
def test_fit_preview_command_writes_a_decoder(tmp_path, capsys) -> None:
    from multistream import cli

    out = tmp_path / "dec.safetensors"
    assert cli.main(["fit-preview", "--steps", "20", "--x0-prompts", "2", "--x0-steps", "2", "--width", "16",
                     "--out", str(out)]) == 0
    net = pd.load_preview_decoder(out)
    assert net.latent_channels == 4 and net.fit_info["x0_runs"] == "2x2"
    assert net.width == 16 and "--width 16" in net.fit_info["command"]  # the video folder's is fitted 32 wide
    assert "parameters" in capsys.readouterr().err
