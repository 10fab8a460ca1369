"""The I/O-free preview pieces: throttle, preview modes, x0 maths, encoder worker, latent->RGB maps."""

from __future__ import annotations

import json
import threading

import pytest
import torch

# tests/ is on sys.path (pytest's default "prepend" import mode); one_thread is an autouse fixture.
from test_image import one_thread  # noqa: F401

import multistream as ms
from multistream.diffusion._latent_rgb import (
    PUBLISHED,
    LatentRGB,
    detect_family,
    fit_latent_rgb,
    latent_rgb_for,
    latents_from_vae_space,
    latents_to_rgb,
    latents_to_vae_space,
)
from multistream.diffusion._previews import (
    PREVIEW_MODES,
    FrameWorker,
    HostFrames,
    PendingFrame,
    PreviewThrottle,
    X0Tracker,
    compute_x0,
    false_color,
    parse_preview,
    to_uint8_frames,
    unpack_latents,
    x0_strategy,
)

# --- throttle and modes -------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 5, 7, 10, 30])
@pytest.mark.parametrize("every", [1, 2, 3, 4, 7, 50])
def test_throttle_gives_ceil_steps_over_k(steps: int, every: int) -> None:
    throttle = PreviewThrottle(every)
    chosen = [s for s in range(1, steps + 1) if throttle.should_preview(s)]
    assert len(chosen) == -(-steps // every) == throttle.count(steps)
    assert chosen[0] == 1  # the first step is always shown: the sooner something appears, the better
    assert all(b - a == every for a, b in zip(chosen, chosen[1:]))


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_throttle_rejects_bad_every(bad: object) -> None:
    with pytest.raises(ms.InvalidArgumentError, match="preview_every"):
        PreviewThrottle(bad)  # type: ignore[arg-type]


def test_parse_preview() -> None:
    assert (parse_preview("latent").source, parse_preview("latent").decoder) == ("latent", "linear")
    assert (parse_preview("x0").source, parse_preview("x0").decoder) == ("x0", "linear")
    assert (parse_preview("taesd").source, parse_preview("taesd").decoder) == ("latent", "taesd")
    assert (parse_preview("vae").source, parse_preview("vae").decoder) == ("latent", "vae")
    assert (parse_preview("x0+vae").source, parse_preview("x0+vae").decoder) == ("x0", "vae")
    assert not parse_preview("none").enabled
    with pytest.raises(ms.InvalidArgumentError, match="unknown preview='blurry'"):
        parse_preview("blurry")


# --- x0 -------------------------------------------------------------------------------------------


def _sd_betas() -> dict:
    return dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_vp_formula_matches_ddim(prediction_type: str) -> None:
    from diffusers import DDIMScheduler, PNDMScheduler

    ddim = DDIMScheduler(**_sd_betas(), prediction_type=prediction_type, clip_sample=False)
    ddim.set_timesteps(10)
    t = ddim.timesteps[3]
    gen = torch.Generator().manual_seed(0)
    sample, out = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 4, 8, 8, generator=gen)
    expected = ddim.step(out, t, sample).pred_original_sample
    got = compute_x0("vp", prediction_type, out, sample, alpha_cumprod=ddim.alphas_cumprod[int(t)])
    assert torch.allclose(got, expected, atol=1e-5)
    if prediction_type == "sample":
        return  # PNDM does not take it
    # PNDM reports no x0: the tracker computes it with the same formula from the step's inputs.
    pndm = PNDMScheduler(**_sd_betas(), prediction_type=prediction_type, skip_prk_steps=True)
    pndm.set_timesteps(10)
    with X0Tracker(pndm) as tracker:
        assert tracker.kind == "vp"
        pndm.step(out, t, sample, return_dict=False)
        assert torch.allclose(tracker.x0(), expected, atol=1e-5)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ve_formula_matches_euler(prediction_type: str) -> None:
    from diffusers import EulerDiscreteScheduler

    euler = EulerDiscreteScheduler(**_sd_betas(), prediction_type=prediction_type)
    euler.set_timesteps(10)
    gen = torch.Generator().manual_seed(1)
    sample, out = torch.randn(1, 4, 8, 8, generator=gen) * 5, torch.randn(1, 4, 8, 8, generator=gen)
    t = euler.timesteps[0]
    sigma = euler.sigmas[0]
    expected = euler.step(out, t, sample).pred_original_sample
    assert torch.allclose(compute_x0("ve", prediction_type, out, sample, sigma=sigma), expected, atol=1e-4)


