"""A prompt's motion prior: the embedded video model starts from noise that leans the way the prompt moves.

Why it exists: the embedded model (an AnimateDiff motion adapter on the embedded image model) was
trained on Stable Diffusion's noise schedule, whose last step still keeps ``sqrt(alphas_cumprod[-1])``
= 0.068 of the clean clip (no zero terminal SNR, Lin et al. 2024). So in training the trajectory
could always be read from that leaked signal and the model never needed the prompt's motion word:
started from pure noise it moves the shape wherever the noise suggests (8 of 24 judged prompts
right, chance 6; its prediction at the first step moves the same way for all four directions).

The prior uses that signal-leak bias on purpose (Everaert et al., "Exploiting the Signal-Leak Bias
in Diffusion Models", WACV 2024): the initial latents are the seed's noise at the schedule's last
step plus, ``gain`` times, the signal that step leaks of the prompt's mean clip (``clips`` clips of
the training distribution with the prompt's shape, colours and motion, averaged in latent space).
The model then denoises the motion the prompt names (23 of 24 at ``gain=4``). A prompt that names
no motion ("moving left/right/up/down") starts from plain noise.

A model folder turns it on with ``motion_prior.json``: ``{"gain": 4.0, "clips": 32}``.

Example:
    >>> prior = MotionPrior(gain=4.0, clips=32)
    >>> latents = prior.initial_latents(pipe, "a red circle moving up on a blue background",
    ...                                 num_frames=16, height=64, width=64, generator=g)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError

__all__ = ["MOTION_PRIOR_FILE", "MotionPrior"]

#: The file in a model folder that turns the prior on.
MOTION_PRIOR_FILE = "motion_prior.json"
_MEAN_SEED = 0  # the mean clip is the same for every request of a prompt: drawn from a fixed seed


@dataclass(frozen=True)
class MotionPrior:
    """How far the initial latents lean toward the prompt's mean clip (see the module docstring)."""

    gain: float
    clips: int = 32

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> MotionPrior | None:
        """The folder's ``motion_prior.json`` as a prior; None where it has none."""
        path = Path(folder) / MOTION_PRIOR_FILE
        if not path.is_file():
            return None
        try:
            entries = json.loads(path.read_text())
            return cls(gain=float(entries["gain"]), clips=int(entries.get("clips", 32)))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"{path} is not a motion prior ({type(exc).__name__}: {exc}); "
                                 'it holds {"gain": 4.0, "clips": 32}, or delete it') from exc

    def initial_latents(self, pipe: Any, prompt: Any, *, num_frames: int, height: int, width: int,
                        generator: torch.Generator) -> torch.Tensor | None:
        """The run's initial latents ``(1, C, F, H/8, W/8)``, or None (plain noise) where the prompt
        names no motion or the clip is not square. Draws the noise from ``generator`` as diffusers'
        ``prepare_latents`` would, so the seed still chooses the clip."""
        from diffusers.utils.torch_utils import randn_tensor

        from .._shapes import parse_video_prompt

        if not isinstance(prompt, str) or height != width:
            return None
        shape, color, background, motion = parse_video_prompt(prompt)
        if motion is None:
            return None
        try:
            mean = _mean_clip_latents(pipe.vae, self.clips, shape, color, background, motion, num_frames, height)
        except ValueError:  # a description no clip can have (a shape on its own colour): plain noise
            return None
        noise = randn_tensor(tuple(mean.shape), generator=generator, dtype=mean.dtype)
        leaked = float(pipe.scheduler.alphas_cumprod[-1])  # what the schedule's last step keeps of the clip
        return noise * (1.0 - leaked) ** 0.5 + mean * (self.gain * leaked**0.5)


_ENCODE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def _mean_clip_latents(vae: Any, clips: int, shape: str | None, color: str | None, background: str | None,
                       motion: str, num_frames: int, size: int) -> torch.Tensor:
    """The latents of ``clips`` training clips of this description, averaged: ``(1, C, F, h, w)``."""
    from .._shapes import draw_clip, sample_clip

    rng = np.random.default_rng(_MEAN_SEED)
    frames = np.stack([
        np.stack([np.asarray(f) for f in draw_clip(sample_clip(rng, shape=shape, color=color, background=background,
                                                               motion=motion), num_frames, size)])
        for _ in range(clips)
    ])  # (clips, F, size, size, 3) uint8
    pixels = torch.from_numpy(frames.reshape(-1, size, size, 3)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    param = next(vae.parameters())
    out = []
    with _ENCODE_LOCK, torch.no_grad():
        for chunk in pixels.split(256):
            out.append(vae.encode(chunk.to(param)).latent_dist.mean.float().cpu())
    latents = torch.cat(out) * vae.config.scaling_factor  # (clips * F, C, h, w)
    latents = latents.reshape(clips, num_frames, *latents.shape[1:]).mean(0)  # (F, C, h, w)
    return latents.permute(1, 0, 2, 3).unsqueeze(0).contiguous()
