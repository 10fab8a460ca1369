"""The diffusers adapter: live denoising previews, then the finished image, as ``image`` events.

``ms.load_image_model(...)`` gives an `ImageModel`; its ``stream(prompt, ...)`` runs the pipeline
on the model's engine thread (requests interleave step by step, higher ``priority`` first) and
emits small compressed preview frames while it denoises (from
``callback_on_step_end``), then the full-quality image as the final event. Any diffusers pipeline
with that hook works: Stable Diffusion 1.x/2.x, SDXL, SD3, Flux and their relatives.

It behaves like the text streams: ``cancel()`` stops within one step and skips the final VAE
decode; an exception in the pipeline becomes an ``error`` event; a slow consumer only gets the
newest preview of each image, and the final image is never dropped.

The cancelled stream's final event (``finish_reason="cancelled"``) carries the newest preview
that was made (same pixels, in ``preview_format``), or, if no preview was made yet, a cheap
render of the latents where the run stopped (the linear latent->RGB map if one is at hand, else a
false-colour view), at preview size. It never runs the VAE.

``steer(prompt=..., negative_prompt=..., guidance_scale=...)`` changes the conditioning from the
next denoising step on (Stable Diffusion 1.x/2.x and SDXL; the latents, so the composition so
far, are kept); a steer before the first step gives the same image as starting with the new
values. The final event's ``metrics["steers"]`` counts the steers that took effect.

With ``num_images > 1`` each image has its own previews (``index``); every finished image carries
``finish_reason`` and the last one is the stream's final event.

The module is split by job: `multistream.image._options` checks the arguments that do not depend
on the model (torch-free, and shared with the scripted fake in `multistream.testing`, so both
refuse the same values and preview the same steps); this class adds the checks that need the
pipeline (sizes as multiples of its VAE's factor, TAESD weights, pipeline arguments, step
callbacks); `multistream.image._run` runs one request on the engine thread and
`multistream.diffusion._previews` turns latents into preview frames.

Example:
    >>> import multistream as ms
    >>> sd = ms.load_image_model()                                               # doctest: +SKIP
    >>> for ev in sd.stream("a red circle on a blue background", steps=20, seed=0):  # doctest: +SKIP
    ...     print(ev.step, ev.total_steps, ev.mime, len(ev.data))
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import threading
import warnings
from typing import Any, Callable

import torch

from .._checks import is_int
from .._devices import moved_pipeline
from .._eta import PerPixelTime
from ..diffusion._checkpoint import ImageCheckpoint, RunCheckpoints, checkpoint_plan
from ..diffusion._job import ImageJob, RunContext
from ..diffusion._latent_rgb import LatentRGB, detect_family, latent_rgb_for
from ..diffusion._previews import DecoderParts, settle_plan, x0_strategy
from ..diffusion._prompt_length import PromptLimit
from ..diffusion._sizes import ImageSizes, sizes_for
from ..diffusion._stepper import ImageRequest, ImageStepper
from ..engine import DEFAULT_CAPACITY, EngineModel
from ..engine.settings import engine_thread_setup
from ..errors import InvalidArgumentError
from ..events import Event
from ..stream import Stream, StreamWriter
from ._options import PreviewPlan, parse_image_options, parse_preview, refuse_pipeline_argument
from ._run import ImageRun, ImageSteering
from ._taesd import load_taesd

__all__ = ["ImageModel"]

logger = logging.getLogger("multistream")


class ImageModel(EngineModel):
    """A diffusers pipeline that streams denoising previews and its final image as events.

    Build it with `load_image_model`, or wrap a pipeline you already have: ``ImageModel(pipe)``
    (then nothing is moved unless ``device``/``dtype`` are given). ``pipeline`` is the diffusers
    pipeline itself. One model runs one generation at a time; further streams wait their turn.

    The pipeline's own tqdm progress bar is turned off (progress arrives as events); turn it back
    on with ``model.pipeline.set_progress_bar_config(disable=False)``.

    ``taesd`` (a folder or an ``AutoencoderTiny``) enables ``preview="taesd"``. ``latent_rgb``
    (a `LatentRGB`, a ``{"matrix", "bias"}`` dict or a ``latent_rgb.json`` path) overrides the
    latent->RGB map that ``preview="latent"`` uses (and ``"x0"`` where no fitted decoder is at
    hand); see `multistream.diffusion._latent_rgb`.
    ``preview_decoder`` (a `PreviewDecoderNet` or its ``.safetensors`` path) is the decoder of
    ``preview="tiny"`` and ``"x0"``; by default the model folder's
    ``preview_decoder.safetensors``, else one fitted to this VAE before (in memory or the cache);
    ``"tiny"`` fits one on first use where there is none (`multistream.fit_preview_decoder`,
    cached per VAE), ``"x0"`` uses the linear map instead.
    ``max_batch`` (default 4): up to this many concurrent requests of one priority take each
    denoising step together, their UNet calls batched where shapes match
    (`multistream.diffusion._denoiser_batch`: about 1.6x the throughput for 2 requests of the
    embedded model on a CPU); 1 steps them one at a time, bit-identical to a request alone.
    ``sizes`` (an `ImageSizes`): the heights and widths it accepts; by default multiples of the
    pipeline's real factor up to twice its native side (`sizes`).

    Example:
        >>> from diffusers import StableDiffusionPipeline              # doctest: +SKIP
        >>> sd = ImageModel(StableDiffusionPipeline.from_pretrained("./sd15"))  # doctest: +SKIP
        >>> final = sd.generate("a lighthouse at dusk", steps=20, seed=1)  # doctest: +SKIP
        >>> final.image.size                                           # doctest: +SKIP
        (512, 512)
    """

    def __init__(
        self,
        pipeline: Any,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        taesd: Any = None,
        latent_rgb: LatentRGB | dict[str, Any] | str | os.PathLike[str] | None = None,
        model_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        preview_decoder: Any = None,
        max_batch: int = 4,
        sizes: ImageSizes | None = None,
    ) -> None:
        if isinstance(pipeline, (str, os.PathLike)):
            raise InvalidArgumentError(
                "ImageModel wraps a diffusers pipeline object; to load from a folder or hub id use "
                f"ms.load_image_model({os.fspath(pipeline)!r})"
            )
        if not callable(pipeline) or getattr(pipeline, "scheduler", None) is None:
            raise InvalidArgumentError(
                f"ImageModel needs a diffusers pipeline (with a scheduler), got {type(pipeline).__name__}"
            )
        pipeline = moved_pipeline(pipeline, device, dtype)
        self._pipe = pipeline
        if hasattr(pipeline, "set_progress_bar_config"):
            # Progress goes out as events; a tqdm bar on stderr per stream is noise.
            pipeline.set_progress_bar_config(disable=True)
        self.name = name or getattr(getattr(pipeline, "config", None), "_name_or_path", None) or type(pipeline).__name__
        self._model_dir = os.fspath(model_dir) if model_dir is not None else None
        if sizes is not None and not isinstance(sizes, ImageSizes):
            raise InvalidArgumentError(f"sizes must be an ImageSizes, got {type(sizes).__name__}")
        self._sizes = sizes
        self._resolve_lock = threading.Lock()
        self._warned: set[str] = set()
        self._vae_for_previews: Any = None
        self._looked_for_cached_fit = False  # the disk look-up hashes the VAE: once per model
        self._decode_time = PerPixelTime()  # the final decode's cost, for the next runs' eta_s
        try:
            signature = inspect.signature(pipeline.__call__)
        except (TypeError, ValueError):
            signature = None
        self._params = dict(signature.parameters) if signature is not None else {}
        # diffusers pipelines take **kwargs only for deprecated arguments that they then ignore, so
        # names are checked against the explicit parameters (a typo must not pass silently).
        self._var_kw = signature is None
        self._taesd = load_taesd(taesd, self.device, self._vae_dtype) if taesd is not None else None
        self._taesd_by_path: dict[str, Any] = {}
        self._latent_rgb: LatentRGB | None = None
        if latent_rgb is not None:
            self._latent_rgb = self._read_latent_rgb(latent_rgb)
        self._preview_net: Any = None
        if preview_decoder is not None:
            from ..diffusion._preview_decoder import load_preview_decoder

            net = load_preview_decoder(preview_decoder) if isinstance(preview_decoder, (str, os.PathLike)) else preview_decoder
            if self.latent_channels is not None and getattr(net, "latent_channels", None) != self.latent_channels:
                raise InvalidArgumentError(
                    f"preview_decoder takes {getattr(net, 'latent_channels', '?')}-channel latents but this model's "
                    f"have {self.latent_channels}; fit one to this VAE: ms.fit_preview_decoder(model.pipeline.vae)"
                )
            self._preview_net = net.to(self.device)
        self._takes_step_callback = "callback_on_step_end" in self._params or self._var_kw
        self._prompt_limit = PromptLimit.of(pipeline, "image")  # None: no one number of tokens is read
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidArgumentError(f"max_batch must be an integer >= 1 (1: never batch requests), got {max_batch!r}")
        self.max_batch = max_batch
        self.capacity = max(type(self).capacity, max_batch)
        # Steps are shared only where the denoiser's calls can be batched (a UNet; `denoiser_batch`).
        self._batch_steps = max_batch > 1 and isinstance(getattr(pipeline, "unet", None), torch.nn.Module)
        self._stepper = ImageStepper(max_batch if self._batch_steps else 1)
        self.start_engine(self._stepper, name=f"image-{self.name}", setup=engine_thread_setup)

    #: Streams a server runs at once on this model (at least ``max_batch``); up to ``max_batch``
    #: of them share each denoising step, more take turns, which only stretches every one of
    #: them (set it on the instance to change it).
    capacity = DEFAULT_CAPACITY

    # -- properties --------------------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        """The diffusers pipeline (use it directly for anything this class does not cover)."""
        return self._pipe

    @property
    def device(self) -> torch.device:
        """The device the denoiser runs on."""
        for module in self._modules():
            for p in module.parameters():
                return p.device
        return torch.device(getattr(self._pipe, "device", "cpu"))

    @property
    def dtype(self) -> torch.dtype:
        for module in self._modules():
            for p in module.parameters():
                return p.dtype
        return torch.float32

    @property
    def family(self) -> str | None:
        """``"sd15"``, ``"sdxl"``, ``"sd3"`` or ``"flux"`` when the pipeline and its VAE match one."""
        return detect_family(self._pipe)

    @property
    def latent_channels(self) -> int | None:
        vae = getattr(self._pipe, "vae", None)
        return int(vae.config.latent_channels) if vae is not None else None

    @property
    def latent_rgb(self) -> LatentRGB:
        """The latent->RGB map of ``preview="latent"``/``"x0"`` (fitted to the VAE on first use if
        no file or published map applies)."""
        with self._resolve_lock:
            if self._latent_rgb is None:
                found = latent_rgb_for(self._pipe, self._model_dir)
                if found is None:
                    raise InvalidArgumentError(
                        f"{type(self._pipe).__name__} has no VAE to map latents to colours; use preview='none'"
                    )
                self._latent_rgb = found
            return self._latent_rgb

    @property
    def default_preview(self) -> str:
        """What ``preview=None`` (the default) means for this model: ``"tiny"`` where a fitted
        preview decoder comes with it (the embedded model, a folder with
        ``preview_decoder.safetensors``, or ``preview_decoder=``), so no fit can delay the first
        frame; else ``"latent"``."""
        from ..diffusion._preview_decoder import shipped_preview_decoder_path

        if self._preview_net is not None or shipped_preview_decoder_path(self._model_dir) is not None:
            return "tiny"
        return "latent"

    @property
    def vae_scale_factor(self) -> int:
        return int(getattr(self._pipe, "vae_scale_factor", 8) or 8)

    @property
    def size_multiple(self) -> int:
        """What height and width must be multiples of (VAE factor, Flux's 2x2 packing, SD3's patches)."""
        multiple = self.vae_scale_factor
        if getattr(type(self._pipe), "_unpack_latents", None) is not None:
            multiple *= 2
        patch = getattr(self._pipe, "patch_size", None)
        if is_int(patch) and patch > 1:
            multiple *= int(patch)
        return multiple

    @property
    def default_size(self) -> tuple[int | None, int | None]:
        """The pipeline's own default (height, width), or (None, None) where it has none."""
        size = getattr(self._pipe, "default_sample_size", None)
        if size is None:
            for attr in ("unet", "transformer"):
                module = getattr(self._pipe, attr, None)
                if module is not None:
                    size = getattr(module.config, "sample_size", None)
                    break
        if size is None:
            return None, None
        if isinstance(size, (list, tuple)):
            return int(size[0]) * self.vae_scale_factor, int(size[1]) * self.vae_scale_factor
        return int(size) * self.vae_scale_factor, int(size) * self.vae_scale_factor

    @property
    def sizes(self) -> ImageSizes:
        """The heights and widths this model accepts (and its native size): multiples of
        `size_multiple` (at least diffusers' 8) from that factor up to twice the native side, or
        what the model declares (the embedded model: multiples of 16 from 32 to 128). A size
        outside is refused by `stream` before any work, with these sizes in the message.

        Example:
            >>> ms.load_image_model().sizes.describe()      # doctest: +SKIP
            'sides that are multiples of 16 from 32 to 128 pixels (native 64x64, WIDTHxHEIGHT)'
        """
        if self._sizes is None:
            why = f"the VAE downsamples by {self.vae_scale_factor}"
            if self.size_multiple != self.vae_scale_factor:
                why += " and the denoiser works on patches of latents"
            self._sizes = sizes_for(self.size_multiple, self.default_size, why)
        return self._sizes

    def __repr__(self) -> str:
        return f"<ImageModel {self.name!r} {type(self._pipe).__name__} on {self.device} {self.dtype}>"

    # -- public API ---------------------------------------------------------------------------

    def stream(
        self,
        prompt: str,
        *,
        taesd: Any = None,
        resume_from: ImageCheckpoint | bytes | None = None,
        on_checkpoint: Callable[[ImageCheckpoint], Any] | None = None,
        checkpoint_every: int = 1,
        **options: Any,
    ) -> Stream:
        """Start generating; returns a `Stream` of ``image`` events (previews, then the final image).

        ``steps`` and ``guidance_scale`` default to the pipeline's own defaults; ``seed`` makes the
        run reproducible (None picks one, reported in the final event's ``metrics["seed"]``).
        ``preview`` picks which picture a preview shows (the noisy latent, or x0: the model's
        current estimate of the clean image) and which decoder draws it:

        ==================  =======  ==========================================================
        ``preview=``        picture  decoder
        ==================  =======  ==========================================================
        ``"latent"``        latent   linear latent->RGB map: about free, latent-sized
        ``"x0"``            x0       the best cheap one the model has: its fitted tiny decoder
                                     where one is at hand (shipped, as with the embedded
                                     model; ``preview_decoder=``; or fitted before for this
                                     VAE), else the linear map. Far more telling early on
        ``"tiny"``          x0       the fitted tiny decoder (about 2 ms a frame on a small
                                     CPU; fitted once per VAE where none is at hand)
        ``"taesd"``         latent   TAESD (needs ``taesd=`` weights)
        ``"vae"``           latent   the full VAE each preview: slow
        ``"x0+taesd"``,     x0       TAESD, the full VAE, the fitted decoder
        ``"x0+vae"``,
        ``"x0+tiny"``
        ``"none"``          -        no previews
        ==================  =======  ==========================================================

        None (the default) is the model's `default_preview`: ``"tiny"`` for the embedded model,
        ``"latent"`` for others.
        ``preview_every=k`` previews steps 1, 1+k, 1+2k, ... (``ceil(steps / k)`` previews).
        Previews are ``preview_format`` (jpeg | webp | png) at ``preview_quality``, scaled down to
        ``preview_max_side`` (None: never scaled; a linear-map preview is latent-sized, e.g. 64 px for
        a 512 px image); the final image is ``final_format`` (PNG, lossless, by default) at
        full size. Other keyword arguments go to the pipeline call (e.g. ``max_sequence_length``;
        a ``callback_on_step_end`` of yours is called after multistream's own). ``priority``:
        higher gets the next denoising step first (default 0); equal priorities take turns.

        ``on_checkpoint=fn`` calls ``fn(checkpoint)`` on the engine thread (keep it quick) after
        every ``checkpoint_every``-th step with an `ImageCheckpoint`; ``resume_from=checkpoint``
        (or its ``to_bytes()``), with the arguments of the run it came from, continues that run
        from the step after it: same previews from there, same final image (see
        `multistream.diffusion._checkpoint`). The final event's ``metrics`` then has
        ``resumed_from_step`` (and ``checkpoints``, the number taken).

        ``options`` are those of `ImageOptions` (each declared and described there once:
        ``negative_prompt``, ``steps``, ``guidance_scale``, ``height``, ``width``, ``seed``,
        ``num_images``, ``preview``, ``preview_every``, ``preview_format``, ``preview_quality``,
        ``preview_max_side``, ``final_format``, ``final_quality``, ``priority``); other names go to
        the pipeline call. Bad arguments raise `InvalidArgumentError` here, before anything runs.

        Example:
            >>> for ev in sd.stream("a red circle", steps=10, seed=0, preview="x0"):  # doctest: +SKIP
            ...     ev.image.save(f"step_{ev.step:03d}.png")
        """
        job = self._prepare(prompt, taesd, options)
        checkpoints = checkpoint_plan(self._run_context(), job, resume_from, on_checkpoint, checkpoint_every)
        if checkpoints is not None:
            checkpoints.apply_conditioning(job.call_kwargs)  # a resumed run goes on under the steered conditioning

        def submit(writer: StreamWriter) -> None:
            # steer() is checked on the caller's thread and applied between two steps.
            steering = ImageSteering(self._pipe, job.call_kwargs, prompt_limit=self._prompt_limit)
            writer.on_command(steering.handle)
            self._engine.submit(_ImageRequest(self, writer, job, job.priority, steering, checkpoints))

        return Stream(submit=submit, kind="image")

    def generate(self, prompt: str, *, on_event: Callable[[Event], Any] | None = None, **kwargs: Any) -> Event:
        """Run to the end, calling ``on_event`` for each event; returns the final event.

        Takes the same arguments as `stream`. Example:
            >>> final = sd.generate("a red circle", steps=10, on_event=print)   # doctest: +SKIP
            >>> final.image.save("out.png")                                     # doctest: +SKIP
        """
        return self.stream(prompt, **kwargs).wait(on_event)

    # -- validation ---------------------------------------------------------------------------

    def _prepare(self, prompt: Any, taesd: Any, given: dict[str, Any]) -> ImageJob:
        # What does not depend on the model is checked where the scripted fake checks it too.
        options = parse_image_options(prompt, **given)
        plan = options.preview or parse_preview(self.default_preview)
        seed = options.seed
        height, width = self._check_size(options.height, options.width)

        taesd_model = None
        if plan.decoder == "taesd":
            taesd_model = self._taesd_for(taesd)
            if taesd_model is None:
                raise InvalidArgumentError(
                    f"preview={plan.mode!r} needs TAESD weights: pass taesd= (a folder with a diffusers "
                    "AutoencoderTiny, e.g. madebyollin/taesd for SD 1.x/2.x, or an AutoencoderTiny object) to "
                    "load_image_model(...) or to stream(...); or use preview='latent' or 'x0', which need no weights"
                )
            taesd_channels = getattr(taesd_model.config, "latent_channels", None)
            if taesd_channels is not None and self.latent_channels is not None and taesd_channels != self.latent_channels:
                raise InvalidArgumentError(
                    f"the TAESD model takes {taesd_channels}-channel latents but this pipeline makes "
                    f"{self.latent_channels}-channel ones; use the TAESD of this model family"
                )
        elif taesd is not None:
            self._taesd_for(taesd)  # still check it, so a typo does not pass silently
        decoders = self._decoder_parts(taesd_model)
        # What the plan prefers ("x0": the fitted decoder) is settled here, on the caller's thread,
        # so the job names the decoder its run builds and nothing is fitted for a preference.
        plan = settle_plan(plan, decoders, has_x0=x0_strategy(self._pipe.scheduler) is not None)
        if plan.decoder in ("vae", "tiny") and getattr(self._pipe, "vae", None) is None and self._preview_net is None:
            raise InvalidArgumentError(f"{type(self._pipe).__name__} has no VAE; preview={plan.mode!r} cannot work")
        if plan.source == "x0":
            self._warn_if_no_x0(plan)

        has_callback = "callback_on_step_end" in self._params
        if plan.enabled and not has_callback and not self._var_kw:
            raise InvalidArgumentError(
                f"{type(self._pipe).__name__} has no callback_on_step_end, so it cannot show previews; "
                "use preview='none' (the final image only)"
            )

        kwargs: dict[str, Any] = {}
        user_callback = None
        tensor_inputs = ["latents"]

        def put(name: str, value: Any, what: str | None = None) -> None:
            if value is None:
                return
            if name not in self._params and not self._var_kw:
                raise InvalidArgumentError(f"{type(self._pipe).__name__} takes no {what or name!r} argument")
            kwargs[name] = value

        put("prompt", options.prompt)
        put("negative_prompt", options.negative_prompt)
        put("num_inference_steps", options.steps, "steps")
        put("guidance_scale", options.guidance_scale)
        if self._prompt_limit is not None:
            # Said once here, in a line; the libraries' own notices of it are dropped in the run.
            self._prompt_limit.check("prompt", options.prompt)
            self._prompt_limit.check("negative_prompt", options.negative_prompt)
        if "height" in self._params:
            put("height", height)
            put("width", width)
        elif (height, width) != self.default_size and (height is not None or width is not None):
            raise InvalidArgumentError(f"{type(self._pipe).__name__} takes no height/width arguments")
        if options.num_images != 1 or "num_images_per_prompt" in self._params:
            put("num_images_per_prompt", options.num_images, "num_images")
        # Reserved names, output_type and generator-with-seed were refused by parse_image_options.
        for key, value in options.pipeline_kwargs.items():
            if key == "callback_on_step_end":
                user_callback = value
                # A diffusers PipelineCallback / MultiPipelineCallbacks names the tensors it reads
                # (SDCFGCutoffCallback needs "prompt_embeds"); the pipeline would take them from it,
                # but it sees only multistream's own callback, so they are asked for here.
                own = getattr(value, "tensor_inputs", None)
                if isinstance(own, (list, tuple)):
                    tensor_inputs = list(dict.fromkeys([*tensor_inputs, *own]))
                continue
            if key == "callback_on_step_end_tensor_inputs":
                tensor_inputs = list(dict.fromkeys([*tensor_inputs, *(value or [])]))
                continue
            if key not in self._params and not self._var_kw:
                refuse_pipeline_argument(key, type(self._pipe).__name__)
            put(key, value)
        if seed is None and "generator" not in kwargs:
            seed = random.randrange(2**31)
        if "generator" not in kwargs and ("generator" in self._params or self._var_kw):
            kwargs["generator"] = torch.Generator("cpu").manual_seed(int(seed))  # type: ignore[arg-type]
        return ImageJob(
            priority=options.priority,
            call_kwargs=kwargs,
            plan=plan,
            throttle=options.throttle,
            steps=options.steps,
            height=height,
            width=width,
            seed=int(seed) if seed is not None else -1,
            num_images=options.num_images,
            preview_format=options.preview_format,
            preview_quality=options.preview_quality,
            preview_max_side=options.preview_max_side,
            final_format=options.final_format,
            final_quality=options.final_quality,
            taesd=taesd_model,
            user_callback=user_callback,
            tensor_inputs=tensor_inputs,
            decoders=decoders,
        )

    def _check_size(self, height: int | None, width: int | None) -> tuple[int | None, int | None]:
        """The model's default where a side is None; a given side (a positive integer, checked by
        `parse_image_options`) must be one of `sizes`, checked here, before any work: diffusers
        would fail only inside the run, and an oversized side makes steps that ``cancel()`` cannot
        interrupt for minutes."""
        default_h, default_w = self.default_size
        height, width = self.sizes.check(height, width)
        return (default_h if height is None else height, default_w if width is None else width)

    def _warn_if_no_x0(self, plan: PreviewPlan) -> None:
        scheduler = self._pipe.scheduler
        name = type(scheduler).__name__
        if x0_strategy(scheduler) is None and name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"{name} reports no prediction of the clean image and multistream knows no formula for it, "
                f"so preview={plan.mode!r} shows the noisy latent instead",
                stacklevel=4,
            )

    def _taesd_for(self, taesd: Any) -> Any:
        if taesd is None:
            return self._taesd
        if isinstance(taesd, (str, os.PathLike)):
            key = os.fspath(taesd)
            if key not in self._taesd_by_path:
                self._taesd_by_path[key] = load_taesd(key, self.device, self._vae_dtype)
            return self._taesd_by_path[key]
        return load_taesd(taesd, self.device, self._vae_dtype)

    def _read_latent_rgb(self, value: Any) -> LatentRGB:
        if isinstance(value, LatentRGB):
            result = value
        elif isinstance(value, dict):
            result = LatentRGB.from_dict(value)
        elif isinstance(value, (str, os.PathLike)):
            result = LatentRGB.load(value)
        else:
            raise InvalidArgumentError(f"latent_rgb must be a LatentRGB, a dict or a json path, got {type(value).__name__}")
        if self.latent_channels is not None and result.channels != self.latent_channels:
            raise InvalidArgumentError(
                f"latent_rgb has {result.channels} rows but this model's latents have {self.latent_channels} channels"
            )
        return result

    # -- internals ----------------------------------------------------------------------------

    def _modules(self) -> list[Any]:
        found = []
        for attr in ("unet", "transformer", "prior", "vae"):
            module = getattr(self._pipe, attr, None)
            if module is not None and hasattr(module, "parameters"):
                found.append(module)
        return found

    @property
    def _vae_dtype(self) -> torch.dtype:
        vae = getattr(self._pipe, "vae", None)
        if vae is not None:
            for p in vae.parameters():
                return p.dtype
        return self.dtype

    def _preview_vae(self) -> Any:
        """The VAE that ``"vae"`` previews and ``finish_early()`` decode with (None: the pipeline has none)."""
        vae = getattr(self._pipe, "vae", None)
        if vae is None:
            return None
        upcasts = hasattr(self._pipe, "upcast_vae") and getattr(vae.config, "force_upcast", False)
        if self._vae_dtype == torch.float16 and upcasts:
            # Where the pipeline upcasts its VAE for the final decode (SDXL's overflows in float16),
            # previews get a float32 copy of their own rather than flipping the pipeline's VAE.
            if self._vae_for_previews is None:
                import copy

                self._vae_for_previews = copy.deepcopy(vae).to(torch.float32)
            return self._vae_for_previews
        return vae

    def _decoder_parts(self, taesd: Any) -> DecoderParts:
        """What this model lends the preview decoders (`multistream.diffusion._previews.DECODERS`);
        ``taesd``: the request's TAESD model, or None."""
        return DecoderParts(
            latent_rgb=lambda: self.latent_rgb,
            tiny_net=self._tiny_net,
            vae=self._preview_vae,
            tiny_ready=self._tiny_ready,
            taesd=taesd,
        )

    def _tiny_net(self) -> Any:
        """The fitted preview decoder: given, shipped in the model folder, or fitted (once per VAE)."""
        with self._resolve_lock:
            if self._preview_net is None:
                from ..diffusion._preview_decoder import preview_decoder_for, shipped_preview_decoder_path

                if shipped_preview_decoder_path(self._model_dir) is None:
                    logger.warning("fitting a preview decoder to this VAE for preview='tiny' (once; cached per VAE)")
                net = preview_decoder_for(self._pipe, self._model_dir)
                if net is None:
                    raise InvalidArgumentError(f"{type(self._pipe).__name__} has no VAE; preview='tiny' cannot work")
                self._preview_net = net.to(self.device)
            return self._preview_net

    def _tiny_ready(self) -> bool:
        """True when a fitted preview decoder is at hand without fitting: given, shipped, or fitted
        before for this VAE (in memory; on disk, looked up once per model since that hashes the
        VAE's weights). A decoder found is kept, as `_tiny_net` would keep it."""
        with self._resolve_lock:
            if self._preview_net is not None:
                return True
            from ..diffusion._preview_decoder import cached_preview_decoder, preview_decoder_for

            net = preview_decoder_for(self._pipe, self._model_dir, fit=False)
            if net is None:
                net = cached_preview_decoder(getattr(self._pipe, "vae", None), disk=not self._looked_for_cached_fit)
                self._looked_for_cached_fit = True
            if net is None:
                return False
            self._preview_net = net.to(self.device)
            return True

    def _run_context(self) -> RunContext:
        """What a run of this model reads of it (`ImageRun`, `RunCheckpoints` get this, not the model)."""
        return RunContext(pipeline=self._pipe, device=self.device, params=self._params,
                          takes_step_callback=self._takes_step_callback,
                          stepper=self._stepper if self._batch_steps else None,
                          latent_rgb_if_ready=self._latent_rgb_if_ready, decode_time=self._decode_time)

    def _latent_rgb_if_ready(self) -> LatentRGB | None:
        """The map if it is known without fitting (nothing may be decoded after a cancel)."""
        if self._latent_rgb is not None:
            return self._latent_rgb
        try:
            return latent_rgb_for(self._pipe, self._model_dir, fit=False)
        except Exception:  # noqa: BLE001 - a cheap look only
            return None


