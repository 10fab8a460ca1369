"""The video adapter: a diffusers text-to-video pipeline that streams every frame's preview per step.

``ms.load_video_model(...)`` gives a `VideoModel`; its ``stream(prompt, ...)`` runs the pipeline on
the model's engine thread (requests interleave step by step, higher ``priority`` first, as image
requests do) and emits, at each previewed step, the current estimate of **every frame** as one
``video`` event (an animated WebP, or a JPEG contact sheet), then the finished clip (WebM/VP9 by
default, MP4/H.264 when asked) as the final event. ``cancel()`` stops within one step;
``finish_early()`` ends with the current clean estimate through the full VAE; ``steer(prompt=...)``
conditions the following steps on a new prompt. Any diffusers video pipeline with
``callback_on_step_end`` works: Wan 2.1/2.2, CogVideoX, LTX-Video, AnimateDiff and their kin
(`multistream.video._layout` reads their latents).

Example:
    >>> import multistream as ms
    >>> vm = ms.load_video_model()                                                   # doctest: +SKIP
    >>> for ev in vm.stream("a red circle moving right on a blue background", steps=20):  # doctest: +SKIP
    ...     print(ev.step, ev.total_steps, ev.num_frames, ev.mime, len(ev.data))
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import threading
from typing import Any, Callable

import torch

from .._devices import moved_pipeline
from ..diffusion._checkpoint import ImageCheckpoint, RunCheckpoints, checkpoint_plan
from ..diffusion._prompt_length import PromptLimit
from ..diffusion._sizes import ImageSizes, check_max_frames, sizes_for
from ..diffusion._stepper import ImageRequest, ImageStepper
from ..engine import DEFAULT_CAPACITY, EngineModel
from ..engine.settings import engine_thread_setup
from ..errors import InvalidArgumentError
from ..events import Event
from ..stream import Stream, StreamWriter
from ._layout import VideoLatents
from ._motion_prior import MotionPrior
from ._options import parse_video_options, refuse_pipeline_argument
from ._previews import PerFrameNet, VideoDecoderParts, fit_video_latent_rgb
from ._run import RunContext, VideoJob, VideoRun, VideoSteering

__all__ = ["VideoModel"]

logger = logging.getLogger("multistream")

# What a pipeline's own __call__ signature does not say, per family: (num_frames, fps, steps, guidance).
_FAMILY_DEFAULTS: dict[str, tuple[int, float, int, float]] = {
    "wan": (81, 16.0, 50, 5.0), "cogvideox": (49, 8.0, 50, 6.0), "ltx": (161, 25.0, 50, 3.0),
    "animatediff": (16, 8.0, 50, 7.5),
}  # fmt: skip


class VideoModel(EngineModel):
    """A diffusers text-to-video pipeline that streams previews of every frame and then the clip.

    Build it with `load_video_model`, or wrap a pipeline you have: ``VideoModel(pipe)``.
    ``defaults`` (``{"num_frames", "fps", "steps", "guidance_scale", "width", "height"}``, any
    subset; a model folder's ``video.json``) set what ``None`` means for those options; the rest
    come from the pipeline's signature and its family. ``preview_decoder``: the ``"tiny"`` decoder
    (a module from ``(1, C, F', h, w)`` latents to ``(1, 3, F, H, W)`` in [0, 1]); by default one
    fitted to this VAE on first use (`multistream.fit_preview_decoder`, cached per VAE), or the one
    shipped in ``model_dir`` (``preview_decoder.safetensors``: a video decoder for a 3D VAE, the
    image decoder for a 2D one); likewise ``latent_rgb.json`` for the ``"latent"`` map.
    ``sizes``: the heights and widths it accepts (`ImageSizes`); by default multiples of the
    latent grid up to twice the native side. ``motion_prior``: initial latents that lean toward the
    motion the prompt names (`MotionPrior`; a folder's ``motion_prior.json``: the embedded model's).

    Example:
        >>> from diffusers import WanPipeline                       # doctest: +SKIP
        >>> vm = VideoModel(WanPipeline.from_pretrained("./wan"))   # doctest: +SKIP
        >>> vm.generate("a fox running in snow", steps=30).save("fox.webm")   # doctest: +SKIP
    """

    #: Streams a server runs at once on this model; they take turns step by step.
    capacity = DEFAULT_CAPACITY

    def __init__(
        self,
        pipeline: Any,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        name: str | None = None,
        model_dir: str | os.PathLike[str] | None = None,
        defaults: dict[str, Any] | None = None,
        preview_decoder: Any = None,
        sizes: ImageSizes | None = None,
        motion_prior: MotionPrior | None = None,
    ) -> None:
        if isinstance(pipeline, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"VideoModel wraps a diffusers pipeline object; to load a folder or hub id use ms.load_video_model({os.fspath(pipeline)!r})"
            )
        if not callable(pipeline) or getattr(pipeline, "scheduler", None) is None:
            raise InvalidArgumentError(f"VideoModel needs a diffusers video pipeline (with a scheduler), got {type(pipeline).__name__}")
        try:
            params = dict(inspect.signature(pipeline.__call__).parameters)
        except (TypeError, ValueError):
            params = {}
        if "callback_on_step_end" not in params:
            raise InvalidArgumentError(
                f"{type(pipeline).__name__} takes no callback_on_step_end, so multistream cannot stream its steps; "
                "use a diffusers video pipeline that has one (Wan, CogVideoX, LTX-Video, AnimateDiff, HunyuanVideo, Mochi, ...)"
            )
        pipeline = moved_pipeline(pipeline, device, dtype)
        if hasattr(pipeline, "set_progress_bar_config"):
            pipeline.set_progress_bar_config(disable=True)  # progress goes out as events
        self._pipe = pipeline
        self._params = params
        self.layout = VideoLatents.of(pipeline)
        self.name = name or getattr(getattr(pipeline, "config", None), "_name_or_path", None) or type(pipeline).__name__
        self._model_dir = os.fspath(model_dir) if model_dir is not None else None
        self._defaults = dict(defaults or {})
        unknown = set(self._defaults) - {"num_frames", "fps", "steps", "guidance_scale", "width", "height"}
        if unknown:
            raise InvalidArgumentError(f"unknown video defaults {sorted(unknown)}; use num_frames, fps, steps, "
                                       "guidance_scale, width, height")
        if sizes is not None and not isinstance(sizes, ImageSizes):
            raise InvalidArgumentError(f"sizes must be an ImageSizes, got {type(sizes).__name__}")
        self._sizes = sizes
        self._motion_prior = motion_prior if "latents" in params else None
        self._lock = threading.Lock()
        if preview_decoder is not None and self.layout.per_frame and not isinstance(preview_decoder, PerFrameNet):
            preview_decoder = PerFrameNet(preview_decoder)  # an image decoder, run on every frame
        self._tiny: Any = preview_decoder
        allowed = tuple(getattr(pipeline, "_callback_tensor_inputs", None) or ("latents",))
        self._tensor_inputs = tuple(n for n in ("latents", "prompt_embeds", "negative_prompt_embeds", "add_text_embeds")
                                   if n in allowed)
        self._prompt_limit = PromptLimit.of(pipeline, "video")  # None: no one number of tokens is read
        self._stepper = ImageStepper(1)  # each request runs its own pipeline call; steps interleave
        self.start_engine(self._stepper, name=f"video-{self.name}", setup=engine_thread_setup)

    # -- what the model is ----------------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        """The diffusers pipeline itself."""
        return self._pipe

    @property
    def device(self) -> torch.device:
        for attr in ("transformer", "unet", "vae"):
            module = getattr(self._pipe, attr, None)
            if module is not None and hasattr(module, "parameters"):
                for p in module.parameters():
                    return p.device
        return torch.device("cpu")

    def _family_default(self, index: int) -> Any:
        return _FAMILY_DEFAULTS.get(self.layout.family, (16, 8.0, 25, 5.0))[index]

    def _signature_default(self, name: str) -> Any:
        param = self._params.get(name)
        value = param.default if param is not None else inspect.Parameter.empty
        return None if value is inspect.Parameter.empty else value

    @property
    def default_num_frames(self) -> int:
        """Frames of a clip when ``num_frames`` is not given."""
        value = self._defaults.get("num_frames") or self._signature_default("num_frames") or self._family_default(0)
        return int(value)

    @property
    def default_fps(self) -> float:
        """Frames per second of a clip when ``fps`` is not given (LTX's ``frame_rate``, else the family's)."""
        return float(self._defaults.get("fps") or self._signature_default("frame_rate") or self._family_default(1))

    @property
    def default_steps(self) -> int:
        return int(self._defaults.get("steps") or self._signature_default("num_inference_steps") or self._family_default(2))

    @property
    def default_guidance_scale(self) -> float:
        value = self._defaults.get("guidance_scale")
        if value is None:
            value = self._signature_default("guidance_scale")
        return float(value if value is not None else self._family_default(3))

    @property
    def size_multiple(self) -> int:
        """Every side is a multiple of this: the VAE's spatial factor times the denoiser's patch."""
        patch = 1
        denoiser = getattr(self._pipe, "transformer", None)
        if denoiser is not None:
            p = getattr(denoiser.config, "patch_size", 1)
            patch = int(p[-1] if isinstance(p, (list, tuple)) else p or 1)
        elif getattr(self._pipe, "unet", None) is not None:
            patch = 2 ** (len(self._pipe.unet.config.block_out_channels) - 1)
        return self.layout.spatial * patch

    @property
    def default_size(self) -> tuple[int, int]:
        """``(height, width)`` of a clip when none is given."""
        h = self._defaults.get("height") or self._signature_default("height")
        w = self._defaults.get("width") or self._signature_default("width")
        if h is None or w is None:
            unet = getattr(self._pipe, "unet", None)
            side = int(unet.config.sample_size) * self.layout.spatial if unet is not None else 480
            h, w = h or side, w or side
        return int(h), int(w)

    @property
    def sizes(self) -> ImageSizes:
        """The heights and widths this model accepts (and its native size); a size outside is
        refused by `stream` before any work, naming these.

        Example:
            >>> ms.load_video_model().sizes.describe()      # doctest: +SKIP
            'sides that are multiples of 16 from 16 to 128 pixels, native 64x64'
        """
        if self._sizes is not None:
            return self._sizes
        multiple = self.size_multiple
        found = sizes_for(multiple, self.default_size, f"the VAE downsamples by {self.layout.spatial} and the denoiser "
                          f"patches by {multiple // self.layout.spatial}")
        return ImageSizes(multiple=multiple, min_side=multiple, max_side=max(found.max_side - found.max_side % multiple, multiple),
                          native=found.native, why=found.why)

    @property
    def max_num_frames(self) -> int | None:
        """The most frames the denoiser can take, where its config says (AnimateDiff's motion modules:
        their positional table, ``motion_max_seq_length``, 32 for the embedded model); None where
        nothing says (Wan, LTX: their memory is the limit).

        Example:
            >>> ms.load_video_model().max_num_frames      # doctest: +SKIP
            32
        """
        config = getattr(getattr(self._pipe, "unet", None), "config", None)
        limit = getattr(config, "motion_max_seq_length", None) if config is not None else None
        return int(limit) if isinstance(limit, int) and limit > 0 else None

    def check_num_frames(self, num_frames: int) -> int:
        """``num_frames`` if the denoiser takes that many (`max_num_frames`) and the VAE can make
        them (``1 + temporal * k`` for a causal 3D VAE), else `InvalidArgumentError` naming the counts
        it can make. Found at call time: 33 frames on the embedded model failed in its first step
        with a tensor-size error from diffusers."""
        check_max_frames(num_frames, self.max_num_frames)
        t = self.layout.temporal
        if t > 1 and (num_frames - 1) % t:
            lower = num_frames - (num_frames - 1) % t
            raise InvalidArgumentError(
                f"num_frames={num_frames} does not fit this model's VAE, which makes 1 + {t}*k frames; "
                f"use e.g. num_frames={max(1, lower)} or {lower + t}"
            )
        return num_frames

    # -- streaming ------------------------------------------------------------------------------

    def stream(self, prompt: str, *, resume_from: ImageCheckpoint | bytes | None = None,
               on_checkpoint: Callable[[ImageCheckpoint], Any] | None = None, checkpoint_every: int = 1,
               **options: Any) -> Stream:
        """Start generating; returns a `Stream` of ``video`` events (previews, then the clip).

        Options (each declared once in `multistream.video.VideoOptions`): ``num_frames``, ``fps``,
        ``steps``, ``seed``, ``guidance_scale``, ``negative_prompt``, ``height``, ``width`` (None:
        the model's defaults), ``preview`` (``"tiny"`` | ``"latent"`` | ``"x0"`` | ``"vae"`` |
        ``"none"``, see `multistream.video._previews`), ``preview_every``, ``preview_format``
        (``"webp"`` animated | ``"sheet"`` JPEG contact sheet), ``preview_max_side``,
        ``priority``, ``video_format`` (``"webm"`` VP9 | ``"mp4"`` H.264). Other keywords go to the
        pipeline call (a ``callback_on_step_end`` of yours runs after multistream's own). Bad
        arguments raise `InvalidArgumentError` here, before anything runs.

        ``on_checkpoint=fn`` calls ``fn(checkpoint)`` on the engine thread (keep it quick) after
        every ``checkpoint_every``-th step with a checkpoint of the run (the image family's
        `multistream.image.ImageCheckpoint`: latents, scheduler state, conditioning after steers);
        ``resume_from=checkpoint`` (or its ``to_bytes()``), with the arguments of the run it came
        from, continues after its step and ends with the same clip (see `multistream.diffusion._checkpoint`).

        Example:
            >>> s = vm.stream("a red circle moving right on a blue background", steps=20, seed=0)  # doctest: +SKIP
            >>> for ev in s:                                                                    # doctest: +SKIP
            ...     if ev.step == 10: s.finish_early()
        """
        job = self._prepare(prompt, options, resuming=resume_from is not None)
        checkpoints = checkpoint_plan(self._run_context(), job, resume_from, on_checkpoint, checkpoint_every)

        def submit(writer: StreamWriter) -> None:
            steering = VideoSteering(self._pipe, job.call_kwargs, prompt_limit=self._prompt_limit)
            writer.on_command(steering.handle)
            self.engine.submit(_VideoRequest(self, writer, job, steering, checkpoints))

        return Stream(submit=submit, kind="video")

    def generate(self, prompt: str, *, on_event: Callable[[Event], Any] | None = None, **options: Any) -> Event:
        """Run to the end, calling ``on_event`` for each event; returns the final event (the clip).

        Example:
            >>> vm.generate("a blue square moving up", steps=20).save("clip.webm")   # doctest: +SKIP
        """
        return self.stream(prompt, **options).wait(on_event)

    def _prepare(self, prompt: Any, given: dict[str, Any], resuming: bool = False) -> VideoJob:
        options = parse_video_options(prompt, **given)
        height, width = self.sizes.native_or(options.height, options.width)
        if height is None or width is None:
            height, width = self.default_size
        num_frames = self.check_num_frames(options.num_frames or self.default_num_frames)
        steps = options.steps or self.default_steps
        guidance = options.guidance_scale if options.guidance_scale is not None else self.default_guidance_scale
        fps = options.fps or self.default_fps
        kwargs: dict[str, Any] = {}
        user_callback = None

        def put(name: str, value: Any, what: str | None = None) -> None:
            if value is None:
                return
            if name not in self._params:
                raise InvalidArgumentError(f"{type(self._pipe).__name__} takes no {what or name!r} argument")
            kwargs[name] = value

        put("prompt", options.prompt)
        put("negative_prompt", options.negative_prompt)
        if self._prompt_limit is not None:
            # Said once here, in a line; the libraries' own notices of it are dropped in the run.
            self._prompt_limit.check("prompt", options.prompt)
            self._prompt_limit.check("negative_prompt", options.negative_prompt)
        put("num_inference_steps", steps, "steps")
        put("guidance_scale", guidance)
        put("num_frames", num_frames)
        put("height", height)
        put("width", width)
        if "frame_rate" in self._params:
            kwargs["frame_rate"] = int(round(fps))  # LTX conditions on it
        for key, value in options.pipeline_kwargs.items():
            if key == "callback_on_step_end":
                user_callback = value
                continue
            if key not in self._params:
                refuse_pipeline_argument(key, type(self._pipe).__name__)
            put(key, value)
        seed = options.seed
        if "generator" not in kwargs:
            if seed is None:
                seed = random.randrange(2**31)
            kwargs["generator"] = torch.Generator("cpu").manual_seed(int(seed))
        # A resumed run's latents come from its checkpoint, so the prior (an encode of 32 clips, seconds on
        # a busy CPU, the first time a restarted server meets a description) is skipped: the pipeline's own
        # noise draw has the prior's shape, so the generator ends where the original run's did.
        if (self._motion_prior is not None and not resuming and "latents" not in kwargs
                and isinstance(kwargs["generator"], torch.Generator)):
            latents = self._motion_prior.initial_latents(
                self.layout, self._pipe.scheduler, options.prompt, num_frames=num_frames, height=height, width=width,
                generator=kwargs["generator"])
            if latents is not None:
                kwargs["latents"] = latents
        if options.preview == "tiny":
            self._tiny_net()  # fitted (once per VAE) here, on the caller's thread, not between two steps
        elif options.preview in ("latent", "x0"):
            self._latent_rgb()
        return VideoJob(
            call_kwargs=kwargs, steps=steps, num_frames=num_frames, fps=fps, height=height, width=width,
            seed=int(seed) if seed is not None else -1, preview=options.preview, throttle=options.throttle,
            preview_format=options.preview_format, preview_max_side=options.preview_max_side,
            video_format=options.video_format, priority=options.priority, user_callback=user_callback,
        )

    # -- preview decoders -----------------------------------------------------------------------

    def _latent_rgb(self) -> Any:
        with self._lock:
            cached = getattr(self, "_linear", None)
            if cached is not None:
                return cached
            from ..diffusion._latent_rgb import LATENT_RGB_FILE, LatentRGB, latent_rgb_for

            if self.layout.per_frame:
                found = latent_rgb_for(self._pipe, self._model_dir)
            elif self._model_dir and os.path.isfile(os.path.join(self._model_dir, LATENT_RGB_FILE)):
                found = LatentRGB.load(os.path.join(self._model_dir, LATENT_RGB_FILE))  # shipped with the model
            else:
                found = fit_video_latent_rgb(self.layout)
            self._linear = found
            return found

    def _tiny_net(self) -> Any:
        with self._lock:
            if self._tiny is None:
                if self.layout.per_frame:
                    from ..diffusion._preview_decoder import preview_decoder_for, shipped_preview_decoder_path

                    if shipped_preview_decoder_path(self._model_dir) is None:
                        logger.warning("fitting a preview decoder to this VAE for preview='tiny' (once; cached per VAE)")
                    net = preview_decoder_for(self._pipe, self._model_dir)
                    self._tiny = PerFrameNet(net.to(self.device))  # type: ignore[union-attr]
                else:
                    from ..diffusion._preview_decoder import shipped_preview_decoder_path
                    from ._tiny import (
                        cached_video_preview_decoder,
                        fit_video_preview_decoder,
                        load_video_preview_decoder,
                    )

                    shipped = shipped_preview_decoder_path(self._model_dir)
                    net = load_video_preview_decoder(shipped) if shipped is not None else None
                    if net is None:
                        if cached_video_preview_decoder(self._pipe.vae) is None:
                            logger.warning("fitting a video preview decoder to this VAE for preview='tiny' (once; cached per VAE)")
                        net = fit_video_preview_decoder(self._pipe.vae)
                    self._tiny = net.to(self.device)
            return self._tiny

    def _run_context(self) -> RunContext:
        return RunContext(pipeline=self._pipe, layout=self.layout,
                          decoders=VideoDecoderParts(latent_rgb=self._latent_rgb, tiny_net=self._tiny_net),
                          device=self.device, tensor_inputs=self._tensor_inputs, params=self._params)

    def __repr__(self) -> str:
        return f"<VideoModel {self.name} ({self.layout.family}) on {self.device}>"


class _VideoRequest(ImageRequest):
    """Binds one job of a `VideoModel` to the engine's step scheduler."""

    def __init__(self, model: VideoModel, writer: StreamWriter, job: VideoJob, steering: VideoSteering,
                 checkpoints: RunCheckpoints | None = None) -> None:
        super().__init__(self._start, writer.fail, self._cancel, priority=job.priority, steps_left=self._steps_left,
                         cancelled=lambda: writer.cancelled)
        self._model, self._writer, self._job, self._steering = model, writer, job, steering
        self._checkpoints = checkpoints
        self._run: VideoRun | None = None

    def _steps_left(self) -> int:
        return self._job.steps - (self._run.stats.steps if self._run is not None else 0)

    def _start(self, yield_step: Callable[[], None]) -> None:
        self._run = VideoRun(self._model._run_context(), self._writer, self._job, yield_step, self._steering,
                             self._checkpoints)
        self._run.execute()

    def _cancel(self) -> None:
        self._steering.close()
        if self._run is None:
            self._run = VideoRun(self._model._run_context(), self._writer, self._job, lambda: None)
        self._run.emit_cancelled()
