"""Video latents in one layout: what each diffusers video family holds, and its VAE, in one place.

The families keep their latents three ways while denoising (what ``callback_on_step_end`` sees):

==============  ======================  =========  =============================================
family          latents                 time       VAE
==============  ======================  =========  =============================================
Wan, Hunyuan,   ``(B, C, F', H', W')``  4x, 6x     3D, causal (first frame alone); Wan's latents
Mochi                                              are normalised by ``latents_mean``/``_std``
CogVideoX       ``(B, F', C, H', W')``  4x         3D, causal; ``/ scaling_factor``
LTX-Video       ``(B, F'H'W', C)``      8x         3D, causal; packed tokens (``_unpack_latents``),
                packed tokens                      normalised by ``latents_mean``/``_std``
AnimateDiff     ``(B, C, F, H', W')``   none       the image VAE, per frame; ``/ scaling_factor``
==============  ======================  =========  =============================================

`VideoLatents` turns any of them into ``(B, C, F', H', W')`` in the denoiser's own scale (what
previews decode), decodes that through the full VAE with the family's normalisation (the ``"vae"``
preview, ``finish_early()``) and encodes clips back (for fitting preview decoders). Every other
module sees only that one layout.

Example:
    >>> frame_index(9, 3, 4)          # output frame -> latent frame, 4x causal VAE
    [0, 1, 1, 1, 1, 2, 2, 2, 2]
    >>> lat = VideoLatents.of(pipe)                                               # doctest: +SKIP
    >>> lat.to_ncthw(callback_latents, num_frames=9, height=32, width=32).shape   # doctest: +SKIP
    torch.Size([1, 8, 2, 1, 1])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = ["VideoLatents", "frame_index"]


def frame_index(num_frames: int, latent_frames: int, temporal: int) -> list[int]:
    """Which latent frame each of ``num_frames`` output frames comes from: a causal VAE decodes its
    first latent frame to one frame and each later one to ``temporal`` frames.

    Example:
        >>> frame_index(4, 4, 1)
        [0, 1, 2, 3]
    """
    if temporal <= 1:
        return [min(i, latent_frames - 1) for i in range(num_frames)]
    return [min(latent_frames - 1, math.ceil(i / temporal)) for i in range(num_frames)]


@dataclass(frozen=True)
class VideoLatents:
    """How one pipeline holds video latents; see the module docstring.

    ``layout``: ``"ncthw"``, ``"ntchw"`` or ``"packed"``; ``temporal``/``spatial``: the VAE's
    compression in time and space; ``per_frame``: the VAE is a 2D image VAE run on each frame.
    """

    vae: Any
    layout: str
    temporal: int
    spatial: int
    per_frame: bool
    family: str
    pipeline: Any = None

    @classmethod
    def of(cls, pipeline: Any) -> VideoLatents:
        """Read the layout from the pipeline's class and VAE (a clear error for one it cannot show)."""
        vae = getattr(pipeline, "vae", None)
        name = type(pipeline).__name__
        if vae is None:
            raise InvalidArgumentError(f"{name} has no VAE, so multistream cannot show or decode its video latents")
        vae_name = type(vae).__name__
        try:
            found = cls.for_vae(vae)
        except InvalidArgumentError:
            temporal = getattr(pipeline, "vae_scale_factor_temporal", None)
            spatial = getattr(pipeline, "vae_scale_factor_spatial", None)
            if temporal is None or spatial is None:
                raise InvalidArgumentError(
                    f"multistream does not know how {name} (VAE {vae_name}) holds its video latents; supported: Wan, "
                    "CogVideoX, LTX-Video, AnimateDiff and pipelines with (B, C, F, H, W) latents and "
                    "vae_scale_factor_temporal"
                ) from None
            found = cls(vae, "ncthw", int(temporal), int(spatial), False, name)
        layout = "ntchw" if "CogVideoX" in name else "packed" if "LTX" in name else "ncthw"
        return cls(vae, layout, found.temporal, found.spatial, found.per_frame, found.family, pipeline)

    @classmethod
    def for_vae(cls, vae: Any) -> VideoLatents:
        """The conventions of a VAE alone (no pipeline: latents are taken as ``(B, C, F', H', W')``)."""
        name = type(vae).__name__
        config = vae.config
        if name == "AutoencoderKLWan":
            return cls(vae, "ncthw", int(config.scale_factor_temporal or 4), int(config.scale_factor_spatial or 8), False, "wan")
        if name == "AutoencoderKLCogVideoX":
            return cls(vae, "ncthw", int(config.temporal_compression_ratio),
                       2 ** (len(config.block_out_channels) - 1), False, "cogvideox")
        if name == "AutoencoderKLLTXVideo":
            return cls(vae, "ncthw", int(vae.temporal_compression_ratio), int(vae.spatial_compression_ratio), False, "ltx")
        if name in ("AutoencoderKL", "AutoencoderTiny", "AsymmetricAutoencoderKL"):
            factor = 2 ** (len(config.block_out_channels) - 1) if hasattr(config, "block_out_channels") else 8
            return cls(vae, "ncthw", 1, int(factor), True, "animatediff")
        raise InvalidArgumentError(
            f"multistream does not know the latent conventions of {name}; supported: AutoencoderKLWan, "
            "AutoencoderKLCogVideoX, AutoencoderKLLTXVideo and 2D image VAEs (AnimateDiff)"
        )

    # -- shapes ---------------------------------------------------------------------------------

    def latent_frames(self, num_frames: int) -> int:
        return num_frames if self.temporal <= 1 else (num_frames - 1) // self.temporal + 1

    def output_frames(self, latent_frames: int) -> int:
        """Frames the VAE decodes ``latent_frames`` to."""
        return latent_frames if self.temporal <= 1 else (latent_frames - 1) * self.temporal + 1

    def to_ncthw(self, latents: torch.Tensor, *, num_frames: int, height: int, width: int) -> torch.Tensor:
        """``(B, C, F', H', W')`` from what the pipeline holds (a view where the layout allows)."""
        if self.layout == "ntchw" and latents.ndim == 5:
            return latents.permute(0, 2, 1, 3, 4)
        if self.layout == "packed" and latents.ndim == 3:
            pipe = self.pipeline
            p = int(getattr(pipe, "transformer_spatial_patch_size", 1))
            pt = int(getattr(pipe, "transformer_temporal_patch_size", 1))
            return type(pipe)._unpack_latents(  # type: ignore[no-any-return]
                latents, self.latent_frames(num_frames), height // self.spatial, width // self.spatial, p, pt
            )
        if latents.ndim == 5:
            return latents
        raise InvalidArgumentError(
            f"cannot read {type(self.pipeline).__name__}'s latents of shape {tuple(latents.shape)} as a video; use preview='none'"
        )

    # -- the full VAE ---------------------------------------------------------------------------

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        config = self.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return None
        shape = (1, len(mean), 1, 1, 1)
        return (torch.tensor(mean, device=like.device, dtype=like.dtype).view(shape),
                torch.tensor(std, device=like.device, dtype=like.dtype).view(shape))

    def _scale(self) -> float:
        return float(getattr(self.vae.config, "scaling_factor", 1.0) or 1.0)

    def to_vae_space(self, latents: torch.Tensor) -> torch.Tensor:
        """Denoiser latents ``(B, C, F', H', W')`` -> what ``vae.decode`` takes (each family's own
        normalisation, as its pipeline applies it before its final decode)."""
        if self.family in ("wan", "ltx"):
            stats = self._stats(latents)
            if stats is not None:
                mean, std = stats
                return latents * std / (self._scale() if self.family == "ltx" else 1.0) + mean
        return latents / self._scale()

    def from_vae_space(self, raw: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_vae_space`."""
        if self.family in ("wan", "ltx"):
            stats = self._stats(raw)
            if stats is not None:
                mean, std = stats
                return (raw - mean) * (self._scale() if self.family == "ltx" else 1.0) / std
        return raw * self._scale()

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``(B, C, F', H', W')`` denoiser latents -> ``(B, 3, F, H, W)`` RGB in [0, 1], full VAE."""
        vae = self.vae
        param = next(vae.parameters())
        raw = self.to_vae_space(latents.to(device=param.device, dtype=param.dtype))
        if self.per_frame:
            b, c, f, h, w = raw.shape
            flat = raw.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            out = torch.cat([vae.decode(flat[i : i + 8]).sample for i in range(0, b * f, 8)])
            video = out.reshape(b, f, *out.shape[1:]).permute(0, 2, 1, 3, 4)
        else:
            if getattr(vae.config, "timestep_conditioning", False):
                # LTX 0.9.1+: the pipeline decodes at decode_timestep (0 by default) without added noise.
                out = vae.decode(raw, torch.zeros(raw.shape[0], device=raw.device, dtype=raw.dtype))
            else:
                out = vae.decode(raw)
            video = out.sample if hasattr(out, "sample") else out[0]
        return ((video.float() + 1) / 2).clamp(0, 1)

    @torch.inference_mode()
    def encode(self, video: torch.Tensor) -> torch.Tensor | None:
        """``(B, 3, F, H, W)`` RGB in [0, 1] -> denoiser latents (None when the VAE cannot encode)."""
        vae = self.vae
        if getattr(vae, "encoder", None) is None:
            return None
        param = next(vae.parameters())
        x = (video * 2 - 1).to(device=param.device, dtype=param.dtype)
        if self.per_frame:
            b, c, f, h, w = x.shape
            flat = x.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            raw = vae.encode(flat).latent_dist.mode()
            raw = raw.reshape(b, f, *raw.shape[1:]).permute(0, 2, 1, 3, 4)
        else:
            out = vae.encode(x)
            dist = getattr(out, "latent_dist", None)
            raw = dist.mode() if dist is not None else out[0]
        return self.from_vae_space(raw.float())
