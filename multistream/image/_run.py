"""One image request from its first step to its final event: the step callback and what it emits.

An `ImageRun` calls the pipeline once, on the model's engine thread, with a step callback that

* records timing, makes a preview at the steps `PreviewThrottle` picks and hands it to the
  stream's `FrameWorker` (encoding happens off the engine thread);
* stops at once on ``cancel()`` (no VAE decode: the final event is the newest preview) and on
  ``finish_early()`` (the current estimate of the clean image through the full VAE, PNG);
* calls the user's own ``callback_on_step_end`` after ours;
* hands control back to the engine (``yield_step``) so other requests get their steps;
* applies queued ``steer(prompt=..., negative_prompt=..., guidance_scale=...)`` commands (see
  `ImageSteering`) before the next step: new text embeddings (re-encoded with the run
  pipeline's own ``encode_prompt``, on the engine thread) go back through the callback's tensor
  outputs, the guidance scale through the pipeline's ``_guidance_scale``. The latents are kept,
  so the composition formed so far stays. A steer that arrives before the run starts simply
  changes the call's arguments (the same image as starting with them);
* with ``on_checkpoint=`` takes an `ImageCheckpoint` every ``checkpoint_every`` steps (after the
  steers, so it carries the next step's conditioning), and with ``resume_from=`` skips the steps
  before the checkpoint (`RunCheckpoints`): step numbers, previews and the final event's
  ``step`` keep their original values.

The pipeline object is the request's own shallow copy with its own scheduler (schedulers keep
per-run state: timesteps, step index), so runs can interleave step by step on one set of weights.

Example (what `ImageModel` does on the engine thread):
    >>> run = ImageRun(model._run_context(), writer, job, yield_step=lambda: None)   # doctest: +SKIP
    >>> run.execute()                                                 # doctest: +SKIP
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .._checks import is_int
from .._eta import StepEta
from ..diffusion._denoiser_batch import DenoiserGate
from ..diffusion._previews import (
    FrameWorker,
    HostFrames,
    LinearDecoder,
    PendingFrame,
    PreviewDecoder,
    X0Tracker,
    build_decoder,
    false_color,
    make_decoder,
    to_uint8_frames,
    unpack_latents,
    x0_strategy,
)  # fmt: skip
from ..diffusion._prompt_length import PromptLimit, quiet_cut_notices
from ..errors import InvalidArgumentError, StreamFinishedError
from ..events import ImageEvent
from ..stream import StreamWriter
from ._frames import EncodedFrame, encode_frame

if TYPE_CHECKING:
    from ..diffusion._checkpoint import RunCheckpoints
    from ..diffusion._job import ImageJob, RunContext

__all__ = ["ImageRun", "ImageSteering", "RunStats", "steer_layout"]

logger = logging.getLogger("multistream")


class _Cancelled(BaseException):
    """Raised out of the step callback to stop the pipeline before its final VAE decode.

    A BaseException, so that an ``except Exception`` inside a pipeline cannot swallow it.
    """


class _FinishEarly(BaseException):
    """Raised out of the step callback to stop denoising and decode the current x0 estimate."""


@dataclass
class RunStats:
    """What one run has seen so far; the engine thread writes it, the encoder thread adds stats."""

    started: float
    total: int | None = None
    call_at: float = 0.0
    first_step_at: float | None = None
    last_step_at: float | None = None
    steps_seen: int = 0
    previews_made: int = 0
    preview_s: float = 0.0
    encoded: int = 0
    encode_ms: float = 0.0
    encoded_bytes: int = 0
    first_preview_at: float | None = None
    last_frames: dict[int, PendingFrame] = field(default_factory=dict)
    stop_step: int = 0
    stop_latents: torch.Tensor | None = None
    resumed_from: int = 0  # steps done before this run started (a resume from a checkpoint)
    eta: StepEta = field(default_factory=StepEta)

    def metrics(self, worker: FrameWorker | None, **extra: float) -> dict[str, float]:  # noqa: D102
        now = time.perf_counter()
        out: dict[str, float] = {"duration_ms": (now - self.started) * 1e3, "steps": float(self.steps_seen)}
        if self.first_step_at is not None:
            out["time_to_first_step_ms"] = (self.first_step_at - self.started) * 1e3
            taken = self.steps_seen - self.resumed_from
            if taken > 1 and self.last_step_at is not None:
                out["ms_per_step"] = (self.last_step_at - self.first_step_at) * 1e3 / (taken - 1)
            else:
                out["ms_per_step"] = (self.first_step_at - self.call_at) * 1e3
        if self.first_preview_at is not None:
            out["time_to_first_preview_ms"] = (self.first_preview_at - self.started) * 1e3
        out["previews"] = float(self.encoded)
        if worker is not None:
            out["previews_dropped"] = float(worker.dropped)
        if self.previews_made:
            out["preview_ms"] = self.preview_s * 1e3 / self.previews_made
        if self.encoded:
            out["encode_ms"] = self.encode_ms / self.encoded
            out["preview_bytes"] = self.encoded_bytes / self.encoded
        out.update({k: v if k == "seed" else float(v) for k, v in extra.items()})  # the seed stays an exact int
        return out


_STEER_KEYS = ("prompt", "negative_prompt", "guidance_scale")


def steer_layout(pipe: Any) -> str | None:
    """``"sd"`` (SD 1.x/2.x layout), ``"sdxl"``, or None where `ImageSteering` cannot swap the
    conditioning mid-run (SD3, Flux and other families: their embeddings are not step-callback
    outputs, or are combined in ways the callback cannot reach)."""
    inputs = tuple(getattr(type(pipe), "_callback_tensor_inputs", ()) or ())
    encode = getattr(pipe, "encode_prompt", None)
    if encode is None or "prompt_embeds" not in inputs or getattr(pipe, "unet", None) is None:
        return None
    try:
        params = inspect.signature(encode).parameters
    except (TypeError, ValueError):
        return None
    if "do_classifier_free_guidance" not in params:
        return None
    if "prompt_2" in params:
        if "add_text_embeds" in inputs and "pooled_prompt_embeds" in params:
            return "sdxl"
        return None
    return "sd"


def _cfg_on(pipe: Any, guidance: float) -> bool:
    unet = getattr(pipe, "unet", None)
    proj = getattr(getattr(unet, "config", None), "time_cond_proj_dim", None)
    return guidance > 1 and proj is None


class ImageSteering:
    """Steer commands of one image stream: checked on the caller's thread, queued, applied on the
    engine thread between two denoising steps.

    ``check()`` runs in `Stream.steer` (via ``writer.on_command``) and raises
    `InvalidArgumentError` for bad input; `ImageRun` drains the queue before the pipeline call
    (a steer that came first just changes the arguments) and after every step.

    Example:
        >>> s = sd.stream("a red circle on a blue background", steps=20, seed=0)   # doctest: +SKIP
        >>> s.steer(prompt="a red circle on a yellow background")                  # doctest: +SKIP
    """

    def __init__(self, pipe: Any, call_kwargs: dict[str, Any], *, prompt_limit: PromptLimit | None = None) -> None:
        self.layout = steer_layout(pipe)
        self._prompt_limit = prompt_limit
        self.pipe_name = type(pipe).__name__
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self.applied: list[dict[str, Any]] = []  # {"step", **changes}: what took effect, in order
        self.closed = False
        unet = getattr(pipe, "unet", None)
        self._guidance_embedded = getattr(getattr(unet, "config", None), "time_cond_proj_dim", None) is not None
        default_guidance = 7.5
        try:
            param = inspect.signature(pipe.__call__).parameters.get("guidance_scale")
            if param is not None and isinstance(param.default, (int, float)):
                default_guidance = float(param.default)
        except (TypeError, ValueError):
            pass
        # What the run is conditioned on now (updated as steers apply).
        self.prompt: str = call_kwargs.get("prompt", "")
        self.negative_prompt: str | None = call_kwargs.get("negative_prompt")
        self.guidance_scale: float = float(call_kwargs.get("guidance_scale", default_guidance))
        self.started = False

    # -- caller's thread -------------------------------------------------------------------------

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The stream's command handler (`StreamWriter.on_command`)."""
        if name == "rewind":
            raise InvalidArgumentError(
                "image streams cannot rewind (there is no text to cut); use steer(prompt=...) to change "
                "the conditioning from the next step, or start a new stream"
            )
        if name != "steer":
            raise InvalidArgumentError(f"image streams do not support {name}()")
        changes = self.check(args, kwargs)
        with self._lock:
            if self.closed:
                raise StreamFinishedError("the image has finished denoising, so it cannot be steered; start a new stream")
            self._pending.append(changes)

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.layout is None:
            raise InvalidArgumentError(
                f"steer() supports Stable Diffusion 1.x/2.x and SDXL pipelines; {self.pipe_name} cannot change "
                "its conditioning mid-run (cancel or finish_early() and start a new stream instead)"
            )
        changes = dict(kwargs)
        if args:
            if len(args) > 1 or "prompt" in changes:
                raise InvalidArgumentError("steer() on an image stream takes one prompt: steer(prompt='...')")
            changes["prompt"] = args[0]
        unknown = sorted(set(changes) - set(_STEER_KEYS))
        if unknown:
            raise InvalidArgumentError(
                f"image steer() takes prompt=, negative_prompt= and guidance_scale=; got unknown {', '.join(unknown)}"
            )
        changes = {k: v for k, v in changes.items() if v is not None}
        if not changes:
            raise InvalidArgumentError("steer() needs at least one of prompt=, negative_prompt=, guidance_scale=")
        for key in ("prompt", "negative_prompt"):
            if key in changes:
                value = changes[key]
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"{key} must be a string, got {type(value).__name__}")
                if key == "prompt" and not value.strip():
                    raise InvalidArgumentError("prompt must not be empty; pass the new prompt, e.g. steer(prompt='a red circle')")
        if "guidance_scale" in changes:
            g = changes["guidance_scale"]
            if isinstance(g, bool) or not isinstance(g, (int, float, np.floating, np.integer)) or not math.isfinite(float(g)) or g < 0:
                raise InvalidArgumentError(f"guidance_scale must be a finite number >= 0, got {g!r}")
            g = float(g)
            changes["guidance_scale"] = g
            if self._guidance_embedded and g != self.guidance_scale:
                raise InvalidArgumentError(
                    f"{self.pipe_name}'s UNet embeds the guidance scale once per run, so it cannot change mid-run"
                )
            with self._lock:
                started, current = self.started, self.guidance_scale
            if started and (g > 1) != (current > 1):
                raise InvalidArgumentError(
                    f"guidance_scale={g:g} would turn classifier-free guidance {'on' if g > 1 else 'off'} mid-run "
                    f"(the run uses {current:g}); keep it {'> 1' if current > 1 else '<= 1'}, or start a new stream"
                )
        if "negative_prompt" in changes:
            with self._lock:
                current = self.guidance_scale
            g = changes.get("guidance_scale", current)
            if g <= 1 or self._guidance_embedded:
                raise InvalidArgumentError(
                    f"negative_prompt has no effect on this run: guidance_scale is {g:g} (<= 1, no classifier-free "
                    "guidance); steer prompt= only, or start a new stream with guidance_scale > 1"
                )
        if self._prompt_limit is not None:
            for key in ("prompt", "negative_prompt"):
                self._prompt_limit.check(key, changes.get(key))
        return changes

    # -- engine thread ---------------------------------------------------------------------------

    def _take(self) -> list[dict[str, Any]]:
        with self._lock:
            taken, self._pending = self._pending, []
            return taken

    def apply_before_start(self, call_kwargs: dict[str, Any]) -> None:
        """Fold steers that came before the first step into the call itself."""
        with self._lock:
            taken, self._pending = self._pending, []
            self.started = True
        for changes in taken:
            self._update(changes)
            self.applied.append({"step": 0, **changes})
        if taken:
            call_kwargs["prompt"] = self.prompt
            if self.negative_prompt is not None:
                call_kwargs["negative_prompt"] = self.negative_prompt
            call_kwargs["guidance_scale"] = self.guidance_scale

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._pending.clear()

    def _update(self, changes: dict[str, Any]) -> None:
        self.prompt = changes.get("prompt", self.prompt)
        self.negative_prompt = changes.get("negative_prompt", self.negative_prompt)
        self.guidance_scale = changes.get("guidance_scale", self.guidance_scale)

    def apply(self, pipe: Any, step: int, callback_kwargs: dict[str, Any], num_images: int) -> dict[str, Any]:
        """Apply queued steers for the steps after ``step``; returns the callback's outputs."""
        taken = self._take()
        if not taken:
            return callback_kwargs
        reencode = False
        for changes in taken:
            if "prompt" in changes or "negative_prompt" in changes:
                reencode = True
            self._update(changes)
            self.applied.append({"step": step, **changes})
        pipe._guidance_scale = self.guidance_scale
        if not reencode:
            return callback_kwargs
        out = dict(callback_kwargs)
        cfg = _cfg_on(pipe, self.guidance_scale)
        device = pipe._execution_device
        attn = getattr(pipe, "cross_attention_kwargs", None)
        lora_scale = attn.get("scale", None) if isinstance(attn, dict) else None
        clip_skip = getattr(pipe, "clip_skip", None)
        if self.layout == "sdxl":
            pos, neg, pooled, neg_pooled = pipe.encode_prompt(
                prompt=self.prompt, device=device, num_images_per_prompt=num_images,
                do_classifier_free_guidance=cfg, negative_prompt=self.negative_prompt,
                lora_scale=lora_scale, clip_skip=clip_skip,
            )  # fmt: skip
            out["prompt_embeds"] = torch.cat([neg, pos], dim=0) if cfg else pos
            out["add_text_embeds"] = (torch.cat([neg_pooled, pooled], dim=0) if cfg else pooled).to(device)
        else:
            pos, neg = pipe.encode_prompt(
                self.prompt, device, num_images, cfg, self.negative_prompt, lora_scale=lora_scale, clip_skip=clip_skip
            )
            out["prompt_embeds"] = torch.cat([neg, pos]) if cfg else pos
            if neg is not None:
                out["negative_prompt_embeds"] = neg
        return out