def test_flow_formula_recovers_x0() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler()
    sched.set_timesteps(8)
    gen = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(1, 16, 4, 4, generator=gen), torch.randn(1, 16, 4, 4, generator=gen)
    sigma = sched.sigmas[2]
    xt = (1 - sigma) * x0 + sigma * noise
    with X0Tracker(sched) as tracker:
        assert tracker.kind == "flow"
        sched._step_index = 2
        prev = sched.step(noise - x0, sched.timesteps[2], xt, return_dict=False)
        assert isinstance(prev, tuple) and len(prev) == 1  # the caller still gets what it asked for
        assert torch.allclose(tracker.x0(), x0, atol=1e-4)


def test_tracker_prefers_scheduler_output_and_restores_step() -> None:
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(**_sd_betas(), clip_sample=False)
    sched.set_timesteps(5)
    original = sched.step
    sample, out = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with X0Tracker(sched) as tracker:
            assert sched.step is not original
            result = sched.step(out, sched.timesteps[0], sample, return_dict=False)
            assert isinstance(result, tuple) and torch.equal(tracker.x0(), result[1])
            as_dict = sched.step(out, sched.timesteps[1], sample)
            assert torch.equal(tracker.x0(), as_dict.pred_original_sample)
            raise RuntimeError("boom")
    assert "step" not in vars(sched) and sched.step == original


def test_x0_strategy() -> None:
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, PNDMScheduler

    assert x0_strategy(DDIMScheduler()) == "output"
    assert x0_strategy(PNDMScheduler()) == "vp"
    assert x0_strategy(DPMSolverMultistepScheduler()) == "vp"
    assert x0_strategy(FlowMatchEulerDiscreteScheduler()) == "flow"

    class Opaque:
        config = None

    assert x0_strategy(Opaque()) is None


# --- pixels -----------------------------------------------------------------------------------------


def test_to_uint8_frames_downscales_on_device() -> None:
    rgb = torch.rand(2, 3, 100, 50)
    frames = to_uint8_frames(rgb, 40)
    assert frames.shape == (2, 40, 20, 3) and frames.dtype == torch.uint8
    assert to_uint8_frames(rgb, 400).shape == (2, 100, 50, 3)  # never scaled up
    host = HostFrames(frames)
    assert host.array(1).shape == (40, 20, 3)
    assert to_uint8_frames(torch.full((1, 3, 2, 2), float("nan")), None).max() == 0


def test_false_color_is_in_range() -> None:
    out = false_color(torch.randn(1, 16, 5, 5) * 40)
    assert out.shape == (1, 3, 5, 5) and 0 <= out.min() and out.max() <= 1
    assert false_color(torch.randn(1, 1, 3, 3)).shape == (1, 3, 3, 3)


def test_unpack_flux_latents() -> None:
    from diffusers import FluxPipeline

    class FakeFlux:
        _unpack_latents = staticmethod(FluxPipeline._unpack_latents)
        vae_scale_factor = 8

    spatial = torch.randn(1, 16, 8, 6)
    packed = FluxPipeline._pack_latents(spatial, 1, 16, 8, 6)
    assert packed.shape == (1, 12, 64)
    assert torch.equal(unpack_latents(FakeFlux(), packed, 64, 48), spatial)
    assert unpack_latents(FakeFlux(), spatial, None, None) is spatial
    with pytest.raises(ms.InvalidArgumentError, match="preview='none'"):
        unpack_latents(object(), packed, None, None)


# --- the encoder worker -------------------------------------------------------------------------


def _frame(step: int, index: int = 0) -> PendingFrame:
    return PendingFrame(step, 10, index, HostFrames(torch.zeros(1, 2, 2, 3, dtype=torch.uint8)))


