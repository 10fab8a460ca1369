"""Denoising previews: what to show at a step, how to turn latents into pixels, and how to ship them.

The pieces, each small and testable without a real model:

* `PreviewThrottle` decides at which steps a preview is made (``preview_every``).
* `parse_preview` reads ``preview=`` into a `PreviewPlan`: a *source* (the noisy latent, or the
  model's current prediction of the clean image, x0) and a *decoder* (a name of `DECODERS`).
  Both live in the torch-free `multistream.diffusion._preview_options` (the fake image model checks its
  arguments with them too) and are re-exported here:

  ============  =====================  ======================================================
  ``preview=``  source                 decoder
  ============  =====================  ======================================================
  ``"latent"``  noisy latent           ``linear``: a linear map (`multistream.diffusion._latent_rgb`),
                                       about free, latent-sized
  ``"x0"``      predicted clean image  the best cheap decoder the model has: ``tiny`` where a
                                       fitted one is at hand (shipped with the model, as the
                                       embedded one is; given with ``preview_decoder=``; or
                                       fitted before for this VAE), else ``linear``
  ``"tiny"``    predicted clean image  ``tiny``: a tiny decoder fitted to this VAE
                                       (`multistream.diffusion._preview_decoder`): the image's own
                                       colours and shapes for about 2 ms a frame (CPU); fitted
                                       once per VAE (a minute or two) where none is at hand
  ``"taesd"``   noisy latent           ``taesd``: ``diffusers.AutoencoderTiny`` (weights from
                                       the user)
  ``"vae"``     noisy latent           ``vae``: the pipeline's full VAE: best looking, most
                                       expensive
  ``"none"``    -                      no previews, only the final image
  ============  =====================  ======================================================

  ``"x0+taesd"`` and ``"x0+vae"`` decode the x0 prediction with TAESD or the VAE;
  ``"x0+tiny"`` is another name for ``"tiny"`` (a fitted decoder shows the noisy latent as
  noise, so it always gets x0). TAESD weights are a published ``AutoencoderTiny`` per family;
  fitted decoders are made for any VAE (shipped with the embedded model, else fitted once per
  VAE and cached), and are what the embedded model previews with by default.
* The decoders are a table, `DECODERS` (name -> class), in the manner of httpx's content
  decoders: `LinearDecoder`, `TinyDecoder`, `TaesdDecoder` and `VaeDecoder` share one interface
  (`PreviewDecoder`: ``decode(latents) -> RGB in [0, 1]``, built ``from_parts`` of a model:
  `DecoderParts`). `settle_plan` turns what a plan *prefers* (``"x0"``: ``tiny``) into the
  decoder this model can do without fitting anything, and `build_decoder` is the one place a
  run's decoder is made.
* `X0Tracker` wraps ``scheduler.step`` for the duration of a run to get x0: the scheduler's own
  ``pred_original_sample`` (or ``denoised``) where its output has one, else x0 computed from
  the model output: ``x0 = x_t - sigma * v`` for flow matching (SD3, Flux),
  ``(x_t - sqrt(1 - a_t) * eps) / sqrt(a_t)`` for variance-preserving schedulers (DDIM, PNDM,
  DPM-Solver, UniPC ...), ``x_t - sigma * eps`` for sigma-space ones (Euler, LMS, Heun ...), with the
  ``v_prediction`` and ``sample`` forms too. A scheduler that allows none of these falls back to
  the noisy latent (`x0_strategy` returns None, and the image model warns once).
* Decoders run on the model's device; `to_uint8_frames` scales the result down to
  ``preview_max_side`` there too, so only a small uint8 image crosses to the CPU, and `HostFrames`
  makes that copy asynchronous on CUDA (pinned memory and an event: the denoising thread never
  waits for it).
* `FrameWorker` is the one encoder thread of a stream: it takes the newest pending frame of each
  image, so the pipeline never waits on JPEG encoding and a slow encoder drops stale frames
  instead of queueing them.

Example:
    >>> t = PreviewThrottle(every=3)
    >>> [s for s in range(1, 11) if t.should_preview(s)]
    [1, 4, 7, 10]
    >>> t.count(10)
    4
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError
from ._latent_rgb import LatentRGB, latents_to_rgb, latents_to_vae_space
from ._preview_options import PREVIEW_MODES, PreviewPlan, PreviewThrottle, parse_preview

__all__ = [
    "DECODERS",
    "PREVIEW_MODES",
    "DecoderParts",
    "FrameWorker",
    "HostFrames",
    "LinearDecoder",
    "PendingFrame",
    "PreviewDecoder",
    "PreviewPlan",
    "PreviewThrottle",
    "TaesdDecoder",
    "TinyDecoder",
    "VaeDecoder",
    "X0Tracker",
    "build_decoder",
    "compute_x0",
    "false_color",
    "make_decoder",
    "parse_preview",
    "settle_plan",
    "to_uint8_frames",
    "unpack_latents",
    "x0_strategy",
]

# --- x0: the model's current estimate of the clean latent -------------------------------------


def _module_reports_x0(scheduler: Any) -> bool:
    module = sys.modules.get(type(scheduler).__module__)
    for value in vars(module).values() if module else ():
        if isinstance(value, type) and dataclasses.is_dataclass(value):
            names = {f.name for f in dataclasses.fields(value)}
            if "pred_original_sample" in names or "denoised" in names:
                return True
    return False


def _formula_kind(scheduler: Any) -> str | None:
    config = getattr(scheduler, "config", None)
    prediction = getattr(config, "prediction_type", None)
    if (
        "FlowMatch" in type(scheduler).__name__
        or prediction == "flow_prediction"
        or getattr(config, "use_flow_sigmas", False)
    ) and hasattr(scheduler, "sigmas"):
        return "flow"
    if prediction not in (None, "epsilon", "v_prediction", "sample"):
        return None
    init_sigma = getattr(scheduler, "init_noise_sigma", None)
    try:
        init_sigma = float(init_sigma) if init_sigma is not None else None
    except (TypeError, ValueError, RuntimeError):
        init_sigma = None
    if init_sigma == 1.0 and getattr(scheduler, "alphas_cumprod", None) is not None:
        return "vp"
    if hasattr(scheduler, "sigmas") and hasattr(scheduler, "step_index"):
        return "ve"
    return None


def x0_strategy(scheduler: Any) -> str | None:
    """How x0 will be had from this scheduler: ``"output"`` (its step output reports it, with the
    formulas as a fallback), ``"flow"``, ``"vp"``, ``"ve"`` (a formula), or None (not at all)."""
    if _module_reports_x0(scheduler):
        return "output"
    return _formula_kind(scheduler)


class X0Tracker:
    """Wraps ``scheduler.step`` while a run lasts, to get the prediction of the clean latent.

    Use as a context manager around the pipeline call; ``x0()`` then gives the latest step's
    prediction (None if this scheduler allows none). The original ``step`` is restored on exit,
    also when the run fails or is cancelled.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.kind = _formula_kind(scheduler)
        self._x0: torch.Tensor | None = None
        self._inputs: tuple[torch.Tensor, Any, torch.Tensor, Any] | None = None
        self._saved: Any = None
        self._had_attr = False
        self._alphas: dict[str, torch.Tensor] = {}

    def __enter__(self) -> X0Tracker:
        scheduler = self.scheduler
        self._had_attr = "step" in vars(scheduler)
        original = scheduler.step
        self._saved = original
        tracker = self

        # Only schedulers whose output class reports x0 are asked for their output object (and
        # the caller gets the tuple it asked for back); others are called exactly as they were.
        force_dict = _module_reports_x0(scheduler)

        # functools.wraps keeps the original signature visible: pipelines inspect it to decide
        # whether to pass ``eta`` and ``generator`` (ancestral samplers need the seeded generator).
        @functools.wraps(original)
        def step(model_output: torch.Tensor, timestep: Any, sample: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            want_tuple = kwargs.get("return_dict", True) is False
            if force_dict and not args:
                kwargs["return_dict"] = True
            out = original(model_output, timestep, sample, *args, **kwargs)
            x0 = None
            if not isinstance(out, tuple):
                x0 = getattr(out, "pred_original_sample", None)
                if x0 is None:
                    x0 = getattr(out, "denoised", None)
                if want_tuple:
                    to_tuple = getattr(out, "to_tuple", None)
                    out = to_tuple() if to_tuple is not None else (out.prev_sample,)
            tracker._x0 = x0
            if x0 is None and tracker.kind is not None:
                sigma = None
                if tracker.kind in ("flow", "ve"):
                    index = getattr(scheduler, "step_index", None)
                    sigmas = getattr(scheduler, "sigmas", None)
                    if index is not None and sigmas is not None and 0 < index <= len(sigmas):
                        sigma = sigmas[index - 1]  # step() has already moved the index on
                tracker._inputs = (model_output, timestep, sample, sigma)
            else:
                tracker._inputs = None
            return out

        scheduler.step = step
        return self

    def __exit__(self, *exc: object) -> None:
        if self._had_attr:
            self.scheduler.step = self._saved
        else:
            try:
                del self.scheduler.step
            except AttributeError:
                pass
        self._inputs = None
        self._x0 = None

    def x0(self) -> torch.Tensor | None:
        """The latest step's prediction of the clean (scaled) latent, or None."""
        if self._x0 is not None:
            return self._x0
        if self._inputs is None or self.kind is None:
            return None
        model_output, timestep, sample, sigma = self._inputs
        alpha = self._alpha(timestep, sample) if self.kind == "vp" else None
        prediction = getattr(self.scheduler.config, "prediction_type", None) or "epsilon"
        return compute_x0(self.kind, prediction, model_output, sample, sigma=sigma, alpha_cumprod=alpha)

    def _alpha(self, timestep: Any, like: torch.Tensor) -> torch.Tensor:
        # The table goes to the device once; indexing it never copies host<->device per step
        # (a blocking copy would stall the CPU until the GPU caught up, every preview).
        key = str(like.device)
        table = self._alphas.get(key)
        if table is None:
            table = self.scheduler.alphas_cumprod.to(device=like.device, dtype=torch.float32)
            self._alphas[key] = table
        shape = (1,) * like.ndim
        if isinstance(timestep, torch.Tensor) and timestep.device.type != "cpu":
            index = timestep.reshape(-1)[:1].to(device=like.device).long().clamp(0, len(table) - 1)
            return table[index].reshape(shape)
        index_int = min(max(int(timestep), 0), len(table) - 1)
        return table[index_int].reshape(shape)


def compute_x0(
    kind: str,
    prediction_type: str,
    model_output: torch.Tensor,
    sample: torch.Tensor,
    *,
    sigma: Any = None,
    alpha_cumprod: Any = None,
) -> torch.Tensor | None:
    """The clean-latent estimate from one denoiser output (float32), or None if ``kind`` needs a
    ``sigma``/``alpha_cumprod`` that is missing.

    ``kind``: ``"flow"`` (x_t = (1 - s) x0 + s noise, v = noise - x0), ``"vp"``
    (x_t = sqrt(a) x0 + sqrt(1 - a) eps) or ``"ve"`` (x_t = x0 + s eps); ``prediction_type`` as in
    diffusers scheduler configs: ``"epsilon"``, ``"v_prediction"``, ``"sample"``.

    Example:
        >>> x0, noise = torch.ones(1, 4, 2, 2), torch.zeros(1, 4, 2, 2)
        >>> xt = 0.3 * x0 + 0.7 * noise
        >>> torch.allclose(compute_x0("flow", "flow_prediction", noise - x0, xt, sigma=0.7), x0)
        True
    """
    out = model_output.float()
    x = sample.float()
    if kind == "flow":
        return None if sigma is None else x - _as_scalar(sigma, x) * out
    if prediction_type == "sample":
        return out
    if kind == "vp":
        if alpha_cumprod is None:
            return None
        a = _as_scalar(alpha_cumprod, x)
        sqrt_a, sqrt_1ma = (a.sqrt(), (1 - a).sqrt()) if isinstance(a, torch.Tensor) else (a**0.5, (1 - a) ** 0.5)
        if prediction_type == "v_prediction":
            return sqrt_a * x - sqrt_1ma * out
        return (x - sqrt_1ma * out) / sqrt_a
    if kind == "ve" and sigma is not None:
        s = _as_scalar(sigma, x)
        if prediction_type == "v_prediction":
            return out * (-s / (s**2 + 1) ** 0.5) + x / (s**2 + 1)
        return x - s * out
    return None


def _as_scalar(value: Any, like: torch.Tensor) -> Any:
    """A Python float for host values (no device copy), a float32 tensor on ``like``'s device else."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel() == 1:
            return float(value)
        return value.to(device=like.device, dtype=torch.float32)
    return float(value)


# --- latents -> pixels ------------------------------------------------------------------------


def unpack_latents(pipeline: Any, latents: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor:
    """Spatial ``(B, C, H, W)`` latents from what the pipeline holds (Flux packs 2x2 patches into
    tokens: ``(B, H*W/4, C*4)``; it is unpacked with the pipeline's own ``_unpack_latents``)."""
    if latents.ndim == 4:
        return latents
    if latents.ndim == 5:  # video-shaped (B, C, F, H, W): preview the middle frame
        return latents[:, :, latents.shape[2] // 2]
    unpack = getattr(type(pipeline), "_unpack_latents", None)
    if latents.ndim == 3 and unpack is not None and height and width:
        return unpack(latents, height, width, pipeline.vae_scale_factor)  # type: ignore[no-any-return]
    raise InvalidArgumentError(
        f"cannot preview latents of shape {tuple(latents.shape)} from {type(pipeline).__name__}; use preview='none'"
    )


@dataclass(frozen=True)
class DecoderParts:
    """What a model lends its preview decoders, each part behind a callable: only the decoder
    that is built asks for its part, so building the linear map never fits a tiny decoder, and
    building the tiny decoder never fits a linear map.

    ``latent_rgb()``: the `LatentRGB` map (may fit one on first use); ``tiny_net()``: the fitted
    `PreviewDecoderNet` (may fit one, once per VAE); ``tiny_ready()``: True when one is at hand
    without fitting; ``vae()``: the VAE previews decode with (None where the pipeline has none);
    ``taesd``: this request's TAESD model (an ``AutoencoderTiny``), or None.

    Example:
        >>> parts = DecoderParts(latent_rgb=lambda: LatentRGB(((1.0, 0.0, 0.0),) * 4, (0.0, 0.0, 0.0)),
        ...                      tiny_net=lambda: None, vae=lambda: None)
        >>> make_decoder("linear", parts).name
        'linear'
    """

    latent_rgb: Callable[[], LatentRGB]
    tiny_net: Callable[[], Any]
    vae: Callable[[], Any]
    tiny_ready: Callable[[], bool] = lambda: False
    taesd: Any = None


class PreviewDecoder:
    """One way from scaled latents to pixels: the interface of every entry of `DECODERS`.

    ``decode(latents)`` takes the spatial latents the denoiser sees, ``(B, C, h, w)`` (after
    ``scaling_factor``/``shift_factor``), and returns RGB ``(B, 3, H, W)`` float32 in [0, 1] on
    the model's device; calling the decoder does the same. ``from_parts`` builds one from a
    model's `DecoderParts`; ``ready`` says whether that works without fitting or downloading
    anything (what ``PreviewPlan.prefer`` asks).

    Example:
        >>> sorted(DECODERS), all(issubclass(c, PreviewDecoder) for c in DECODERS.values())
        (['linear', 'taesd', 'tiny', 'vae'], True)
    """

    name: ClassVar[str] = ""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - every entry of DECODERS has its own

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decode(latents)

    @classmethod
    def from_parts(cls, parts: DecoderParts) -> PreviewDecoder:
        raise NotImplementedError  # pragma: no cover

    @classmethod
    def ready(cls, parts: DecoderParts) -> bool:
        return True


class LinearDecoder(PreviewDecoder):
    """Scaled latents -> RGB in [0, 1] with a `LatentRGB` map: one small matrix product, at the
    latent's own size (e.g. 64 px for a 512 px image).

    Example:
        >>> lrgb = LatentRGB(((1.0, 0.0, 0.0),) * 4, (0.0, 0.0, 0.0))
        >>> LinearDecoder(lrgb)(torch.zeros(1, 4, 2, 2)).shape
        torch.Size([1, 3, 2, 2])
    """

    name = "linear"

    def __init__(self, latent_rgb: LatentRGB) -> None:
        self.latent_rgb = latent_rgb

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents_to_rgb(latents, self.latent_rgb)

    @classmethod
    def from_parts(cls, parts: DecoderParts) -> LinearDecoder:
        return cls(parts.latent_rgb())


class TinyDecoder(PreviewDecoder):
    """Scaled latents -> RGB in [0, 1] with a fitted `PreviewDecoderNet` (float32, on its device).

    Example:
        >>> from multistream.diffusion._preview_decoder import PreviewDecoderNet
        >>> TinyDecoder(PreviewDecoderNet(4, 8))(torch.zeros(1, 4, 2, 2)).shape
        torch.Size([1, 3, 16, 16])
    """

    name = "tiny"

    def __init__(self, net: Any) -> None:
        self.net = net
        self.device = next(net.parameters()).device

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.net(latents.to(device=self.device, dtype=torch.float32))
            return out.add_(1.0).mul_(0.5).clamp_(0.0, 1.0)

    @classmethod
    def from_parts(cls, parts: DecoderParts) -> TinyDecoder:
        return cls(parts.tiny_net())

    @classmethod
    def ready(cls, parts: DecoderParts) -> bool:
        return parts.tiny_ready()


class VaeDecoder(PreviewDecoder):
    """Scaled latents -> RGB in [0, 1] with a VAE (``AutoencoderKL``, ``AutoencoderTiny``, ...).

    The latents are unscaled with the *decoder's* config (``scaling_factor``, ``shift_factor``),
    as a pipeline would if that VAE were its own, so TAESD models decode pipeline latents directly.

    Example:
        >>> rgb = VaeDecoder(sd.pipeline.vae)(latents)                  # doctest: +SKIP
    """

    name = "vae"

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        param = next(vae.parameters())
        self.dtype = param.dtype
        self.device = param.device

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        raw = latents_to_vae_space(latents.to(device=self.device, dtype=self.dtype), self.vae.config)
        out = self.vae.decode(raw)
        image = out.sample if hasattr(out, "sample") else out[0]
        return image.float().add_(1.0).mul_(0.5).clamp_(0.0, 1.0)

    @classmethod
    def from_parts(cls, parts: DecoderParts) -> VaeDecoder:
        vae = parts.vae()
        if vae is None:
            raise InvalidArgumentError("this pipeline has no VAE, so previews cannot use one; use preview='latent'")
        return cls(vae)

    @classmethod
    def ready(cls, parts: DecoderParts) -> bool:
        return parts.vae() is not None


class TaesdDecoder(VaeDecoder):
    """Scaled latents -> RGB in [0, 1] with TAESD (a diffusers ``AutoencoderTiny``), which
    decodes the pipeline's latents like its VAE would, at a fraction of the cost.

    Example:
        >>> rgb = TaesdDecoder(load_taesd("./taesd", device, dtype))(latents)   # doctest: +SKIP
    """

    name = "taesd"

    @classmethod
    def from_parts(cls, parts: DecoderParts) -> TaesdDecoder:
        if parts.taesd is None:
            raise InvalidArgumentError(
                "TAESD previews need TAESD weights: pass taesd= (a folder with a diffusers AutoencoderTiny, or the "
                "object) to load_image_model(...) or stream(...)"
            )
        return cls(parts.taesd)

    @classmethod
    def ready(cls, parts: DecoderParts) -> bool:
        return parts.taesd is not None


#: The preview decoders by name: ``PreviewPlan.decoder`` and ``PreviewPlan.prefer`` name them.
DECODERS: dict[str, type[PreviewDecoder]] = {
    "linear": LinearDecoder,
    "tiny": TinyDecoder,
    "taesd": TaesdDecoder,
    "vae": VaeDecoder,
}


def make_decoder(name: str, parts: DecoderParts) -> PreviewDecoder:
    """The decoder ``name`` (a key of `DECODERS`) built from ``parts``; an unknown name raises
    `InvalidArgumentError` naming the known ones.

    Example:
        >>> make_decoder("blurry", None)
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: unknown preview decoder 'blurry'; use one of ['linear', 'taesd', 'tiny', 'vae']
    """
    cls = DECODERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgumentError(f"unknown preview decoder {name!r}; use one of {sorted(DECODERS)}")
    return cls.from_parts(parts)


def settle_plan(plan: PreviewPlan, parts: DecoderParts, *, has_x0: bool = True) -> PreviewPlan:
    """``plan`` with its decoder chosen: the first of ``plan.prefer`` this model has `ready`, else
    ``plan.decoder``; the result prefers nothing. ``has_x0=False`` (the scheduler gives no x0, so
    the noisy latent is shown instead) keeps ``plan.decoder``: a fitted decoder, trained on clean
    latents, would draw the noisy latent as noise.

    Example:
        >>> parts = DecoderParts(latent_rgb=lambda: None, tiny_net=lambda: None, vae=lambda: None,
        ...                      tiny_ready=lambda: True)
        >>> settle_plan(parse_preview("x0"), parts).decoder
        'tiny'
        >>> settle_plan(parse_preview("x0"), parts, has_x0=False).decoder
        'linear'
    """
    if not plan.prefer:
        return plan
    decoder = plan.decoder
    if has_x0 or plan.source != "x0":
        for name in plan.prefer:
            cls = DECODERS.get(name)
            if cls is not None and cls.ready(parts):
                decoder = name
                break
    return dataclasses.replace(plan, decoder=decoder, prefer=())


def build_decoder(plan: PreviewPlan, parts: DecoderParts, *, has_x0: bool = True) -> PreviewDecoder | None:
    """The one place a preview decoder is made: the decoder ``plan`` asks for (settled with
    `settle_plan` if it still prefers one), built from the model's ``parts``; None for
    ``preview="none"``.

    Example:
        >>> lrgb = LatentRGB(((1.0, 0.0, 0.0),) * 4, (0.0, 0.0, 0.0))
        >>> parts = DecoderParts(latent_rgb=lambda: lrgb, tiny_net=lambda: None, vae=lambda: None)
        >>> build_decoder(parse_preview("x0"), parts).name, build_decoder(parse_preview("none"), parts)
        ('linear', None)
    """
    plan = settle_plan(plan, parts, has_x0=has_x0)
    if plan.decoder is None:
        return None
    return make_decoder(plan.decoder, parts)


def false_color(latents: torch.Tensor) -> torch.Tensor:
    """A map-free look at latents ``(B, C, H, W)``: three channels stretched to [0, 1].

    Used only where no latent->RGB map is at hand and nothing may be decoded (a cancelled run).
    """
    x = latents.float()
    if x.shape[1] >= 3:
        x = x[:, :3]
    else:
        x = x[:, :1].expand(-1, 3, -1, -1)
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    return ((x - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)


def to_uint8_frames(rgb: torch.Tensor, max_side: int | None) -> torch.Tensor:
    """``(B, 3, H, W)`` floats in [0, 1] -> ``(B, h, w, 3)`` uint8, scaled down (area average,
    i.e. antialiased) so the longer side is at most ``max_side``, on the same device."""
    height, width = rgb.shape[-2:]
    if max_side and max(height, width) > max_side:
        scale = max_side / max(height, width)
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        rgb = F.interpolate(rgb, size=size, mode="area")
    # nan_to_num: an fp16 model that overflowed must give a dark frame, not garbage bytes.
    return rgb.nan_to_num(0.0).mul(255.0).add_(0.5).clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


class HostFrames:
    """A batch of uint8 frames on their way to the CPU.

    On CUDA the copy goes into pinned memory without blocking, and a CUDA event marks its end:
    the encoder thread waits on the event, the denoising thread never does. Elsewhere the
    frames are simply moved.
    """

    def __init__(self, frames: torch.Tensor) -> None:
        self.shape = tuple(frames.shape)
        self._event: Any = None
        if frames.is_cuda:
            host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            host.copy_(frames, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host = host
        else:
            self._host = frames.cpu()

    def array(self, index: int) -> Any:
        """Frame ``index`` as an ``(h, w, 3)`` uint8 numpy array (waits for the copy if needed)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[index].numpy()


@dataclass
class PendingFrame:
    """One preview of one image of the batch, waiting for the encoder."""

    step: int
    total_steps: int
    index: int
    frames: HostFrames
    made_at: float = 0.0
    eta_s: float | None = None  # estimated seconds left when the step ended


class FrameWorker:
    """The stream's single encoder thread: encodes the newest pending frame of each image.

    ``submit`` never blocks (it replaces a frame still pending for the same image and counts it
    as dropped); ``close`` encodes what is still pending (unless ``flush=False``) and ends the
    thread, so whatever the caller emits next comes after every preview.

    ``emit(frame)`` does the encoding and sending; an exception in it stops the worker and is
    raised again by ``close``. ``inline=True`` encodes in ``submit`` itself, on the caller's
    thread: on a CPU-only machine the denoiser already uses every core, and a second thread only
    makes its OpenMP team wait for a descheduled member (measured in benchmarks/engine.py).
    """

    def __init__(self, emit: Callable[[PendingFrame], None], name: str = "multistream-frames", *, inline: bool = False) -> None:
        self._emit = emit
        self._inline = inline
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._pending: dict[int, PendingFrame] = {}
        self._closing = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.submitted = 0
        self.dropped = 0
        self.emitted = 0

    def submit(self, frame: PendingFrame) -> None:
        if self._inline:
            if self._error is None and not self._closing:
                self.submitted += 1
                try:
                    self._emit(frame)
                    self.emitted += 1
                except BaseException as exc:  # noqa: BLE001 - raised again by close(), as threaded
                    self._error = exc
            return
        with self._cond:
            if self._error is not None or self._closing:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if self._pending.pop(frame.index, None) is not None:
                self.dropped += 1
            self._pending[frame.index] = frame
            self.submitted += 1
            self._cond.notify()

    def close(self, flush: bool = True) -> None:
        with self._cond:
            self._closing = True
            if not flush:
                self.dropped += len(self._pending)
                self._pending.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending) or self._closing)
                if not self._pending:
                    return
                index = next(iter(self._pending))
                frame = self._pending.pop(index)
            try:
                self._emit(frame)
                self.emitted += 1
            except BaseException as exc:  # noqa: BLE001 - handed to the producer by close()
                with self._cond:
                    self._error = exc
                    self._pending.clear()
                return
