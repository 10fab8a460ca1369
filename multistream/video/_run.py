"""One video request on the engine thread: the pipeline call, its step callback, the events.

The callback of every denoising step (diffusers' ``callback_on_step_end``) applies a pending
``steer``, makes the step's preview (every frame, `multistream.video._previews`), keeps the
clean estimate for ``finish_early()``, then hands the engine thread to the next request
(``yield_step``: requests interleave by step) and, back, stops the run if it was cancelled or
finished early. The final event is the clip, encoded by `multistream.video._encode`.

Example (what `VideoModel` does for each request):
    >>> VideoRun(context, writer, job, yield_step).execute()     # doctest: +SKIP
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..diffusion._checkpoint import RunCheckpoints
from ..diffusion._preview_options import PreviewThrottle
from ..diffusion._previews import X0Tracker, x0_strategy
from ..diffusion._prompt_length import PromptLimit, quiet_cut_notices
from ..errors import InvalidArgumentError
from ..events import VideoEvent
from ..stream import StreamWriter
from ._encode import encode_clip, encode_preview
from ._layout import VideoLatents
from ._previews import VideoDecoderParts, VideoPreviewer, to_uint8

__all__ = ["VideoJob", "VideoRun", "VideoSteering"]

logger = logging.getLogger("multistream")


class _Cancelled(BaseException):
    """Raised from the step callback to leave the pipeline call at once (cancel)."""


class _FinishEarly(BaseException):
    """Raised from the step callback to end with the current clean estimate (finish_early)."""


@dataclass
class VideoJob:
    """One validated `VideoModel.stream` call."""

    call_kwargs: dict[str, Any]
    steps: int
    num_frames: int
    fps: float
    height: int
    width: int
    seed: int
    preview: str
    throttle: PreviewThrottle
    preview_format: str
    preview_max_side: int | None
    video_format: str
    priority: int = 0
    user_callback: Callable[..., Any] | None = None


@dataclass(frozen=True)
class RunContext:
    """What a run reads of its model: the pipeline, its latent layout and preview decoders."""

    pipeline: Any
    layout: VideoLatents
    decoders: VideoDecoderParts
    device: torch.device
    tensor_inputs: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)  # the pipeline call's parameters


class VideoSteering:
    """``steer(prompt=..., negative_prompt=..., guidance_scale=...)``: checked on the caller's thread,
    applied at the next step's callback as new prompt embeddings (the latents, so the clip so far,
    are kept). Pipelines that batch the negative and positive embeddings together (CogVideoX, LTX,
    AnimateDiff) get them joined the same way; Wan keeps them apart."""

    def __init__(self, pipeline: Any, call_kwargs: dict[str, Any], *, prompt_limit: PromptLimit | None = None) -> None:
        self._pipe = pipeline
        self._prompt_limit = prompt_limit
        self._prompt = call_kwargs.get("prompt")
        self._negative = call_kwargs.get("negative_prompt")
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.applied: list[dict[str, Any]] = []  # {"step", **changes}: what took effect, in order
        self.guidance_scale: float | None = call_kwargs.get("guidance_scale")

    @property
    def prompt(self) -> Any:
        """The prompt the steps are conditioned on now (after the steers)."""
        return self._prompt

    @property
    def negative_prompt(self) -> Any:
        return self._negative

    def start_from(self, call_kwargs: dict[str, Any]) -> None:
        """The run starts on ``call_kwargs``' conditioning (a resumed run: its checkpoint's)."""
        self._prompt = call_kwargs.get("prompt", self._prompt)
        self._negative = call_kwargs.get("negative_prompt", self._negative)
        self.guidance_scale = call_kwargs.get("guidance_scale", self.guidance_scale)

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name != "steer":
            raise InvalidArgumentError(f"a video stream does not support {name}(); it takes steer(prompt=...)")
        if args:
            raise InvalidArgumentError("a video stream's steer() takes keywords: steer(prompt='...', negative_prompt=..., "
                                       "guidance_scale=...)")
        unknown = set(kwargs) - {"prompt", "negative_prompt", "guidance_scale"}
        if unknown:
            raise InvalidArgumentError(f"steer() takes prompt, negative_prompt and guidance_scale, not {sorted(unknown)}")
        if not kwargs:
            raise InvalidArgumentError("steer() needs prompt=, negative_prompt= or guidance_scale=")
        for key in ("prompt", "negative_prompt"):
            if key in kwargs and kwargs[key] is not None and not isinstance(kwargs[key], str):
                raise InvalidArgumentError(f"steer({key}=...) must be a string")
        g = kwargs.get("guidance_scale")
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or g < 0):
            raise InvalidArgumentError(f"steer(guidance_scale=...) must be a number >= 0, got {g!r}")
        if not hasattr(self._pipe, "encode_prompt") and ("prompt" in kwargs or "negative_prompt" in kwargs):
            raise InvalidArgumentError(f"{type(self._pipe).__name__} has no encode_prompt, so its prompt cannot be steered")
        with self._lock:
            if self._closed:
                from ..errors import StreamFinishedError

                raise StreamFinishedError("the clip has finished denoising; it can no longer be steered")
            self._pending.append(dict(kwargs))
        if self._prompt_limit is not None:
            for key in ("prompt", "negative_prompt"):
                self._prompt_limit.check(key, kwargs.get(key))

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            if not self._pending:
                return None
            merged: dict[str, Any] = {}
            for change in self._pending:
                merged.update(change)
            self._pending.clear()
            return merged

    def apply(self, pipe: Any, callback_kwargs: dict[str, Any], step: int) -> dict[str, Any]:
        """The tensors to hand back to the pipeline for a pending steer (empty when none), which
        conditions the steps after ``step``."""
        change = self.take()
        if change is None:
            return {}
        out: dict[str, Any] = {}
        if change.get("guidance_scale") is not None and hasattr(pipe, "_guidance_scale"):
            pipe._guidance_scale = self.guidance_scale = float(change["guidance_scale"])
        if "prompt" in change or "negative_prompt" in change:
            self._prompt = change.get("prompt", self._prompt)
            self._negative = change.get("negative_prompt", self._negative)
            current = callback_kwargs.get("prompt_embeds")
            if current is None:
                raise InvalidArgumentError(f"{type(pipe).__name__} does not hand its prompt embeddings to the step callback")
            cfg = bool(getattr(pipe, "do_classifier_free_guidance", False))
            params = _encode_params(pipe)
            given: dict[str, Any] = {"prompt": self._prompt, "negative_prompt": self._negative or "",
                                     "do_classifier_free_guidance": cfg, "device": current.device}
            if "num_videos_per_prompt" in params:
                given["num_videos_per_prompt"] = 1
            if "num_images_per_prompt" in params:
                given["num_images_per_prompt"] = 1
            if "max_sequence_length" in params:
                # The new embeddings must have the old sequence length (the attention masks stay).
                given["max_sequence_length"] = int(current.shape[1])
            encoded = pipe.encode_prompt(**{k: v for k, v in given.items() if k in params})
            # SDXL-style pipelines (AnimateDiffSDXLPipeline: the embedded model) also condition every
            # step on the pooled prompt, `add_text_embeds`: (positive, negative, pooled, negative pooled);
            # LTX-style ones return (positive, its mask, negative, its mask).
            pooled_now = callback_kwargs.get("add_text_embeds")
            if pooled_now is not None:
                positive, negative, pooled, negative_pooled = encoded
                pooled = torch.cat([negative_pooled, pooled]) if cfg and negative_pooled is not None else pooled
                out["add_text_embeds"] = pooled.to(pooled_now)
            else:
                positive, negative = encoded[0], encoded[2] if len(encoded) == 4 else encoded[1]
            positive = positive.to(current.dtype)
            joined = cfg and negative is not None and current.shape[0] % (2 * positive.shape[0]) == 0
            if joined:
                out["prompt_embeds"] = _like(torch.cat([negative.to(current.dtype), positive]), current)
            else:
                out["prompt_embeds"] = _like(positive, current)
                old_negative = callback_kwargs.get("negative_prompt_embeds")
                if cfg and negative is not None and old_negative is not None:
                    out["negative_prompt_embeds"] = _like(negative.to(current.dtype), old_negative)
        self.applied.append({"step": step, **change})
        return out


def _like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` repeated as the pipeline repeated the embeddings it holds (AnimateDiff: once per frame)."""
    if old.shape[0] != new.shape[0] and old.shape[0] % new.shape[0] == 0:
        new = new.repeat_interleave(old.shape[0] // new.shape[0], dim=0)
    return new.to(device=old.device)


def _encode_params(pipe: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(pipe.encode_prompt).parameters)
    except (TypeError, ValueError):
        return set()


def own_pipeline(pipe: Any) -> Any:
    """A shallow copy of ``pipe`` that shares the weights but has its own scheduler and run state
    (so requests interleaved by step do not step each other's scheduler)."""
    own = copy.copy(pipe)
    own.__dict__["scheduler"] = copy.deepcopy(pipe.scheduler)
    return own


@dataclass
class _Stats:
    started: float
    steps: int = 0
    first_preview: float | None = None
    last_step_at: float | None = None
    step_times: list[float] = field(default_factory=list)
    preview_ms: list[float] = field(default_factory=list)
    preview_bytes: list[int] = field(default_factory=list)


class VideoRun:
    """Runs one `VideoJob` (``context``: what it reads of its model) and emits its events to ``writer``."""

    def __init__(self, context: RunContext, writer: StreamWriter, job: VideoJob, yield_step: Callable[[], None],
                 steering: VideoSteering | None = None, checkpoints: RunCheckpoints | None = None) -> None:
        self.context, self.writer, self.job = context, writer, job
        self.yield_step = yield_step
        self.steering = steering
        # Taking checkpoints (``on_checkpoint=``) and resuming from one (``resume_from=``): the
        # image family's, on this run's own pipeline copy.
        self.checkpoints = checkpoints
        self.stats = _Stats(started=time.perf_counter())
        if checkpoints is not None:
            self.stats.steps = checkpoints.start_step
        self.pipe = own_pipeline(context.pipeline)
        self.estimate: torch.Tensor | None = None  # the newest clean estimate, in (B, C, F', H', W')
        self.last_preview: tuple[bytes, str, int, int] | None = None

    # -- the run --------------------------------------------------------------------------------

    def execute(self) -> None:
        writer, job, pipe = self.writer, self.job, self.pipe
        if writer.cancelled:
            self.emit_cancelled()
            return
        tracker = X0Tracker(pipe.scheduler) if x0_strategy(pipe.scheduler) is not None else None
        previewer = None
        if job.preview != "none":
            previewer = VideoPreviewer(job.preview, self.context.layout, self.context.decoders, max_side=job.preview_max_side)
        kwargs = dict(job.call_kwargs)
        if self.checkpoints is not None:
            self.checkpoints.apply_conditioning(kwargs)  # a resumed run: the conditioning after its steers
            if self.steering is not None:
                self.steering.start_from(kwargs)
            self.checkpoints.install(pipe, kwargs)
        kwargs["callback_on_step_end"] = self._callback(previewer, tracker)
        kwargs["callback_on_step_end_tensor_inputs"] = list(self.context.tensor_inputs)
        kwargs["output_type"] = "pt"
        try:
            try:
                with tracker if tracker is not None else nullcontext(), quiet_cut_notices(pipe):
                    output = pipe(**kwargs)
            finally:
                if self.steering is not None:
                    self.steering.close()
        except _Cancelled:
            self.emit_cancelled()
            return
        except _FinishEarly:
            self._emit_finished_early()
            return
        frames = output.frames if hasattr(output, "frames") else output[0]
        video = frames[0] if isinstance(frames, torch.Tensor) else torch.as_tensor(np.asarray(frames[0]))
        if video.ndim == 4 and video.shape[-1] == 3:  # (F, H, W, 3) from a numpy output
            video = video.permute(0, 3, 1, 2)
        self._emit_final(video.float(), "stop", decode_started=self.stats.last_step_at)

    def _callback(self, previewer: VideoPreviewer | None, tracker: X0Tracker | None) -> Callable[..., dict[str, Any]]:
        writer, job, stats, layout, checkpoints = self.writer, self.job, self.stats, self.context.layout, self.checkpoints

        def callback(pipeline: Any, i: int, t: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            now = time.perf_counter()
            stats.step_times.append(now - (stats.last_step_at or stats.started))
            stats.last_step_at = now
            step = int(i) + 1  # a resumed run skips the steps before its checkpoint: i keeps its numbering
            if checkpoints is not None:
                checkpoints.check_step(step)
            stats.steps = step
            latents = callback_kwargs["latents"]
            x0 = tracker.x0() if tracker is not None else None
            clean = x0 if x0 is not None and x0.shape == latents.shape else latents
            self.estimate = layout.to_ncthw(clean, num_frames=job.num_frames, height=job.height, width=job.width)
            if previewer is not None and job.throttle.should_preview(step):
                source = latents if previewer.source == "latent" else clean
                ncthw = layout.to_ncthw(source, num_frames=job.num_frames, height=job.height, width=job.width)
                self._emit_preview(previewer, ncthw, step)
            returned: dict[str, Any] = {}
            if job.user_callback is not None:
                returned.update(job.user_callback(pipeline, i, t, callback_kwargs) or {})
            if writer.cancelled:
                raise _Cancelled
            if writer.finish_early_requested and step < job.steps:
                raise _FinishEarly
            self.yield_step()  # the engine runs another request's step, then comes back here
            if writer.cancelled:
                raise _Cancelled
            if writer.finish_early_requested and step < job.steps:
                raise _FinishEarly
            if self.steering is not None:
                returned.update(self.steering.apply(pipeline, callback_kwargs, step))
            if checkpoints is not None:
                # After the steers: the checkpoint carries the conditioning of the next step.
                checkpoints.after_step(step, job.steps, returned.get("latents", callback_kwargs.get("latents")),
                                       self.steering)
            return returned

        return callback

    # -- events ---------------------------------------------------------------------------------

    def _eta(self) -> float | None:
        times = self.stats.step_times[1:] or self.stats.step_times
        if not times:
            return None
        return float(np.median(times)) * max(0, self.job.steps - self.stats.steps)

    def _emit_preview(self, previewer: VideoPreviewer, latents: torch.Tensor, step: int) -> None:
        started = time.perf_counter()
        frames = previewer.frames(latents, self.job.num_frames)
        data, mime = encode_preview(frames, self.job.preview_format, fps=self.job.fps)
        stats = self.stats
        stats.preview_ms.append((time.perf_counter() - started) * 1e3)
        stats.preview_bytes.append(len(data))
        if stats.first_preview is None:
            stats.first_preview = time.perf_counter()
        h, w = frames.shape[1:3]
        self.last_preview = (data, mime, w, h)
        self.writer.emit(VideoEvent, step=step, total_steps=self.job.steps, num_frames=int(frames.shape[0]),
                         fps=self.job.fps, width=int(w), height=int(h), mime=mime, data=data, eta_s=self._eta())

    def _metrics(self, **extra: float) -> dict[str, float]:
        stats, job = self.stats, self.job
        out: dict[str, float] = {
            "steps": float(stats.steps),
            "duration_ms": (time.perf_counter() - stats.started) * 1e3,
            "seed": job.seed,  # an int: a float loses seeds above 2**53 (up to 2**63 are taken)
            "previews": float(len(stats.preview_ms)),
        }
        if stats.first_preview is not None:
            out["ttfp_ms"] = (stats.first_preview - stats.started) * 1e3
        if stats.preview_ms:
            out["preview_ms_mean"] = float(np.mean(stats.preview_ms))
            out["preview_bytes_mean"] = float(np.mean(stats.preview_bytes))
        if stats.step_times:
            out["step_ms_median"] = float(np.median(stats.step_times)) * 1e3
        steers = len(self.steering.applied) if self.steering is not None else 0
        if self.checkpoints is not None:
            steers += self.checkpoints.steers_before
            out.update(self.checkpoints.metrics())
        if steers:
            out["steers"] = float(steers)
        out.update(extra)
        return out

    def _emit_final(self, video: torch.Tensor, reason: str, decode_started: float | None) -> None:
        """``video``: ``(F, 3, H, W)`` in [0, 1] at full size."""
        decoded = time.perf_counter()
        frames = to_uint8(video, None)
        encode_started = time.perf_counter()
        data, mime = encode_clip(frames, self.job.video_format, fps=self.job.fps)
        extra = {"encode_ms": (time.perf_counter() - encode_started) * 1e3, "bytes": float(len(data))}
        if decode_started is not None:
            extra["decode_ms"] = (decoded - decode_started) * 1e3
        h, w = frames.shape[1] + frames.shape[1] % 2, frames.shape[2] + frames.shape[2] % 2
        self.writer.emit(VideoEvent, step=self.stats.steps, total_steps=self.job.steps, num_frames=int(frames.shape[0]),
                         fps=self.job.fps, width=int(w), height=int(h), mime=mime, data=data, is_final=True,
                         finish_reason=reason, metrics=self._metrics(**extra), eta_s=0.0)

    def _emit_finished_early(self) -> None:
        """The newest clean estimate through the full VAE: the clip as it would be now."""
        started = time.perf_counter()
        if self.estimate is None:
            self.emit_cancelled()
            return
        video = self.context.layout.decode(self.estimate)[0].permute(1, 0, 2, 3)
        self._emit_final(video, "finished_early", decode_started=started)

    def emit_cancelled(self) -> None:
        """The final event of a cancelled run: the newest preview (no VAE work), else black frames."""
        job = self.job
        if self.last_preview is not None:
            data, mime, w, h = self.last_preview
        else:
            side = job.preview_max_side or max(job.height, job.width)
            scale = min(1.0, side / max(job.height, job.width))
            w, h = max(1, round(job.width * scale)), max(1, round(job.height * scale))
            fmt = job.preview_format
            data, mime = encode_preview(np.zeros((job.num_frames, h, w, 3), np.uint8), fmt, fps=job.fps)
        self.writer.emit(VideoEvent, step=self.stats.steps, total_steps=job.steps, num_frames=job.num_frames, fps=job.fps,
                         width=int(w), height=int(h), mime=mime, data=data, is_final=True, finish_reason="cancelled",
                         metrics=self._metrics())