def test_worker_drops_stale_frames_not_newest() -> None:
    gate = threading.Event()
    encoding = threading.Event()
    seen: list[tuple[int, int]] = []

    def emit(frame: PendingFrame) -> None:
        encoding.set()
        gate.wait(5)  # a slow encoder
        seen.append((frame.step, frame.index))

    worker = FrameWorker(emit)
    worker.submit(_frame(1))
    assert encoding.wait(10)  # the worker has taken step 1 and is "encoding" it
    for step in range(2, 8):
        worker.submit(_frame(step))  # never blocks
    worker.submit(_frame(7, index=1))
    gate.set()
    worker.close()
    assert seen == [(1, 0), (7, 0), (7, 1)]
    assert worker.dropped == 5 and worker.emitted == 3


def test_worker_close_flushes_in_order_and_reraises() -> None:
    seen: list[int] = []
    worker = FrameWorker(lambda f: seen.append(f.step))
    worker.submit(_frame(1))
    worker.close()
    assert seen == [1]
    worker.submit(_frame(2))  # ignored after close
    assert seen == [1]

    def bad(frame: PendingFrame) -> None:
        raise OSError("disk full")

    failing = FrameWorker(bad)
    failing.submit(_frame(1))
    with pytest.raises(OSError, match="disk full"):
        failing.close()
    FrameWorker(lambda f: None).close()  # never started: closes at once


# --- latent -> RGB maps -----------------------------------------------------------------------------


def test_published_maps() -> None:
    assert set(PUBLISHED) == {"sd15", "sdxl", "sd3", "flux"}
    assert PUBLISHED["sd15"].channels == 4 and PUBLISHED["sdxl"].channels == 4
    assert PUBLISHED["sd3"].channels == 16 and PUBLISHED["flux"].channels == 16
    assert PUBLISHED["sd15"].matrix[0] == (0.3512, 0.2297, 0.3227)
    assert PUBLISHED["flux"].bias == (-0.0329, -0.0718, -0.0851)
    rgb = latents_to_rgb(torch.randn(2, 16, 3, 3) * 10, PUBLISHED["sd3"])
    assert rgb.shape == (2, 3, 3, 3) and rgb.min() >= 0 and rgb.max() <= 1
    with pytest.raises(ms.InvalidArgumentError, match="4 channels"):
        latents_to_rgb(torch.randn(1, 16, 2, 2), PUBLISHED["sd15"])


def test_latent_rgb_json_round_trip(tmp_path) -> None:
    m = LatentRGB(((0.1, 0.2, 0.3), (0.4, 0.5, 0.6)), (0.0, 0.1, 0.2), "x")
    m.save(tmp_path / "latent_rgb.json")
    back = LatentRGB.load(tmp_path / "latent_rgb.json")
    assert back == m and back.source.startswith("file:")
    assert json.loads((tmp_path / "latent_rgb.json").read_text())["matrix"][1] == [0.4, 0.5, 0.6]
    with pytest.raises(ms.InvalidArgumentError):
        LatentRGB(((1.0, 2.0),))  # type: ignore[arg-type]
    with pytest.raises(ms.InvalidArgumentError):
        LatentRGB.from_dict({"bias": [0, 0, 0]})
    with pytest.raises(ms.ModelLoadError):
        LatentRGB.load(tmp_path / "missing.json")


def test_vae_space_round_trip() -> None:
    from types import SimpleNamespace

    z = torch.randn(1, 4, 3, 3)
    for cfg in (
        SimpleNamespace(scaling_factor=0.18215),
        SimpleNamespace(scaling_factor=1.5305, shift_factor=0.0609),
        SimpleNamespace(scaling_factor=0.5, latents_mean=[1, 2, 3, 4], latents_std=[2, 2, 2, 2]),
    ):
        assert torch.allclose(latents_from_vae_space(latents_to_vae_space(z, cfg), cfg), z, atol=1e-5)
    assert torch.allclose(latents_to_vae_space(z, SimpleNamespace(scaling_factor=2.0, shift_factor=1.0)), z / 2 + 1)


@pytest.fixture(scope="module")
def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=[8, 16], in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
    ).eval()


