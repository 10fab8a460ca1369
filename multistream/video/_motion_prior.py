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
    >>> latents = prior.initial_latents(vm.layout, pipe.scheduler, "a red circle moving up on a blue background",
    ...                                 num_frames=16, height=64, width=64, generator=g)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError

__all__ = ["MOTION_PRIOR_FILE", "MotionPrior"]

#: The file in a model folder that turns the prior on.
MOTION_PRIOR_FILE = "motion_prior.json"
_MEAN_SEED = 0  # the mean clip is the same for every request of a prompt: drawn from a fixed seed
_CACHED_MEANS = 64  # descriptions whose mean clip a prior keeps (each is one small latent tensor)
_CLIPS_PER_ENCODE = 8  # clips the VAE encodes in one call


@dataclass(frozen=True)
class MotionPrior:
    """How far the initial latents lean toward the prompt's mean clip (see the module docstring).

    A prior belongs to one model: it keeps the mean clips it has encoded with that model's VAE.
    """

    gain: float
    clips: int = 32
    _means: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

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

    def initial_latents(self, layout: Any, scheduler: Any, prompt: Any, *, num_frames: int, height: int, width: int,
                        generator: torch.Generator) -> torch.Tensor | None:
        """The run's initial latents ``(1, C, F', H', W')``, or None (plain noise) where the prompt
        names no motion, the clip is not square or the scheduler has no ``alphas_cumprod``.
        ``layout`` is the model's `VideoLatents`. Draws the noise from ``generator`` as diffusers'
        ``prepare_latents`` would, so the seed still chooses the clip."""
        from diffusers.utils.torch_utils import randn_tensor

        from .._shapes import parse_video_prompt

        alphas = getattr(scheduler, "alphas_cumprod", None)
        if not isinstance(prompt, str) or height != width or alphas is None:
            return None
        shape, color, background, motion = parse_video_prompt(prompt)
        if motion is None:
            return None
        try:
            mean = self._mean_clip(layout, (shape, color, background, motion, num_frames, height))
        except ValueError:  # no clip has it (a shape on its own colour), or the VAE cannot encode
            return None
        noise = randn_tensor(tuple(mean.shape), generator=generator, dtype=mean.dtype)
        leaked = float(alphas[-1])  # what the schedule's last step keeps of the clip
        return noise * (1.0 - leaked) ** 0.5 + mean * (self.gain * leaked**0.5)

    def _mean_clip(self, layout: Any, key: tuple) -> torch.Tensor:
        """The latents of ``clips`` training clips of this description, averaged: ``(1, C, F', H', W')``."""
        from .._shapes import draw_clip, sample_clip

        with self._lock:  # one encode per description, and none beside another request's
            cached = self._means.get(key)
            if cached is not None:
                return cached
            shape, color, background, motion, num_frames, size = key
            rng = np.random.default_rng(_MEAN_SEED)
            clips = [sample_clip(rng, shape=shape, color=color, background=background, motion=motion)
                     for _ in range(self.clips)]
            total = None
            for start in range(0, len(clips), _CLIPS_PER_ENCODE):
                frames = np.stack([np.stack([np.asarray(f) for f in draw_clip(c, num_frames, size)])
                                   for c in clips[start:start + _CLIPS_PER_ENCODE]])  # (n, F, H, W, 3) uint8
                video = torch.from_numpy(frames).permute(0, 4, 1, 2, 3).float().div(255.0)  # (n, 3, F, H, W)
                latents = layout.encode(video)
                if latents is None:
                    raise ValueError("the VAE cannot encode")
                part = latents.float().cpu().sum(0, keepdim=True)
                total = part if total is None else total + part
            mean = total / len(clips)
            if len(self._means) >= _CACHED_MEANS:
                self._means.pop(next(iter(self._means)))
            self._means[key] = mean
            return mean
