"""What one image run is given: the validated request (`ImageJob`) and what it reads of its
model (`RunContext`), so that the run (`_run`), its checkpoints (`_checkpoint`) and the model
(`_model`) each import this module and none of them imports another in a cycle.

`SteeringState` is what a checkpoint records of a run's steering (`ImageSteering` has it).

Example (what `ImageModel` does for each run):
    >>> ctx = model._run_context()                                   # doctest: +SKIP
    >>> ImageRun(ctx, writer, job, yield_step=lambda: None).execute()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .._eta import PerPixelTime
    from ._latent_rgb import LatentRGB
    from ._preview_options import PreviewPlan, PreviewThrottle
    from ._previews import DecoderParts

__all__ = ["ImageJob", "RunContext", "SteeringState"]


@dataclass
class ImageJob:
    """One validated `stream()` call."""

    call_kwargs: dict[str, Any]
    plan: PreviewPlan
    throttle: PreviewThrottle
    steps: int | None
    height: int | None
    width: int | None
    seed: int
    num_images: int
    preview_format: str
    preview_quality: int
    preview_max_side: int | None
    final_format: str
    final_quality: int
    taesd: Any
    user_callback: Callable[..., Any] | None
    tensor_inputs: list[str]
    decoders: DecoderParts  # what `build_decoder` makes ``plan.decoder`` from
    priority: int = 0


@dataclass(frozen=True)
class RunContext:
    """What a run and its checkpoints read of their `ImageModel`, handed to them instead of the model.

    ``params``: the pipeline ``__call__``'s parameters; ``takes_step_callback``: whether it takes
    ``callback_on_step_end``; ``stepper``: the engine's step scheduler when same-shape requests
    share batched UNet calls (None otherwise); ``latent_rgb_if_ready``: the latent->RGB map when
    it is known without fitting; ``decode_time``: the model's final decode time per pixel so far
    (for ``eta_s``), or None.
    """

    pipeline: Any
    device: torch.device
    params: Mapping[str, Any]
    takes_step_callback: bool
    stepper: Any
    latent_rgb_if_ready: Callable[[], LatentRGB | None]
    decode_time: PerPixelTime | None = None


class SteeringState(Protocol):
    """The steering a checkpoint records: the steers applied so far and the conditioning now."""

    applied: list[dict[str, Any]]
    prompt: Any
    negative_prompt: Any
    guidance_scale: Any