def _decoded_colors(vae, scaled: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        image = vae.decode(latents_to_vae_space(scaled, vae.config)).sample.clamp(-1, 1)
    return torch.nn.functional.adaptive_avg_pool2d(image, scaled.shape[-2:])


def test_fit_latent_rgb_reproduces_decoder_colors(tiny_vae) -> None:
    fitted = fit_latent_rgb(tiny_vae, cache=False)
    assert fitted.source == "fitted" and fitted.channels == 4
    # Held-out latents, unlike the fit's: does the map predict the colours the decoder makes?
    gen = torch.Generator().manual_seed(123)
    with torch.inference_mode():
        images = torch.rand(2, 3, 24, 24, generator=gen) * 2 - 1
        encoded = latents_from_vae_space(tiny_vae.encode(images).latent_dist.mode(), tiny_vae.config)
    scaled = torch.cat([encoded, torch.randn(2, 4, 12, 12, generator=gen)])
    target = _decoded_colors(tiny_vae, scaled)

    def error(m: LatentRGB) -> float:
        return float(((latents_to_rgb(scaled, m) * 2 - 1) - target).abs().mean())

    random_errors = []
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        random_map = LatentRGB(tuple(map(tuple, (torch.randn(4, 3, generator=g) * 0.3).tolist())), (0.0, 0.0, 0.0))
        random_errors.append(error(random_map))
    assert error(fitted) < 0.7 * min(random_errors)
    assert error(fitted) < error(PUBLISHED["sd15"])  # SD's map does not describe this VAE


def test_fit_is_cached_per_vae(tiny_vae) -> None:
    first = fit_latent_rgb(tiny_vae)
    calls = []
    original = tiny_vae.decode
    tiny_vae.decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        assert fit_latent_rgb(tiny_vae) is first
    finally:
        del tiny_vae.decode
    assert calls == []


def test_latent_rgb_for_prefers_model_folder(tmp_path, tiny_vae) -> None:
    from types import SimpleNamespace

    class MyPipeline:
        pass

    pipe = MyPipeline()
    pipe.vae = SimpleNamespace(config=SimpleNamespace(latent_channels=4, scaling_factor=0.18215, shift_factor=None))
    assert detect_family(pipe) is None  # not a diffusers class
    MyPipeline.__name__ = "StableDiffusionPipeline"  # now it looks like SD 1.x
    assert detect_family(pipe) == "sd15"
    assert latent_rgb_for(pipe) is PUBLISHED["sd15"]
    pipe.vae.config.scaling_factor = 0.5  # another latent space: the published map does not apply
    assert detect_family(pipe) is None
    assert latent_rgb_for(pipe, fit=False) is None
    LatentRGB(((1.0, 0.0, 0.0),) * 4, (0.0, 0.0, 0.0)).save(tmp_path / "latent_rgb.json")
    assert latent_rgb_for(pipe, tmp_path).source.startswith("file:")
    MyPipeline.__name__ = "KandinskyLikePipeline"  # an unknown family: fitted to its VAE
    pipe.vae = tiny_vae
    assert latent_rgb_for(pipe).source == "fitted"


def test_parse_preview_tiny() -> None:
    # The fitted decoder always previews x0: through it the noisy latent would look like noise.
    assert (parse_preview("tiny").source, parse_preview("tiny").decoder) == ("x0", "tiny")
    assert (parse_preview("x0+tiny").source, parse_preview("x0+tiny").decoder) == ("x0", "tiny")
    assert "tiny" in PREVIEW_MODES and "x0+tiny" in PREVIEW_MODES


def test_tiny_decoder_maps_to_unit_range() -> None:
    from multistream.diffusion._preview_decoder import PreviewDecoderNet
    from multistream.diffusion._previews import TinyDecoder

    torch.manual_seed(0)
    rgb = TinyDecoder(PreviewDecoderNet(4, 8, width=8, blocks=1))(torch.randn(2, 4, 3, 3) * 5)
    assert rgb.shape == (2, 3, 24, 24) and rgb.dtype == torch.float32
    assert float(rgb.min()) >= 0.0 and float(rgb.max()) <= 1.0


# --- the decoder table ------------------------------------------------------------------------------


def _parts(vae=None, taesd=None, tiny_ready: bool = False, tiny_net=None):
    from multistream.diffusion._preview_decoder import PreviewDecoderNet
    from multistream.diffusion._previews import DecoderParts

    torch.manual_seed(0)
    net = tiny_net or PreviewDecoderNet(4, 2, width=8, blocks=1)
    lrgb = LatentRGB(((0.5, 0.0, 0.0), (0.0, 0.5, 0.0), (0.0, 0.0, 0.5), (0.1, 0.1, 0.1)), (0.0, 0.0, 0.0))
    return DecoderParts(latent_rgb=lambda: lrgb, tiny_net=lambda: net, vae=lambda: vae, tiny_ready=lambda: tiny_ready, taesd=taesd)


def _random_taesd():
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    return AutoencoderTiny(
        encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8), num_encoder_blocks=(1, 1),
        num_decoder_blocks=(1, 1), latent_channels=4,
    ).eval()  # fmt: skip


