"""Tiny preview decoders distilled from any VAE: previews in the image's own colours, nearly free.

The linear latent->RGB map (`multistream.diffusion._latent_rgb`) is about free but only a first
approximation (RMSE 0.32 on the [-1, 1] scale for the embedded model's VAE: wrong colours, soft
shapes); the full VAE is exact but costs a large share of a denoising step. TAESD
(madebyollin/taesd) sits in between, but exists only for the families someone trained it for and
must be downloaded. `fit_preview_decoder` distils one for *any* diffusers VAE, offline, in a
minute or two on a CPU:

1. Training latents (``4 * num_images``): procedural images (the shapes scenes of `multistream._shapes` and smooth
   colour fields with hard-edged discs and squares) encoded with the VAE, plus what denoising
   makes of them before it is done: latents shrunk towards their mean and blurred (early x0
   predictions are low-contrast averages), mixtures of two images (x0 hesitates between
   candidates), and noisy ones. With no encoder, random latents stand in.
2. Targets: the VAE's own decodes of exactly those latents, so the decoder learns the decoder,
   not the data set.
3. A small convolutional network (`PreviewDecoderNet`: TAESD-like 3x3 convolutions and ReLUs at
   the latent resolution, a soft clamp on its input, then ``nearest x2`` upsampling stages and a
   final pixel shuffle up to the VAE's scale factor) is fitted with Adam on L1 + MSE.

It takes *scaled* latents, the ones the denoiser sees (after ``scaling_factor``,
``shift_factor``), like the linear map, and returns RGB in [-1, 1]. Any number of latent
channels works (4 for SD 1.x/SDXL, 16 for SD3/Flux).

Fitted decoders are saved as one safetensors file whose metadata holds the architecture and the
hash of the VAE they were fitted to; `fit_preview_decoder` caches them by that hash in
``multistream._cache.cache_dir() / "preview_decoders"``, so each VAE is fitted once. The embedded
model ships its own (``multistream/_models/shapes/preview_decoder.safetensors``), made with::

    python -m multistream fit-preview --out multistream/_models/shapes/preview_decoder.safetensors

which adds the model's own x0 estimates at every step of 32 seeded runs (`collect_x0_latents`) to
the VAE-only data: measured on x0 trajectories of other prompts, that halves the error of the
first steps' previews (mean absolute difference from the VAE's decode, 0-255: 14.8 instead of 27.8
at step 1 of 20) and trims the last step's (7.2 instead of 7.7). Everything is seeded, so the fit is
reproducible on the same torch build. ``fit_preview_decoder(vae)`` alone (what ``preview="tiny"``
does for a model that ships no decoder) needs only the VAE.

Example:
    >>> import multistream as ms
    >>> sd = ms.load_image_model()                                  # doctest: +SKIP
    >>> dec = ms.fit_preview_decoder(sd.pipeline.vae)              # doctest: +SKIP
    >>> rgb = dec(torch.randn(1, 4, 16, 16))   # (1, 3, 64, 64) in [-1, 1]   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._devices import MODULE_BUILD_LOCK
from ..errors import InvalidArgumentError, ModelLoadError
from ._latent_rgb import latents_from_vae_space, latents_to_vae_space, synthetic_images

__all__ = [
    "PREVIEW_DECODER_FILE",
    "FitProgress",
    "PreviewDecoderNet",
    "cached_preview_decoder",
    "collect_x0_latents",
    "fit_preview_decoder",
    "load_preview_decoder",
    "preview_decoder_cache_path",
    "preview_decoder_for",
    "save_preview_decoder",
    "shipped_preview_decoder_path",
    "vae_fingerprint",
]

#: The file name a model folder ships its fitted decoder under.
PREVIEW_DECODER_FILE = "preview_decoder.safetensors"
_FORMAT = "multistream-preview-decoder/1"
# Bump when the fitting recipe changes, so old cached fits are not reused for new defaults.
_RECIPE = 1


@dataclass(frozen=True)
class FitProgress:
    """What the progress callback of `fit_preview_decoder` gets: ``stage`` ("data" | "fit" |
    "done"), ``step`` of ``total`` in that stage, the running training ``loss`` and the ``elapsed``
    seconds since the fit began."""

    stage: str
    step: int
    total: int
    loss: float
    elapsed: float


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class PreviewDecoderNet(nn.Module):
    """Scaled latents ``(B, C, h, w)`` -> RGB ``(B, 3, h*f, w*f)`` in about [-1, 1].

    TAESD's decoder, narrowed: the input is soft-clamped (``3 tanh(x / 3)``: early x0 estimates
    can be wild), ``blocks`` residual blocks of ``width`` channels run at the latent resolution,
    ``stages`` times the features are upsampled (nearest, x2) and a convolution halves the width,
    then one convolution to ``3 * s * s`` channels and a pixel shuffle by ``s`` make the rest of
    the scale factor, so nothing runs at full resolution (``stages=0``: all the work is at the
    latent resolution, the cheapest). ``scale_factor`` (the VAE's: 4, 8, ...) must be a power
    of two.

    Example:
        >>> net = PreviewDecoderNet(16, 8, width=32, blocks=1, stages=1)
        >>> net(torch.zeros(1, 16, 4, 4)).shape
        torch.Size([1, 3, 32, 32])
    """

    def __init__(self, latent_channels: int, scale_factor: int, width: int = 64, blocks: int = 2, stages: int = 1) -> None:
        super().__init__()
        if scale_factor < 1 or scale_factor & (scale_factor - 1):
            raise InvalidArgumentError(f"scale_factor must be a power of two, got {scale_factor}")
        self.latent_channels = int(latent_channels)
        self.scale_factor = int(scale_factor)
        self.width = int(width)
        self.blocks = int(blocks)
        self.stages = int(stages)
        self.head = nn.Conv2d(latent_channels, width, 3, padding=1)
        self.body = nn.Sequential(*[_Residual(width) for _ in range(blocks)])
        ups: list[nn.Module] = []
        w = width
        levels = int(math.log2(scale_factor))
        stages = min(max(0, int(stages)), levels)
        for _ in range(stages):
            ups += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(w, max(8, w // 2), 3, padding=1), nn.ReLU()]
            w = max(8, w // 2)
        self.up = nn.Sequential(*ups)
        shuffle = 2 ** (levels - stages)
        self.tail = nn.Conv2d(w, 3 * shuffle * shuffle, 3, padding=1)
        self.shuffle = nn.PixelShuffle(shuffle)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(latents / 3.0) * 3.0
        x = F.relu(self.head(x))
        x = self.body(x)
        x = self.up(x)
        return self.shuffle(self.tail(x))  # type: ignore[no-any-return]

    def config(self) -> dict[str, int]:
        return {
            "latent_channels": self.latent_channels,
            "scale_factor": self.scale_factor,
            "width": self.width,
            "blocks": self.blocks,
            "stages": self.stages,
        }

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# --- files ------------------------------------------------------------------------------------


def save_preview_decoder(net: PreviewDecoderNet, path: str | os.PathLike[str], **metadata: Any) -> None:
    """Write ``net`` as one safetensors file (float32 weights; the architecture and ``metadata``,
    e.g. ``vae_hash``, in its header). Written to a temporary name and renamed, so a reader never
    sees half a file.

    Example:
        >>> save_preview_decoder(PreviewDecoderNet(4, 8), "/tmp/dec.safetensors")   # doctest: +SKIP
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": _FORMAT, "config": json.dumps(net.config())}
    meta.update({k: str(v) for k, v in metadata.items()})
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in net.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_preview_decoder(path: str | os.PathLike[str]) -> PreviewDecoderNet:
    """Read a file written by `save_preview_decoder` (float32, on the CPU, in eval mode).

    Raises `ModelLoadError` naming the file when it is not a preview decoder.

    Example:
        >>> net = load_preview_decoder("multistream/_models/shapes/preview_decoder.safetensors")  # doctest: +SKIP
    """
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"metadata format is {meta.get('format')!r}, not {_FORMAT!r}")
        config = json.loads(meta["config"])
        with MODULE_BUILD_LOCK:
            net = PreviewDecoderNet(**{k: int(v) for k, v in config.items()})
        net.load_state_dict(tensors)
    except Exception as exc:  # noqa: BLE001 - one clear error for any bad file
        raise ModelLoadError(
            f"{os.fspath(path)!r} is not a multistream preview decoder ({type(exc).__name__}: {exc}); "
            "make one with ms.fit_preview_decoder(vae) or `multistream fit-preview MODEL`"
        ) from exc
    net.vae_hash = meta.get("vae_hash")  # type: ignore[assignment]
    net.fit_info = {k: v for k, v in meta.items() if k not in ("format", "config")}  # type: ignore[assignment]
    return net.eval().requires_grad_(False)


