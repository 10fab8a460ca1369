"""One image request from its first step to its final event: the step callback and what it emits.

An `ImageRun` calls the pipeline once, on the model's engine thread, with a step callback that

* records timing, makes a preview at the steps `PreviewThrottle` picks and hands it to the
  stream's `FrameWorker` (encoding happens off the engine thread);
* stops at once on ``cancel()`` (no VAE decode: the final event is the newest preview) and on
  ``finish_early()`` (the current estimate of the clean image through the full VAE, PNG);
* calls the user's own ``callback_on_step_end`` after ours;
* hands control back to the engine (``yield_step``) so other requests get their steps.

The pipeline object is the request's own shallow copy with its own scheduler (schedulers keep
per-run state: timesteps, step index), so runs can interleave step by step on one set of weights.

Example (what `ImageModel` does on the engine thread):
    >>> run = ImageRun(model, writer, job, yield_step=lambda: None)   # doctest: +SKIP
    >>> run.execute()                                                 # doctest: +SKIP
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .events import ImageEvent
from .frames import EncodedFrame, encode_frame
from .latent_rgb import latents_to_rgb
from .previews import FrameWorker, HostFrames, PendingFrame, VaeDecoder, X0Tracker, false_color, to_uint8_frames, unpack_latents, x0_strategy
from .stream import StreamWriter

if TYPE_CHECKING:
    from .image import ImageModel, ImageJob

__all__ = ["ImageRun", "RunStats"]

logger = logging.getLogger("multistream")


class _Cancelled(BaseException):
    """Raised out of the step callback to stop the pipeline before its final VAE decode.

    A BaseException, so that an ``except Exception`` inside a pipeline cannot swallow it.
    """


class _FinishEarly(BaseException):
    """Raised out of the step callback to stop denoising and decode the current x0 estimate."""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


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

    def metrics(self, worker: FrameWorker | None, **extra: float) -> dict[str, float]:
        now = time.perf_counter()
        out: dict[str, float] = {"duration_ms": (now - self.started) * 1e3, "steps": float(self.steps_seen)}
        if self.first_step_at is not None:
            out["time_to_first_step_ms"] = (self.first_step_at - self.started) * 1e3
            if self.steps_seen > 1 and self.last_step_at is not None:
                out["ms_per_step"] = (self.last_step_at - self.first_step_at) * 1e3 / (self.steps_seen - 1)
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
        out.update({k: float(v) for k, v in extra.items()})
        return out


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
    """Runs one `ImageJob` of ``model`` and emits its events to ``writer``."""

    def __init__(self, model: ImageModel, writer: StreamWriter, job: ImageJob, yield_step: Callable[[], None]) -> None:
        self.model = model
        self.writer = writer
        self.job = job
        self.stats = RunStats(started=time.perf_counter())
        self.pipe = _own_pipeline(model.pipeline)
        self.yield_step = yield_step
        self.worker: FrameWorker | None = None

    # -- the run --------------------------------------------------------------------------------

    def execute(self) -> None:
        """Run the pipeline to its end (on the engine thread, inside this request's greenlet)."""
        writer, job, run, pipe = self.writer, self.job, self.stats, self.pipe
        if writer.cancelled:
            self._emit_cancelled()
            return
        decoder = self.model._decoder(job)
        # x0 is tracked whenever the scheduler allows it: x0 previews and finish_early() need it.
        tracker = X0Tracker(pipe.scheduler) if x0_strategy(pipe.scheduler) is not None else None
        # Encoding off the engine thread pays where the denoiser runs elsewhere (a GPU); on a CPU it
        # only competes with the denoiser's own threads, so frames are encoded inline there.
        inline = self.model.device.type == "cpu"
        self.worker = worker = FrameWorker(
            self._emit_preview, name=f"multistream-frames-{writer.stream_id[:8]}", inline=inline
        )
        kwargs = dict(job.call_kwargs)
        if self.model._takes_step_callback:
            kwargs["callback_on_step_end"] = self._make_callback(decoder, tracker)
            kwargs["callback_on_step_end_tensor_inputs"] = job.tensor_inputs
        run.call_at = time.perf_counter()
        try:
            with tracker if tracker is not None else nullcontext():
                output = pipe(**kwargs)
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
        if job.seed >= 0:
            extra["seed"] = float(job.seed)
        metrics = run.metrics(worker, **extra)
        for i, frame in enumerate(frames):
            reason = "content_filter" if nsfw is not None and i < len(nsfw) and nsfw[i] else "stop"
            self._emit_done(frame, i, total, total, reason, metrics, last=i == count - 1)

    def _make_callback(
        self, decoder: Callable[[torch.Tensor], torch.Tensor] | None, tracker: X0Tracker | None
    ) -> Callable[..., dict[str, Any]]:
        writer, job, run = self.writer, self.job, self.stats

        def callback(pipeline: Any, i: int, t: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            now = time.perf_counter()
            step = int(i) + 1
            if run.total is None:
                total = getattr(pipeline, "_num_timesteps", None)
                if not _is_int(total) or total < 1:
                    timesteps = getattr(pipeline.scheduler, "timesteps", None)
                    total = len(timesteps) if timesteps is not None else (job.steps or step)
                run.total = int(total)
            if run.first_step_at is None:
                run.first_step_at = now
            run.last_step_at = now
            run.steps_seen = step
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
            # Between two steps: the engine runs other requests' steps, then comes back here.
            self.yield_step()
            return callback_kwargs

        return callback

    def _make_preview(
        self, decoder: Callable[[torch.Tensor], torch.Tensor], tracker: X0Tracker | None, step: int, latents: torch.Tensor
    ) -> None:
        job, run = self.job, self.stats
        started = time.perf_counter()
        source = latents
        if tracker is not None and job.plan.source == "x0":
            x0 = tracker.x0()
            if x0 is not None:
                source = x0
        spatial = unpack_latents(self.pipe, source, job.height, job.width)
        frames = HostFrames(to_uint8_frames(decoder(spatial), job.preview_max_side))
        total = run.total or step
        assert self.worker is not None
        for index in range(frames.shape[0]):
            pending = PendingFrame(step, total, index, frames, started)
            run.last_frames[index] = pending
            self.worker.submit(pending)
        run.previews_made += 1
        run.preview_s += time.perf_counter() - started

    # -- events ---------------------------------------------------------------------------------

    def _emit_preview(self, frame: PendingFrame) -> None:
        """Runs on the encoder thread."""
        job, run = self.job, self.stats
        encoded = encode_frame(frame.frames.array(frame.index), job.preview_format, job.preview_quality)
        self.writer.image(
            step=frame.step,
            total_steps=frame.total_steps,
            width=encoded.width,
            height=encoded.height,
            mime=encoded.mime,
            data=encoded.data,
            index=frame.index,
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
            lrgb = self.model._latent_rgb_if_ready()
            rgb = latents_to_rgb(spatial, lrgb) if lrgb is not None and lrgb.channels == spatial.shape[1] else false_color(spatial)
            host = HostFrames(to_uint8_frames(rgb, job.preview_max_side))
            for index in range(host.shape[0]):
                frames.append((run.stop_step, encode_frame(host.array(index), job.preview_format, job.preview_quality)))
        else:
            # Cancelled before the first step: nothing to show but a placeholder pixel.
            blank = encode_frame(np.full((1, 1, 3), 128, dtype=np.uint8), job.preview_format, job.preview_quality)
            frames = [(0, blank)] * job.num_images
        extra = {"seed": float(job.seed)} if job.seed >= 0 else {}
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
        rgb = VaeDecoder(self.model._preview_vae(), "vae")(spatial)
        host = HostFrames(to_uint8_frames(rgb, None))
        frames = [encode_frame(host.array(i), job.final_format, job.final_quality) for i in range(host.shape[0])]
        extra = {"decode_ms": (time.perf_counter() - started) * 1e3}
        if job.seed >= 0:
            extra["seed"] = float(job.seed)
        metrics = run.metrics(self.worker, **extra)
        for i, frame in enumerate(frames):
            self._emit_done(frame, i, run.stop_step, total, "finished_early", metrics, last=i == len(frames) - 1)

    def _emit_done(
        self, frame: EncodedFrame, index: int, step: int, total: int, reason: str, metrics: dict[str, float], *, last: bool
    ) -> None:
        writer = self.writer
        if last:
            writer.image(
                step=step, total_steps=total, width=frame.width, height=frame.height, mime=frame.mime,
                data=frame.data, index=index, is_final=True, finish_reason=reason, metrics=metrics,
            )  # fmt: skip
            return
        # A finished image that is not the last of the batch: never merged or dropped (it carries
        # a finish_reason), and not final (only the last event of a stream is).
        done = ImageEvent(
            stream_id=writer.stream_id, seq=0, t=0.0, step=step, total_steps=total, width=frame.width,
            height=frame.height, mime=frame.mime, data=frame.data, index=index, finish_reason=reason,
            metrics=metrics,
        )  # fmt: skip
        writer.forward(done, is_final=False)
