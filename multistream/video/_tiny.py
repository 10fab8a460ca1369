"""A tiny video decoder fitted to a model's own VAE: the ``"tiny"`` preview of 3D-VAE families.

TAEHV's idea (madebyollin/taehv), narrowed and fitted here instead of downloaded: every layer is
a per-frame 2D convolution; time enters through *memory blocks* (each frame's features are
concatenated with the previous frame's, zeros for the first) and one *temporal upsampler* (a 1x1
convolution to ``temporal`` times the channels, split into that many frames; a causal VAE's first
latent frame makes one frame, so the first ``temporal - 1`` are dropped). A pixel shuffle makes
the spatial factor. It runs on all frames at once (the memory is a shift in time).

`fit_video_preview_decoder` distils it from the VAE: synthetic clips of moving discs and squares
are encoded by the VAE (random latents where it cannot encode), perturbed like early-step
estimates (noise, blur), decoded by the VAE, and the net learns that mapping. Fitted once per
VAE: kept in memory per VAE object and on disk under the VAE's weights' fingerprint (the image
family's cache directory), so a later process loads it in a moment. A 2D image VAE (AnimateDiff) needs none of this: the image family's
fitted decoder runs per frame (`multistream.image.fit_preview_decoder`).

Example:
    >>> net = VideoPreviewNet(16, spatial=8, temporal=4, width=16)
    >>> net(torch.zeros(1, 16, 3, 2, 2)).shape       # 3 latent frames -> 9 frames of 16 x 16
    torch.Size([1, 3, 9, 16, 16])
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._devices import MODULE_BUILD_LOCK
from ..errors import InvalidArgumentError
from ._layout import VideoLatents

_RECIPE = 1  # bump when the fitting recipe changes, so old cached fits are not reused

__all__ = ["VideoPreviewNet", "cached_video_preview_decoder", "fit_video_preview_decoder", "load_video_preview_decoder",
           "moving_shapes", "save_video_preview_decoder"]

logger = logging.getLogger("multistream")


class _MemBlock(nn.Module):
    """Convolutions over this frame's features next to the previous frame's (TAEHV's MemBlock)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2 * width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, W, h, w)
        past = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        b, t = x.shape[:2]
        flat = torch.cat([x, past], dim=2).flatten(0, 1)
        out = self.conv2(F.relu(self.conv1(flat)))
        return F.relu(x + out.view(b, t, *out.shape[1:]))


class VideoPreviewNet(nn.Module):
    """Denoiser latents ``(B, C, T', h, w)`` -> RGB ``(B, 3, T, h*s, w*s)`` in about [0, 1], where
    ``T = (T' - 1) * temporal + 1`` (``T'`` when ``temporal`` is 1) and ``s`` is ``spatial``."""

    def __init__(self, latent_channels: int, *, spatial: int, temporal: int, width: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.latent_channels, self.spatial, self.temporal = int(latent_channels), int(spatial), int(temporal)
        self.width, self.blocks = int(width), int(blocks)
        self.head = nn.Conv2d(latent_channels, width, 3, padding=1)
        self.mem = nn.ModuleList(_MemBlock(width) for _ in range(blocks))
        self.grow = nn.Conv2d(width, width * temporal, 1) if temporal > 1 else None
        # Half the spatial factor as one nearest upsample + conv where it is large (LTX: 32x), the
        # rest by a pixel shuffle, so no convolution runs at full resolution.
        self.pre = 2 if spatial >= 16 else 1
        self.up = nn.Conv2d(width, width, 3, padding=1) if self.pre > 1 else None
        shuffle = spatial // self.pre
        self.tail = nn.Conv2d(width, 3 * shuffle * shuffle, 3, padding=1)
        self.shuffle = nn.PixelShuffle(shuffle)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        b, _, t = latents.shape[:3]
        x = torch.tanh(latents.permute(0, 2, 1, 3, 4) / 3.0) * 3.0  # early estimates can be wild
        x = F.relu(self.head(x.flatten(0, 1)))
        x = x.view(b, t, *x.shape[1:])
        for block in self.mem:
            x = block(x)
        if self.grow is not None:
            g = self.grow(x.flatten(0, 1)).view(b, t, self.temporal, self.width, *x.shape[-2:])
            x = g.flatten(1, 2)[:, self.temporal - 1 :]
        frames = x.shape[1]
        y = x.flatten(0, 1)
        if self.up is not None:
            y = F.relu(self.up(F.interpolate(y, scale_factor=self.pre, mode="nearest")))
        rgb = self.shuffle(self.tail(y)) * 0.5 + 0.5
        return rgb.view(b, frames, *rgb.shape[1:]).permute(0, 2, 1, 3, 4)


def moving_shapes(n: int, frames: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` clips ``(n, 3, frames, size, size)`` in [0, 1]: a flat or smooth background with a few
    flat discs and squares, each moving in a straight line (the look of the embedded model's clips)."""
    clips = torch.empty(n, 3, frames, size, size)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
    for i in range(n):
        coarse = torch.rand(1, 3, 3, 3, generator=generator)
        background = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)[0]
        if i % 2 == 0:
            background = torch.rand(3, 1, 1, generator=generator).expand(3, size, size)
        shapes = []
        for k in range(3):
            start = torch.rand(2, generator=generator) * size
            velocity = (torch.rand(2, generator=generator) - 0.5) * size / max(1, frames) * 1.5
            r = float(torch.rand(1, generator=generator)) * size / 4 + size / 10
            shapes.append((start, velocity, r, torch.rand(3, 1, 1, generator=generator), k % 2))
        for f in range(frames):
            img = background.clone()
            for start, velocity, r, color, square in shapes:
                cx, cy = (start + velocity * f).tolist()
                mask = (((xx - cx).abs() < r) & ((yy - cy).abs() < r)) if square else ((xx - cx) ** 2 + (yy - cy) ** 2 < r * r)
                img = torch.where(mask, color, img)
            clips[i, :, f] = img
    return clips


_memory: weakref.WeakKeyDictionary[Any, VideoPreviewNet] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _cache_path(vae: Any, options: dict[str, Any]) -> Path:
    from .._cache import cache_dir
    from ..diffusion._preview_decoder import vae_fingerprint

    tag = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir() / "video_preview_decoders" / f"{vae_fingerprint(vae)[:32]}-r{_RECIPE}-{tag}.safetensors"


def save_video_preview_decoder(net: VideoPreviewNet, path: str | os.PathLike[str]) -> None:
    """Write ``net`` as `load_video_preview_decoder` reads it (a model folder's
    ``preview_decoder.safetensors``, so its users need no fit), atomically."""
    path = Path(path)
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"latent_channels": net.latent_channels, "spatial": net.spatial, "temporal": net.temporal,
              "width": net.width, "blocks": net.blocks}
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in net.state_dict().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # never half a file
    save_file(tensors, str(tmp), metadata={"config": json.dumps(config), "fit_seconds": str(getattr(net, "fit_seconds", ""))})
    os.replace(tmp, path)


def load_video_preview_decoder(path: str | os.PathLike[str]) -> VideoPreviewNet | None:
    """A `VideoPreviewNet` saved by this module (a model folder's ``preview_decoder.safetensors``),
    or None where the file is not one (an image decoder, a damaged file)."""
    return _load(Path(path))


def _load(path: Path) -> VideoPreviewNet | None:
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        config = json.loads(meta["config"])
        with MODULE_BUILD_LOCK:
            net = VideoPreviewNet(config.pop("latent_channels"), **config)
        net.load_state_dict(tensors)
    except Exception:  # noqa: BLE001 - a damaged or old file: fit again
        logger.warning("ignoring the unreadable video preview decoder %s (fitting one instead)", path)
        return None
    net.fit_seconds = float(meta.get("fit_seconds") or 0.0)  # type: ignore[assignment]
    return net.eval().requires_grad_(False)


def cached_video_preview_decoder(vae: Any) -> VideoPreviewNet | None:
    """The decoder fitted before for this VAE object (in memory), or None (nothing is fitted here)."""
    with _lock:
        try:
            return _memory.get(vae)
        except TypeError:
            return None


def _remember(vae: Any, net: VideoPreviewNet) -> None:
    with _lock:
        try:
            _memory[vae] = net
        except TypeError:
            pass


def fit_video_preview_decoder(
    vae: Any, *, steps: int = 300, num_clips: int = 6, latent_frames: int = 3, latent_size: int = 6,
    width: int = 32, blocks: int = 2, seed: int = 0, cache: bool = True,
) -> VideoPreviewNet:
    """Fit a `VideoPreviewNet` to a 3D video VAE (Wan, CogVideoX, LTX-Video); see the module docstring.

    Costs ``num_clips * 3`` VAE decodes of ``latent_frames`` latent frames plus ``steps`` Adam
    steps of the tiny net. Cached per VAE (in memory, and on disk by the weights' fingerprint and
    these options) unless ``cache=False``; the fit time is in ``net.fit_seconds``.

    Example:
        >>> net = fit_video_preview_decoder(pipe.vae)               # doctest: +SKIP
    """
    options = {"steps": steps, "num_clips": num_clips, "latent_frames": latent_frames, "latent_size": latent_size,
               "width": width, "blocks": blocks, "seed": seed}
    path: Path | None = None
    if cache:
        hit = cached_video_preview_decoder(vae)
        if hit is not None:
            return hit
        path = _cache_path(vae, options)
        loaded = _load(path) if path.is_file() else None
        if loaded is not None:
            loaded = loaded.to(next(vae.parameters()).device)
            _remember(vae, loaded)
            return loaded
    if steps < 1 or num_clips < 1 or latent_frames < 1 or latent_size < 1:
        raise InvalidArgumentError("fit_video_preview_decoder needs steps, num_clips, latent_frames and latent_size >= 1")
    started = time.perf_counter()
    layout = VideoLatents.for_vae(vae)
    if layout.per_frame:
        raise InvalidArgumentError(
            f"{type(vae).__name__} is a 2D image VAE; fit its per-frame decoder with multistream.fit_preview_decoder(vae)"
        )
    param = next(vae.parameters())
    device = param.device
    gen = torch.Generator("cpu").manual_seed(seed)
    channels = int(vae.config.latent_channels if hasattr(vae.config, "latent_channels") else vae.config.z_dim)
    frames = layout.output_frames(latent_frames)
    size = latent_size * layout.spatial
    clips = moving_shapes(num_clips, frames, size, gen)
    clean = layout.encode(clips)
    if clean is None or clean.shape[-3:] != (latent_frames, latent_size, latent_size):
        clean = torch.randn(num_clips, channels, latent_frames, latent_size, latent_size, generator=gen)
    clean = clean.float().cpu()
    spread = clean.std().clamp_min(1e-3)
    # What a preview decodes mid-run: the clean estimate, plus noise (early steps) and blur.
    noisy = clean + 0.4 * spread * torch.randn(clean.shape, generator=gen)
    blurred = F.avg_pool3d(F.pad(clean, (1, 1, 1, 1, 0, 0), mode="replicate"), (1, 3, 3), stride=1)
    inputs = torch.cat([clean, noisy, blurred])
    with torch.inference_mode():
        targets = torch.cat([layout.decode(inputs[i : i + 2]).float().cpu() for i in range(0, len(inputs), 2)])
    with MODULE_BUILD_LOCK:
        net = VideoPreviewNet(channels, spatial=layout.spatial, temporal=layout.temporal, width=width, blocks=blocks)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    batch = min(4, len(inputs))
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, len(inputs), (batch,), generator=gen)
            loss = F.l1_loss(net(inputs[idx]), targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    net.eval().requires_grad_(False)
    net = net.to(device)
    net.fit_seconds = time.perf_counter() - started  # type: ignore[assignment]
    net.fit_loss = float(loss.detach())  # type: ignore[assignment]
    logger.info("fitted a video preview decoder to %s in %.1f s (L1 %.3f)", type(vae).__name__, net.fit_seconds, net.fit_loss)
    if cache and path is not None:
        _remember(vae, net)
        try:
            save_video_preview_decoder(net, path)
        except OSError:  # a read-only cache only costs the next process a fit
            logger.warning("could not write the video preview decoder cache %s", path, exc_info=True)
    return net