def vae_fingerprint(vae: Any) -> str:
    """A sha256 of the VAE's class, latent convention (scaling and shift) and weights: fitted
    decoders are cached under it, so any change to the VAE gets a new fit.

    Example:
        >>> vae_fingerprint(sd.pipeline.vae)[:12]                      # doctest: +SKIP
        '3f6c0a9d2b71'
    """
    h = hashlib.sha256()
    config = getattr(vae, "config", None)
    convention = {
        k: getattr(config, k, None)
        for k in ("latent_channels", "scaling_factor", "shift_factor", "latents_mean", "latents_std")
    }
    h.update(type(vae).__name__.encode())
    h.update(json.dumps(convention, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in sorted(vae.state_dict().items()):
            h.update(name.encode())
            h.update(str(tuple(tensor.shape)).encode())
            h.update(str(tensor.dtype).encode())
            # Bytes as stored: a float16 copy of a VAE is a different decoder and gets its own fit.
            h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def preview_decoder_cache_path(fingerprint: str, options: dict[str, Any] | None = None) -> Path:
    """Where the fit for a VAE with this `vae_fingerprint` (and these fit options) is cached."""
    from .._cache import cache_dir

    tag = ""
    if options:
        tag = "-" + hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir() / "preview_decoders" / f"{fingerprint[:32]}-r{_RECIPE}{tag}.safetensors"


# --- fitting ------------------------------------------------------------------------------------


def _vae_device_dtype(vae: Any) -> tuple[torch.device, torch.dtype]:
    param = next(vae.parameters())
    return param.device, param.dtype


def _decode_scaled(vae: Any, scaled: torch.Tensor, batch: int,
                   done: Callable[[int], Any] | None = None) -> torch.Tensor:
    """The VAE's decode of scaled latents, in [-1, 1] float32 on the CPU (the training target);
    ``done(n)`` after each batch of ``n``."""
    device, dtype = _vae_device_dtype(vae)
    out = []
    for chunk in scaled.split(batch):
        if out and done is not None:
            done(len(out[-1]))
        raw = latents_to_vae_space(chunk.to(device=device, dtype=torch.float32), vae.config).to(dtype)
        decoded = vae.decode(raw)
        image = decoded.sample if hasattr(decoded, "sample") else decoded[0]
        out.append(image.float().nan_to_num(0.0).clamp(-1, 1).cpu())
    if out and done is not None:
        done(len(out[-1]))
    return torch.cat(out)


def _encode_scaled(vae: Any, images: torch.Tensor, batch: int) -> torch.Tensor | None:
    if getattr(vae, "encoder", None) is None or not hasattr(vae, "encode"):
        return None
    device, dtype = _vae_device_dtype(vae)
    out = []
    try:
        for chunk in images.split(batch):
            encoded = vae.encode(chunk.to(device=device, dtype=dtype))
            dist = getattr(encoded, "latent_dist", None)
            raw = dist.mode() if dist is not None else getattr(encoded, "latents", None)
            if raw is None:
                raw = encoded[0]
            out.append(latents_from_vae_space(raw.float(), vae.config).cpu())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError):
        return None
    return torch.cat(out)


def _shapes_images(n: int, size: int, seed: int) -> torch.Tensor:
    from .._shapes import make_dataset

    images, _ = make_dataset(n, seed=seed, size=size)
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def _blur(x: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """Per-sample mix of ``x`` and a 5x5 box blur of it (``amount`` in [0, 1])."""
    soft = F.avg_pool2d(F.pad(x, (2, 2, 2, 2), mode="replicate"), 5, stride=1)
    return x + amount.view(-1, 1, 1, 1) * (soft - x)


def _training_latents(clean: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Clean latents plus what denoising makes of them on the way (see the module docstring)."""
    n = len(clean)
    spread = clean.std().clamp_min(1e-3)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=generator)

    mean = clean.mean(dim=(2, 3), keepdim=True)
    # Early x0: low contrast around the mean, blurred.
    shrink = mean + (0.15 + 0.85 * rand(n, 1, 1, 1)) * (clean - mean)
    shrink = _blur(shrink, rand(n))
    # Undecided x0: a weighted mixture of two images.
    other = clean[torch.randperm(n, generator=generator)]
    weight = 0.2 + 0.6 * rand(n, 1, 1, 1)
    mixed = weight * clean + (1 - weight) * other
    # Imperfect x0: some noise on the clean latents.
    noisy = clean + 0.4 * spread * rand(n, 1, 1, 1) * torch.randn(clean.shape, generator=generator)
    return torch.cat([clean, shrink, mixed, noisy])


def _fit_options(num_images: int, latent_size: int, steps: int, width: int, blocks: int, stages: int, seed: int) -> dict[str, Any]:
    return {"num_images": num_images, "latent_size": latent_size, "steps": steps, "width": width, "blocks": blocks,
            "stages": stages, "seed": seed}  # fmt: skip


_DEFAULTS = _fit_options(256, 16, 1500, 64, 2, 0, 0)
_memory: weakref.WeakKeyDictionary[Any, dict[str, PreviewDecoderNet]] = weakref.WeakKeyDictionary()
_memory_lock = threading.Lock()


def fit_preview_decoder(
    vae: Any,
    *,
    num_images: int = _DEFAULTS["num_images"],
    latent_size: int = _DEFAULTS["latent_size"],
    steps: int = _DEFAULTS["steps"],
    width: int = _DEFAULTS["width"],
    blocks: int = _DEFAULTS["blocks"],
    stages: int = _DEFAULTS["stages"],
    seed: int = _DEFAULTS["seed"],
    extra_latents: torch.Tensor | None = None,
    progress: Callable[[FitProgress], Any] | None = None,
    cache: bool = True,
    device: str | torch.device | None = None,
) -> PreviewDecoderNet:
    """Distil a tiny preview decoder (`PreviewDecoderNet`) from a diffusers VAE.

    ``vae``: any diffusers autoencoder with ``decode`` (``AutoencoderKL``, SD3/Flux's 16-channel
    ones, ...), on any device; an encoder, if it has one, makes the training latents realistic.
    ``num_images`` procedural images of ``latent_size`` squared latents give ``4 * num_images``
    training latents (see the module docstring), all decoded once by ``vae``; then ``steps``
    Adam steps fit a network of ``width`` channels and ``blocks`` residual blocks (the defaults:
    178k parameters for a 4-channel, x4 VAE, 261k for an x8 one; about 2 ms per 64x64 preview on a 2-core CPU). ``extra_latents`` (scaled,
    ``(N, C, h, w)``, e.g. x0 predictions collected from pipeline runs) are added to the data.

    ``progress`` is called with a `FitProgress` as the data is made (``"data"``: latents encoded
    and decoded so far, of all; the decode of every training latent is most of it) and every few
    steps of the fit.
    The result is cached by `vae_fingerprint` and the options, in memory and in
    ``cache_dir()/preview_decoders`` (``cache=False``: neither read nor written; ``extra_latents``
    also skip the cache, since they are not part of the key). Returned on the VAE's device, in
    float32, in eval mode; ``net(latents)`` maps scaled latents to RGB in [-1, 1].

    Example:
        >>> import multistream as ms
        >>> vae = ms.load_image_model().pipeline.vae                          # doctest: +SKIP
        >>> dec = ms.fit_preview_decoder(vae, progress=print)                 # doctest: +SKIP
        >>> dec.num_parameters()                                              # doctest: +SKIP
        177776
    """
    for name, value, low in (("num_images", num_images, 2), ("latent_size", latent_size, 2), ("steps", steps, 1),
                             ("width", width, 4), ("blocks", blocks, 0), ("stages", stages, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidArgumentError(f"fit_preview_decoder: {name} must be an integer >= {low}, got {value!r}")
    if not hasattr(vae, "decode") or not hasattr(vae, "parameters") or getattr(vae, "config", None) is None:
        raise InvalidArgumentError(f"fit_preview_decoder needs a diffusers VAE (with decode and config), got {type(vae).__name__}")
    vae_device, _ = _vae_device_dtype(vae)
    options = _fit_options(num_images, latent_size, steps, width, blocks, stages, seed)
    use_cache = cache and extra_latents is None
    key = json.dumps(options, sort_keys=True)
    if use_cache:
        with _memory_lock:
            try:
                hit = _memory.get(vae, {}).get(key)
            except TypeError:
                hit = None
        if hit is not None:
            return hit
        fingerprint = vae_fingerprint(vae)
        path = preview_decoder_cache_path(fingerprint, None if options == _DEFAULTS else options)
        if path.is_file():
            try:
                net = load_preview_decoder(path)
            except ModelLoadError:
                net = None  # a damaged cache file is simply fitted again
            if net is not None and net.vae_hash == fingerprint:
                net = net.to(vae_device)
                _remember(vae, key, net)
                return net
    started = time.perf_counter()

    def report(stage: str, step: int, total: int, loss: float = float("nan")) -> None:
        if progress is not None:
            progress(FitProgress(stage, step, total, loss, time.perf_counter() - started))

    train_device = torch.device(device) if device is not None else vae_device
    channels = int(vae.config.latent_channels)
    gen = torch.Generator("cpu").manual_seed(seed)
    count = 4 * num_images + (len(extra_latents) if extra_latents is not None else 0)
    work = num_images + count  # images encoded, then every training latent decoded
    report("data", 0, work)
    with torch.inference_mode():
        # The decoder's scale factor, measured rather than read from configs that differ per class.
        probe = _decode_scaled(vae, torch.zeros(1, channels, 2, 2), 1)
        factor = max(1, probe.shape[-1] // 2)
        size = latent_size * factor
        half = num_images // 2
        images = torch.cat([_shapes_images(half, size, seed), synthetic_images(num_images - half, size, gen)])
        batch = max(1, 8192 // (latent_size * latent_size))
        clean = _encode_scaled(vae, images, batch)
        if clean is None or clean.shape[1:] != (channels, latent_size, latent_size):
            clean = torch.randn(num_images, channels, latent_size, latent_size, generator=gen)
        made = num_images
        report("data", made, work)
        inputs = _training_latents(clean, gen)
        if extra_latents is not None:
            inputs = torch.cat([inputs, extra_latents.float().cpu()])

        def decoded(n: int) -> None:
            nonlocal made
            made += n
            report("data", min(made, work), work)

        targets = _decode_scaled(vae, inputs, batch, decoded)
    if targets.shape[-1] != inputs.shape[-1] * factor:
        raise InvalidArgumentError(f"the VAE's decodes are {targets.shape[-1]} px for {inputs.shape[-1]} latents: not a power-of-two scale factor")
    report("data", work, work)

    # The caller may be inside torch.inference_mode (a stream's producer fitting on first use):
    # training needs autograd, and tensors made in inference mode are cloned out of it.
    with torch.inference_mode(False), torch.enable_grad():
        net = _train(channels, factor, width, blocks, stages, seed, steps, inputs.clone(), targets.clone(), train_device, gen, report)
    net = net.eval().requires_grad_(False).to(vae_device)
    net.vae_hash = None  # type: ignore[assignment]
    net.fit_info = {"fit_seconds": f"{time.perf_counter() - started:.1f}", "options": key}  # type: ignore[assignment]
    if use_cache:
        net.vae_hash = fingerprint  # type: ignore[assignment]
        save_preview_decoder(net, path, vae_hash=fingerprint, **net.fit_info)  # type: ignore[arg-type]
        _remember(vae, key, net)
    report("done", steps, steps)
    return net


def _train(
    channels: int,
    factor: int,
    width: int,
    blocks: int,
    stages: int,
    seed: int,
    steps: int,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    gen: torch.Generator,
    report: Callable[..., None],
) -> PreviewDecoderNet:
    torch.manual_seed(seed)  # the initial weights
    with MODULE_BUILD_LOCK:
        net = PreviewDecoderNet(channels, factor, width=width, blocks=blocks, stages=stages).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    inputs, targets = inputs.to(device), targets.to(device)
    batch_size = 32
    running = float("nan")
    every = max(1, steps // 100)
    for step in range(1, steps + 1):
        index = torch.randint(len(inputs), (batch_size,), generator=gen).to(device)
        x, y = inputs[index], targets[index]
        if step % 2:  # flips: the decoder should not care about orientation
            x, y = x.flip(-1), y.flip(-1)
        out = net(x)
        loss = F.l1_loss(out, y) + F.mse_loss(out, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        value = float(loss.detach())
        running = value if math.isnan(running) else 0.95 * running + 0.05 * value
        if step % every == 0 or step == steps:
            report("fit", step, steps, running)
    return net


def _remember(vae: Any, key: str, net: PreviewDecoderNet) -> None:
    with _memory_lock:
        try:
            _memory.setdefault(vae, {})[key] = net
        except TypeError:  # not weak-referenceable: the disk cache still holds it
            pass


# --- which decoder a pipeline previews with -----------------------------------------------------

_folder_cache: dict[str, PreviewDecoderNet] = {}


def shipped_preview_decoder_path(model_dir: str | os.PathLike[str] | None) -> Path | None:
    """The ``preview_decoder.safetensors`` a model folder ships, if it has one."""
    if not model_dir:
        return None
    path = Path(model_dir) / PREVIEW_DECODER_FILE
    return path if path.is_file() else None


def preview_decoder_for(
    pipeline: Any,
    model_dir: str | os.PathLike[str] | None = None,
    *,
    fit: bool = True,
    progress: Callable[[FitProgress], Any] | None = None,
) -> PreviewDecoderNet | None:
    """Choose the preview decoder of a pipeline: the model folder's ``preview_decoder.safetensors``,
    else `fit_preview_decoder` on its VAE (from the cache after the first time). None when the
    pipeline has no VAE, or nothing is shipped and ``fit`` is False.

    Example:
        >>> net = preview_decoder_for(sd.pipeline, EMBEDDED_MODEL_DIR)   # doctest: +SKIP
    """
    vae = getattr(pipeline, "vae", None)
    folders = [model_dir, getattr(getattr(pipeline, "config", None), "_name_or_path", None)]
    for folder in folders:
        path = shipped_preview_decoder_path(folder) if isinstance(folder, (str, os.PathLike)) else None
        if path is None:
            continue
        key = os.fspath(path.resolve())
        with _memory_lock:
            net = _folder_cache.get(key)
        if net is None:
            net = load_preview_decoder(path)
            with _memory_lock:
                _folder_cache[key] = net
        channels = int(getattr(getattr(vae, "config", None), "latent_channels", net.latent_channels) or net.latent_channels)
        if net.latent_channels == channels:
            # A copy: each model moves its decoder to its own device, the loaded file stays put.
            return copy.deepcopy(net)
    if vae is None or not fit:
        return None
    return fit_preview_decoder(vae, progress=progress)


def cached_preview_decoder(vae: Any, *, disk: bool = True) -> PreviewDecoderNet | None:
    """A decoder fitted before for this VAE, without fitting one: from memory (any options, the
    defaults first), else (``disk``) from the cache a default `fit_preview_decoder` writes.
    None when there is none. The disk look-up hashes the VAE's weights (`vae_fingerprint`), so
    callers that ask often look on disk once.

    Example:
        >>> cached_preview_decoder(sd.pipeline.vae) is None             # doctest: +SKIP
        True
    """
    if vae is None or not hasattr(vae, "parameters") or getattr(vae, "config", None) is None:
        return None
    default_key = json.dumps(_DEFAULTS, sort_keys=True)
    with _memory_lock:
        try:
            fits = dict(_memory.get(vae, {}))
        except TypeError:
            fits = {}
    if fits:
        return fits.get(default_key) or next(iter(fits.values()))
    if not disk:
        return None
    try:
        device, _ = _vae_device_dtype(vae)
    except StopIteration:
        return None
    fingerprint = vae_fingerprint(vae)
    path = preview_decoder_cache_path(fingerprint)
    if not path.is_file():
        return None
    try:
        net = load_preview_decoder(path)
    except ModelLoadError:
        return None  # a damaged file: fit_preview_decoder would fit again, nothing is at hand
    if net.vae_hash != fingerprint:
        return None
    net = net.to(device)
    _remember(vae, default_key, net)
    return net


GENERIC_PROMPTS = (
    "a photo of a cat on a sofa", "a mountain lake at sunrise", "a red sports car in the city", "a bowl of fruit",
    "a portrait of an old man", "a watercolor of a forest", "a lighthouse at dusk", "a bright abstract painting",
)  # fmt: skip


def collect_x0_latents(
    pipeline: Any,
    prompts: list[str] | None = None,
    *,
    count: int = 32,
    steps: int = 20,
    seed: int = 0,
    batch: int = 8,
    progress: Callable[[int, int], Any] | None = None,
    progress_steps: bool = False,
) -> torch.Tensor:
    """The model's x0 estimates at every step of a few runs, ``(runs * steps, C, h, w)`` scaled
    latents: the inputs a preview decoder really gets, as ``extra_latents`` for
    `fit_preview_decoder`. ``prompts`` default to ``count`` shapes captions for the embedded model
    (generic ones otherwise would do as well for a general model). Seeded. ``progress(done,
    total)`` is called as runs finish, or (``progress_steps``) as steps finish, counted over
    all runs (a batch of runs takes its steps together).

    Example:
        >>> x0 = collect_x0_latents(sd.pipeline, count=8, steps=10)     # doctest: +SKIP
        >>> net = fit_preview_decoder(sd.pipeline.vae, extra_latents=x0, cache=False)  # doctest: +SKIP
    """
    from ._previews import X0Tracker, unpack_latents

    if prompts is None:
        from .._shapes import caption, make_dataset

        _, scenes = make_dataset(count, seed=999)
        prompts = [caption(s) for s in scenes]
    found: list[torch.Tensor] = []
    done = 0
    total_steps = len(prompts) * steps
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        gens = [torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))]

        def callback(pipe: Any, i: int, t: Any, kwargs: dict[str, Any],
                     steps_before: int = done * steps, runs: int = len(chunk)) -> dict[str, Any]:
            x0 = tracker.x0()
            latents = kwargs["latents"] if x0 is None else x0
            side = None
            if latents.ndim == 3:  # packed tokens (Flux), square by default: 2x2 latents per token
                side = math.isqrt(latents.shape[1]) * 2 * int(getattr(pipe, "vae_scale_factor", 8))
            found.append(unpack_latents(pipe, latents, side, side).float().cpu())
            if progress is not None and progress_steps:
                progress(steps_before + (i + 1) * runs, total_steps)
            return kwargs

        with torch.inference_mode(), X0Tracker(pipeline.scheduler) as tracker:
            pipeline(chunk, num_inference_steps=steps, generator=gens, output_type="latent",
                     callback_on_step_end=callback)  # fmt: skip
        done += len(chunk)
        if progress is not None and not progress_steps:
            progress(done, len(prompts))
    return torch.cat(found)