def _image_pixels(image: Any) -> int:
    """Pixels of one output image: PIL (``size``), or an array / tensor of (..., H, W, C) or (C, H, W)."""
    size = getattr(image, "size", None)
    if isinstance(size, tuple) and len(size) == 2:
        return int(size[0]) * int(size[1])
    shape = tuple(getattr(image, "shape", ()))
    if len(shape) >= 3:
        h, w = (shape[-3], shape[-2]) if shape[-1] in (1, 3, 4) else (shape[-2], shape[-1])
        return int(h) * int(w)
    return 0


def _free_hooks(pipe: Any) -> None:
    free = getattr(pipe, "maybe_free_model_hooks", None)
    if free is not None:
        try:
            free()
        except Exception:  # noqa: BLE001 - cleanup after a stop must not hide why it stopped
            logger.debug("maybe_free_model_hooks failed", exc_info=True)


def _own_pipeline(pipe: Any) -> Any:
    """A shallow copy of ``pipe`` that shares the weights but has its own scheduler and run state."""
    own = copy.copy(pipe)
    own.__dict__["scheduler"] = copy.deepcopy(pipe.scheduler)
    return own


class ImageRun:
    """Runs one `ImageJob` of a model (``context``: what it reads of it) and emits its events to ``writer``."""

    def __init__(
        self, context: RunContext, writer: StreamWriter, job: ImageJob, yield_step: Callable[[], None],
        steering: ImageSteering | None = None, checkpoints: RunCheckpoints | None = None,
    ) -> None:  # fmt: skip
        self.context = context
        self.steering = steering
        self.writer = writer
        self.job = job
        self.stats = RunStats(started=time.perf_counter())
        self.pipe = _own_pipeline(context.pipeline)
        # Offloaded pipelines (accelerate hooks on the UNet) keep a plain UNet: the offload chain
        # is rebuilt from the pipeline's modules, which a gate is not.
        if context.stepper is not None and not hasattr(self.pipe.unet, "_hf_hook"):
            # Same-shape requests share batched UNet calls (`engine.denoiser_batch`).
            self.pipe.__dict__["unet"] = DenoiserGate(self.pipe.unet, context.stepper)
        self.yield_step = yield_step
        self.worker: FrameWorker | None = None
        # Taking checkpoints (``on_checkpoint=``) and resuming from one (``resume_from=``).
        self.checkpoints = checkpoints
        if checkpoints is not None:
            self.stats.resumed_from = self.stats.steps_seen = checkpoints.start_step

    # -- the run --------------------------------------------------------------------------------

    def execute(self) -> None:
        """Run the pipeline to its end (on the engine thread, inside this request's greenlet)."""
        writer, job, run, pipe = self.writer, self.job, self.stats, self.pipe
        if writer.cancelled:
            self._emit_cancelled()
            return
        # x0 is tracked whenever the scheduler allows it: x0 previews and finish_early() need it.
        has_x0 = x0_strategy(pipe.scheduler) is not None
        decoder = build_decoder(job.plan, job.decoders, has_x0=has_x0)
        tracker = X0Tracker(pipe.scheduler) if has_x0 else None
        # Encoding off the engine thread pays where the denoiser runs elsewhere (a GPU); on a CPU it
        # only competes with the denoiser's own threads, so frames are encoded inline there.
        inline = self.context.device.type == "cpu"
        self.worker = worker = FrameWorker(
            self._emit_preview, name=f"multistream-frames-{writer.stream_id[:8]}", inline=inline
        )
        kwargs = dict(job.call_kwargs)
        if self.steering is not None:
            self.steering.apply_before_start(kwargs)
        if self.checkpoints is not None:
            self.checkpoints.install(pipe, kwargs)
        if self.context.takes_step_callback:
            kwargs["callback_on_step_end"] = self._make_callback(decoder, tracker)
            kwargs["callback_on_step_end_tensor_inputs"] = job.tensor_inputs
        run.call_at = time.perf_counter()
        try:
            try:
                with tracker if tracker is not None else nullcontext(), quiet_cut_notices(pipe):
                    output = pipe(**kwargs)
            finally:
                if self.steering is not None:
                    self.steering.close()  # later steers raise: denoising is over
        except _Cancelled:
            worker.close(flush=True)
            _free_hooks(pipe)
            self._emit_cancelled()
            return
        except _FinishEarly:
            worker.close(flush=True)
            self._emit_finished_early()
            _free_hooks(pipe)
            return
        except BaseException:
            try:
                worker.close(flush=False)
            except BaseException:  # noqa: BLE001 - the pipeline's own error is the one to report
                logger.debug("frame worker failed while the pipeline failed", exc_info=True)
            _free_hooks(pipe)
            raise
        pipeline_done = time.perf_counter()
        worker.close(flush=True)
        images = getattr(output, "images", None)
        if images is None:
            images = output[0]
        nsfw = getattr(output, "nsfw_content_detected", None)
        total = run.total or job.steps or 0
        count = len(images)
        encode_started = time.perf_counter()
        frames: list[EncodedFrame] = [encode_frame(images[i], job.final_format, job.final_quality) for i in range(count)]
        extra: dict[str, float] = {
            "final_encode_ms": (time.perf_counter() - encode_started) * 1e3 / max(1, count),
            "final_bytes": float(sum(f.nbytes for f in frames)) / max(1, count),
        }
        if run.last_step_at is not None:
            extra["decode_ms"] = (pipeline_done - run.last_step_at) * 1e3
            if self.context.decode_time is not None and count:
                pixels = sum(_image_pixels(images[i]) for i in range(count))
                self.context.decode_time.record(pixels, pipeline_done - run.last_step_at)
        if job.seed >= 0:
            extra["seed"] = job.seed
        extra.update(self._checkpoint_metrics())
        metrics = run.metrics(worker, **extra)
        for i, frame in enumerate(frames):
            reason = "content_filter" if nsfw is not None and i < len(nsfw) and nsfw[i] else "stop"
            self._emit_done(frame, i, total, total, reason, metrics, last=i == count - 1)

    def _make_callback(self, decoder: PreviewDecoder | None, tracker: X0Tracker | None) -> Callable[..., dict[str, Any]]:
        writer, job, run, checkpoints = self.writer, self.job, self.stats, self.checkpoints

        def callback(pipeline: Any, i: int, t: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            now = time.perf_counter()
            step = int(i) + 1  # a resumed run skips the steps before its checkpoint: i keeps its numbering
            if checkpoints is not None:
                checkpoints.check_step(step)
            if run.total is None:
                total = getattr(pipeline, "_num_timesteps", None)
                if not is_int(total) or total < 1:
                    timesteps = getattr(pipeline.scheduler, "timesteps", None)
                    total = len(timesteps) if timesteps is not None else (job.steps or step)
                run.total = int(total)
            if run.first_step_at is None:
                run.first_step_at = now
            run.last_step_at = now
            run.steps_seen = step
            run.eta.step(step, now)
            latents = callback_kwargs.get("latents")
            if writer.cancelled or writer.finish_early_requested:
                run.stop_step = step
                if latents is not None:
                    x0 = tracker.x0() if tracker is not None else None
                    run.stop_latents = x0 if x0 is not None else latents
                if writer.cancelled:
                    raise _Cancelled()
                raise _FinishEarly()
            if decoder is not None and latents is not None and job.throttle.should_preview(step):
                self._make_preview(decoder, tracker, step, latents)
            if job.user_callback is not None:
                result = job.user_callback(pipeline, i, t, callback_kwargs)
                if result is not None:
                    callback_kwargs = result
            steering = self.steering
            if steering is not None and run.total is not None and step >= run.total:
                steering.close()  # the last step is done: a steer now could not change anything
            # Between two steps: the engine runs other requests' steps, then comes back here.
            self.yield_step()
            if steering is not None:
                # Last moment before the next step: steers that came in while others stepped count.
                callback_kwargs = steering.apply(pipeline, step, callback_kwargs, job.num_images)
            if checkpoints is not None:
                # After the steers: the checkpoint carries the conditioning of the next step.
                checkpoints.after_step(step, run.total, callback_kwargs.get("latents"), steering)
            return callback_kwargs

        return callback

    def _make_preview(self, decoder: PreviewDecoder, tracker: X0Tracker | None, step: int, latents: torch.Tensor) -> None:
        job, run = self.job, self.stats
        started = time.perf_counter()
        source = latents
        if tracker is not None and job.plan.source == "x0":
            x0 = tracker.x0()
            if x0 is not None:
                source = x0
        spatial = unpack_latents(self.pipe, source, job.height, job.width)
        frames = HostFrames(to_uint8_frames(decoder.decode(spatial), job.preview_max_side))
        total = run.total or step
        eta_s = run.eta.eta(total - step, self._decode_estimate())
        assert self.worker is not None
        for index in range(frames.shape[0]):
            pending = PendingFrame(step, total, index, frames, started, eta_s)
            run.last_frames[index] = pending
            self.worker.submit(pending)
        run.previews_made += 1
        run.preview_s += time.perf_counter() - started

    def _decode_estimate(self) -> float:
        """Seconds the final decode will take, from this model's earlier runs (0 before the first)."""
        timer, job = self.context.decode_time, self.job
        if timer is None or job.height is None or job.width is None:
            return 0.0
        return timer.estimate(job.height * job.width * job.num_images) or 0.0

    def _checkpoint_metrics(self) -> dict[str, float]:
        return self.checkpoints.metrics() if self.checkpoints is not None else {}

    # -- events ---------------------------------------------------------------------------------

    def _emit_preview(self, frame: PendingFrame) -> None:
        """Runs on the encoder thread."""
        job, run = self.job, self.stats
        encoded = encode_frame(frame.frames.array(frame.index), job.preview_format, job.preview_quality)
        eta_s = frame.eta_s
        if eta_s is not None:  # the time spent decoding and encoding this preview has passed too
            eta_s = round(max(0.0, eta_s - (time.perf_counter() - frame.made_at)), 3)
        self.writer.image(
            step=frame.step,
            total_steps=frame.total_steps,
            width=encoded.width,
            height=encoded.height,
            mime=encoded.mime,
            data=encoded.data,
            index=frame.index,
            eta_s=eta_s,
        )
        run.encoded += 1
        run.encode_ms += encoded.encode_ms
        run.encoded_bytes += encoded.nbytes
        if run.first_preview_at is None:
            run.first_preview_at = time.perf_counter()

    def _emit_cancelled(self) -> None:
        job, run = self.job, self.stats
        total = run.total or job.steps or 0
        frames: list[tuple[int, EncodedFrame]] = []
        if run.last_frames:
            for index in sorted(run.last_frames):
                pending = run.last_frames[index]
                pixels = pending.frames.array(index)
                frames.append((pending.step, encode_frame(pixels, job.preview_format, job.preview_quality)))
        elif run.stop_latents is not None:
            spatial = unpack_latents(self.pipe, run.stop_latents, job.height, job.width)
            lrgb = self.context.latent_rgb_if_ready()
            if lrgb is not None and lrgb.channels == spatial.shape[1]:
                rgb = LinearDecoder(lrgb).decode(spatial)
            else:
                rgb = false_color(spatial)
            host = HostFrames(to_uint8_frames(rgb, job.preview_max_side))
            for index in range(host.shape[0]):
                frames.append((run.stop_step, encode_frame(host.array(index), job.preview_format, job.preview_quality)))
        else:
            # Cancelled before the first step: nothing to show but a placeholder pixel.
            blank = encode_frame(np.full((1, 1, 3), 128, dtype=np.uint8), job.preview_format, job.preview_quality)
            frames = [(0, blank)] * job.num_images
        extra = {"seed": job.seed} if job.seed >= 0 else {}
        extra.update(self._checkpoint_metrics())
        metrics = run.metrics(self.worker, **extra)
        for i, (step, frame) in enumerate(frames):
            self._emit_done(frame, i, step, total, "cancelled", metrics, last=i == len(frames) - 1)

    def _emit_finished_early(self) -> None:
        """The current x0 estimate through the full VAE: a full-quality final, as a normal end has."""
        job, run = self.job, self.stats
        total = run.total or job.steps or 0
        vae = getattr(self.pipe, "vae", None)
        if run.stop_latents is None or vae is None:
            self._emit_cancelled()  # nothing to decode yet (or no VAE): the best there is
            return
        started = time.perf_counter()
        spatial = unpack_latents(self.pipe, run.stop_latents, job.height, job.width)
        rgb = make_decoder("vae", job.decoders).decode(spatial)
        host = HostFrames(to_uint8_frames(rgb, None))
        frames = [encode_frame(host.array(i), job.final_format, job.final_quality) for i in range(host.shape[0])]
        extra = {"decode_ms": (time.perf_counter() - started) * 1e3}
        if job.seed >= 0:
            extra["seed"] = job.seed
        extra.update(self._checkpoint_metrics())
        metrics = run.metrics(self.worker, **extra)
        for i, frame in enumerate(frames):
            self._emit_done(frame, i, run.stop_step, total, "finished_early", metrics, last=i == len(frames) - 1)

    def _emit_done(
        self, frame: EncodedFrame, index: int, step: int, total: int, reason: str, metrics: dict[str, float], *, last: bool
    ) -> None:
        writer = self.writer
        steers = len(self.steering.applied) if self.steering is not None else 0
        if self.checkpoints is not None:
            steers += self.checkpoints.steers_before
        if steers:
            metrics = {**metrics, "steers": float(steers)}
        if last:
            writer.image(
                step=step, total_steps=total, width=frame.width, height=frame.height, mime=frame.mime,
                data=frame.data, index=index, is_final=True, finish_reason=reason, metrics=metrics, eta_s=0.0,
            )  # fmt: skip
            return
        # A finished image that is not the last of the batch: never merged or dropped (it carries
        # a finish_reason), and not final (only the last event of a stream is).
        done = ImageEvent(
            stream_id=writer.stream_id, seq=0, t=0.0, step=step, total_steps=total, width=frame.width,
            height=frame.height, mime=frame.mime, data=frame.data, index=index, finish_reason=reason,
            metrics=metrics, eta_s=0.0,
        )  # fmt: skip
        writer.forward(done, is_final=False)