def test_every_decoder_of_the_table_builds_and_decodes_to_unit_rgb(tiny_vae) -> None:
    from multistream.diffusion._previews import DECODERS, PreviewDecoder, make_decoder

    # Every decoder a preview mode names is in the table, and the table has nothing else.
    named = {parse_preview(m).decoder for m in PREVIEW_MODES} | {d for m in PREVIEW_MODES for d in parse_preview(m).prefer}
    assert named - {None} == set(DECODERS) == {"linear", "tiny", "taesd", "vae"}
    parts = _parts(vae=tiny_vae, taesd=_random_taesd())
    latents = torch.randn(2, 4, 4, 4)
    sizes = {}
    for name, cls in DECODERS.items():
        decoder = make_decoder(name, parts)
        assert type(decoder) is cls and isinstance(decoder, PreviewDecoder) and decoder.name == name
        with torch.inference_mode():  # as in a run: the pipeline calls back without autograd
            rgb = decoder.decode(latents)
            assert torch.equal(decoder(latents), rgb)  # calling it is decode()
        assert rgb.dtype == torch.float32 and rgb.shape[:2] == (2, 3), name
        assert float(rgb.min()) >= 0.0 and float(rgb.max()) <= 1.0, name
        sizes[name] = rgb.shape[-1]
    assert sizes["linear"] == 4 and sizes["tiny"] == sizes["vae"] == 8  # the map is latent-sized; decoders upscale


def test_unknown_or_unbuildable_decoders_are_refused_clearly() -> None:
    from multistream.diffusion._previews import build_decoder, make_decoder

    parts = _parts()
    with pytest.raises(ms.InvalidArgumentError, match=r"unknown preview decoder 'blurry'; use one of \['linear', 'taesd', 'tiny', 'vae'\]"):
        make_decoder("blurry", parts)
    with pytest.raises(ms.InvalidArgumentError, match="unknown preview decoder None"):
        make_decoder(None, parts)  # type: ignore[arg-type]
    with pytest.raises(ms.InvalidArgumentError, match="TAESD previews need TAESD weights: pass taesd="):
        make_decoder("taesd", parts)
    with pytest.raises(ms.InvalidArgumentError, match="no VAE"):
        make_decoder("vae", parts)
    assert build_decoder(parse_preview("none"), parts) is None


def test_x0_prefers_the_fitted_decoder_only_where_one_is_at_hand() -> None:
    from multistream.diffusion._previews import DecoderParts, build_decoder, settle_plan
    from multistream.image._options import PreviewPlan

    def no_fit():
        raise AssertionError("settling a plan must not build (or fit) a decoder")

    ready, not_ready = _parts(tiny_ready=True), _parts(tiny_ready=False)
    assert parse_preview("x0") == PreviewPlan("x0", "x0", "linear", ("tiny",))
    assert settle_plan(parse_preview("x0"), ready) == PreviewPlan("x0", "x0", "tiny")
    assert settle_plan(parse_preview("x0"), not_ready) == PreviewPlan("x0", "x0", "linear")
    # Without x0 the noisy latent is shown, which a fitted decoder would draw as noise.
    assert settle_plan(parse_preview("x0"), ready, has_x0=False).decoder == "linear"
    # The other modes prefer nothing: what they name is what they get.
    for mode in ("latent", "tiny", "x0+tiny", "taesd", "vae", "x0+vae", "x0+taesd", "none"):
        assert settle_plan(parse_preview(mode), ready) == parse_preview(mode)
    lazy = DecoderParts(latent_rgb=no_fit, tiny_net=no_fit, vae=no_fit, tiny_ready=lambda: True)
    assert settle_plan(parse_preview("x0"), lazy).decoder == "tiny"
    assert build_decoder(parse_preview("x0"), ready).name == "tiny"
    assert build_decoder(parse_preview("x0"), not_ready).name == "linear"
