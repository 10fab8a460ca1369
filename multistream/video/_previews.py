"""Video previews: every frame's current estimate, from ``(B, C, F', H', W')`` latents to uint8 frames.

==============  =====================  ==================================================
``preview=``    picture                decoder
==============  =====================  ==================================================
``"latent"``    the noisy latent       a linear latent->RGB map fitted per VAE (published
                                       or shipped where one exists): about free, one
                                       latent-sized picture per latent frame, repeated in
                                       time to the clip's frame count
``"x0"``        the clean estimate     the same linear map
``"tiny"``      the clean estimate     a tiny decoder fitted to the VAE: per frame, the
                                       image family's fitted decoder for a 2D VAE
                                       (AnimateDiff); `VideoPreviewNet` (memory of the
                                       previous frame, temporal upsampler) for a 3D VAE
``"vae"``       the clean estimate     the full VAE: what the final will be, slowest
``"none"``      -                      no previews
==============  =====================  ==================================================

A clean-estimate preview is what the model would give if it stopped now, so the previews converge
to the final clip. Each decoder's frames are resampled in time to the clip's frame count (a
causal VAE's first latent frame makes one frame, each later one ``temporal``) and scaled down to
``preview_max_side``.

Example:
    >>> import torch
    >>> from multistream.diffusion._latent_rgb import LatentRGB
    >>> m = LatentRGB(((1.0, 0.0, 0.0),) * 4, (0.0, 0.0, 0.0))
    >>> linear_frames(torch.zeros(1, 4, 2, 3, 3), m, [0, 1, 1, 1, 1]).shape
    torch.Size([5, 3, 3, 3])
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..diffusion._latent_rgb import LatentRGB, latents_to_rgb, solve_latent_rgb
from ._layout import VideoLatents, frame_index
from ._tiny import moving_shapes

__all__ = ["VideoDecoderParts", "VideoPreviewer", "fit_video_latent_rgb", "linear_frames", "to_uint8"]


def linear_frames(latents: torch.Tensor, latent_rgb: LatentRGB, index: list[int]) -> torch.Tensor:
    """``(1, C, F', h, w)`` -> ``(len(index), 3, h, w)`` in [0, 1]: each latent frame mapped once,
    then repeated in time by ``index`` (output frame -> latent frame)."""
    per_latent = latents_to_rgb(latents[0].permute(1, 0, 2, 3), latent_rgb)
    return per_latent[index]


_fits: weakref.WeakKeyDictionary[Any, LatentRGB] = weakref.WeakKeyDictionary()
_fit_lock = threading.Lock()


def fit_video_latent_rgb(layout: VideoLatents, *, num_clips: int = 6, latent_size: int = 4, seed: int = 0) -> LatentRGB:
    """A linear latent->RGB map for a 3D video VAE, by least squares (cached per VAE object).

    Moving-shape clips are encoded by the VAE (random latents where it cannot encode), perturbed
    with noise and joined by unit-variance latents (early steps are mostly noise); all are decoded,
    each latent frame's target is the mean of the frames it decodes to, pooled to the latent grid.
    """
    with _fit_lock:
        hit = _fits.get(layout.vae)
    if hit is not None:
        return hit
    gen = torch.Generator("cpu").manual_seed(seed)
    latent_frames = 3
    frames = layout.output_frames(latent_frames)
    clips = moving_shapes(num_clips, frames, latent_size * layout.spatial, gen)
    clean = layout.encode(clips)
    config = layout.vae.config
    channels = int(getattr(config, "latent_channels", None) or config.z_dim)
    if clean is None or clean.shape[-3:] != (latent_frames, latent_size, latent_size):
        clean = torch.randn(num_clips, channels, latent_frames, latent_size, latent_size, generator=gen)
    clean = clean.float().cpu()
    noisy = clean + 0.35 * clean.std().clamp_min(1e-3) * torch.randn(clean.shape, generator=gen)
    gaussian = torch.randn((max(1, num_clips // 2), *clean.shape[1:]), generator=gen)
    samples = torch.cat([clean, noisy, gaussian])
    decoded = torch.cat([layout.decode(samples[i : i + 2]).cpu() for i in range(0, len(samples), 2)])
    index = torch.tensor(frame_index(decoded.shape[2], latent_frames, layout.temporal))
    target = torch.stack([decoded[:, :, index == j].mean(2) for j in range(latent_frames)], dim=2)
    target = F.adaptive_avg_pool3d(target * 2 - 1, (latent_frames, latent_size, latent_size))
    result = solve_latent_rgb(samples.permute(0, 2, 3, 4, 1).reshape(-1, channels),
                              target.permute(0, 2, 3, 4, 1).reshape(-1, 3))
    with _fit_lock:
        _fits[layout.vae] = result
    return result


@dataclass(frozen=True)
class VideoDecoderParts:
    """What a model lends its preview decoders, each behind a callable so that only the decoder a
    run uses is made (the linear map is never fitted for a ``"tiny"`` run, and the other way round).

    ``latent_rgb()``: the `LatentRGB` map; ``tiny_net()``: a module from ``(1, C, F', h, w)``
    latents to ``(1, 3, F, H, W)`` in [0, 1]."""

    latent_rgb: Callable[[], LatentRGB]
    tiny_net: Callable[[], Callable[[torch.Tensor], torch.Tensor]]


def to_uint8(video: torch.Tensor, max_side: int | None) -> np.ndarray:
    """``(F, 3, H, W)`` in [0, 1] -> ``(F, H', W', 3)`` uint8, scaled down so the longer side is at
    most ``max_side`` (never up)."""
    h, w = video.shape[-2:]
    if max_side is not None and max(h, w) > max_side:
        scale = max_side / max(h, w)
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        video = F.interpolate(video.float(), size=size, mode="area")
    return (video.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()  # type: ignore[no-any-return]


class VideoPreviewer:
    """Turns a step's latents into the preview frames of one run (``mode`` a ``preview=`` value)."""

    def __init__(self, mode: str, layout: VideoLatents, parts: VideoDecoderParts, *, max_side: int | None) -> None:
        self.mode = mode
        self.layout = layout
        self.max_side = max_side
        self.source = "latent" if mode == "latent" else "x0"
        self._linear = parts.latent_rgb() if mode in ("latent", "x0") else None
        self._tiny = parts.tiny_net() if mode == "tiny" else None

    @torch.inference_mode()
    def frames(self, latents: torch.Tensor, num_frames: int) -> np.ndarray:
        """``(1, C, F', h, w)`` latents -> ``(num_frames, H, W, 3)`` uint8 preview frames."""
        latents = latents[:1].float()
        if self._linear is not None:
            video = linear_frames(latents, self._linear, frame_index(num_frames, latents.shape[2], self.layout.temporal))
        else:
            if self._tiny is not None:
                param = next(iter(getattr(self._tiny, "parameters", lambda: iter([latents]))()), latents)
                out = self._tiny(latents.to(device=param.device, dtype=param.dtype))
            else:
                out = self.layout.decode(latents)
            video = out[0].permute(1, 0, 2, 3).float()
            if video.shape[0] != num_frames:  # a decoder that makes another count: nearest in time
                pick = torch.linspace(0, video.shape[0] - 1, num_frames).round().long()
                video = video[pick]
        return to_uint8(video, self.max_side)


class PerFrameNet(torch.nn.Module):
    """An image preview decoder (`multistream.image` ``PreviewDecoderNet``: ``(N, C, h, w)`` -> RGB in
    [-1, 1]) run on every frame of ``(B, C, F, h, w)`` latents, giving ``(B, 3, F, H, W)`` in [0, 1]."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = latents.shape
        out = self.net(latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w))
        out = out.reshape(b, f, *out.shape[1:]).permute(0, 2, 1, 3, 4)
        return ((out + 1) / 2).clamp(0, 1)  # type: ignore[no-any-return]