class _ImageRequest(ImageRequest):
    """Binds one job of an `ImageModel` to the engine's step scheduler."""

    def __init__(
        self, model: ImageModel, writer: StreamWriter, job: ImageJob, priority: int, steering: ImageSteering | None = None,
        checkpoints: RunCheckpoints | None = None,
    ) -> None:
        super().__init__(
            self._start, writer.fail, self._cancel, priority=priority, steps_left=self._steps_left,
            cancelled=lambda: writer.cancelled,
        )
        self._model, self._writer, self._job = model, writer, job
        self._steering = steering
        self._checkpoints = checkpoints
        self._run: ImageRun | None = None

    def _steps_left(self) -> int:
        stats = self._run.stats if self._run is not None else None
        total = (stats.total if stats is not None else None) or self._job.steps or 50
        done = self._checkpoints.start_step if self._checkpoints is not None else 0
        return total - (stats.steps_seen if stats is not None else done)

    def _start(self, yield_step: Callable[[], None]) -> None:
        # Built here, on the engine thread: copying the scheduler copies tensors.
        self._run = ImageRun(self._model._run_context(), self._writer, self._job, yield_step, self._steering, self._checkpoints)
        self._run.execute()

    def _cancel(self) -> None:
        if self._steering is not None:
            self._steering.close()
        if self._run is None:
            self._run = ImageRun(self._model._run_context(), self._writer, self._job, lambda: None)
        self._run._emit_cancelled()
