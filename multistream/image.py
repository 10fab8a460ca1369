"""The diffusers adapter: live denoising previews, then the finished image, as ``image`` events.

``ms.load_image_model(...)`` gives an `ImageModel`; its ``stream(prompt, ...)`` runs the pipeline
in the stream's producer thread and emits small compressed preview frames while it denoises (from
``callback_on_step_end``), then the full-quality image as the final event. Any diffusers pipeline
with that hook works: Stable Diffusion 1.x/2.x, SDXL, SD3, Flux and their relatives.

It behaves like the text streams: ``cancel()`` stops within one step and skips the final VAE
decode; an exception in the pipeline becomes an ``error`` event; a slow consumer only gets the
newest preview of each image, and the final image is never dropped.

The cancelled stream's final event (``finish_reason="cancelled"``) carries the newest preview
that was made (same pixels, in ``preview_format``), or, if no preview was made yet, a cheap
render of the latents where the run stopped (the linear latent->RGB map if one is at hand, else a
false-colour view), at preview size. It never runs the VAE.

With ``num_images > 1`` each image has its own previews (``index``); every finished image carries
``finish_reason`` and the last one is the stream's final event.

Example:
    >>> import multistream as ms
    >>> sd = ms.load_image_model()                                               # doctest: +SKIP
    >>> for ev in sd.stream("a red circle on a blue background", steps=20, seed=0):  # doctest: +SKIP
    ...     print(ev.step, ev.total_steps, ev.mime, len(ev.data))
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import random
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .devices import default_dtype, resolve_device, resolve_dtype
from .errors import InvalidArgumentError, ModelLoadError
from .events import Event, ImageEvent
from .frames import EncodedFrame, check_format, check_quality, encode_frame
from .latent_rgb import LatentRGB, detect_family, latent_rgb_for, latents_to_rgb
from .previews import (
    FrameWorker,
    HostFrames,
    LinearDecoder,
    PendingFrame,
    PreviewPlan,
    PreviewThrottle,
    TinyDecoder,
    VaeDecoder,
    X0Tracker,
    false_color,
    parse_preview,
    to_uint8_frames,
    unpack_latents,
    x0_strategy,
)
from .stream import Stream, StreamWriter

__all__ = ["EMBEDDED_MODEL_DIR", "ImageModel", "load_image_model"]

logger = logging.getLogger("multistream")

#: Where the project's own small text-to-image model lives (``load_image_model()`` with no name).
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "_models" / "shapes"

# Arguments `stream()` sets itself; passing them through **pipeline_kwargs would fight it.
_RESERVED = {
    "prompt": "the first argument",
    "num_inference_steps": "steps=",
    "num_images_per_prompt": "num_images=",
    "return_dict": None,
    "callback": "callback_on_step_end=",
    "callback_steps": "callback_on_step_end=",
}


class _Cancelled(BaseException):
    """Raised out of the step callback to stop the pipeline before its final VAE decode.

    A BaseException, so that an ``except Exception`` inside a pipeline cannot swallow it.
    """


def _default_dtype(device: torch.device, class_name: str | None) -> torch.dtype:
    # Flux overflows float16 (black images); its weights are bfloat16 to begin with.
    return default_dtype(device, prefer_bf16=bool(class_name and class_name.startswith("Flux")))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not _is_int(value) or int(value) < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _dtype_kwarg(dtype: torch.dtype | None) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument: ``dtype=`` in newer diffusers (which deprecate
    ``torch_dtype=``), ``torch_dtype=`` in older ones."""
    try:
        from diffusers.utils import deprecation_utils

        new = hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    except ImportError:
        new = False
    return {"dtype": dtype} if new else {"torch_dtype": dtype}


def _load_taesd(taesd: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(taesd, (str, os.PathLike)):
        from diffusers import AutoencoderTiny

        path = os.fspath(taesd)
        try:
            model = AutoencoderTiny.from_pretrained(path, local_files_only=os.path.isdir(path), **_dtype_kwarg(dtype))
        except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear error
            raise ModelLoadError(
                f"could not load TAESD weights from {path!r} ({type(exc).__name__}: {exc}). Pass a local folder "
                "with a diffusers AutoencoderTiny (config.json + diffusion_pytorch_model.safetensors), e.g. a "
                "download of madebyollin/taesd for SD 1.x/2.x, or an AutoencoderTiny object."
            ) from exc
    elif hasattr(taesd, "decode") and hasattr(taesd, "parameters") and hasattr(taesd, "config"):
        model = taesd
    else:
        raise InvalidArgumentError(
            f"taesd must be a folder path or a diffusers AutoencoderTiny object, got {type(taesd).__name__}"
        )
    return model.to(device=device, dtype=dtype).eval()


@dataclass
class _Job:
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


@dataclass
class _Run:
    """What one run has seen so far; the producer thread writes it, the encoder thread adds stats."""

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


class ImageModel:
    """A diffusers pipeline that streams denoising previews and its final image as events.

    Build it with `load_image_model`, or wrap a pipeline you already have: ``ImageModel(pipe)``
    (then nothing is moved unless ``device``/``dtype`` are given). ``pipeline`` is the diffusers
    pipeline itself. One model runs one generation at a time; further streams wait their turn.

    The pipeline's own tqdm progress bar is turned off (progress arrives as events); turn it back
    on with ``model.pipeline.set_progress_bar_config(disable=False)``.

    ``taesd`` (a folder or an ``AutoencoderTiny``) enables ``preview="taesd"``. ``latent_rgb``
    (a `LatentRGB`, a ``{"matrix", "bias"}`` dict or a ``latent_rgb.json`` path) overrides the
    latent->RGB map that ``preview="latent"``/``"x0"`` use; see `multistream.latent_rgb`.
    ``preview_decoder`` (a `PreviewDecoderNet` or its ``.safetensors`` path) is the decoder of
    ``preview="tiny"``; by default the model folder's ``preview_decoder.safetensors``, else one
    fitted to the VAE on first use (`multistream.fit_preview_decoder`, cached per VAE).

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
        torch_dtype = resolve_dtype(dtype)
        if device is not None or torch_dtype is not None:
            moves: dict[str, Any] = {}
            if device is not None:
                moves["device"] = resolve_device(device)
            if torch_dtype is not None:
                moves["dtype"] = torch_dtype
            pipeline = pipeline.to(**moves)
        self._pipe = pipeline
        if hasattr(pipeline, "set_progress_bar_config"):
            # Progress goes out as events; a tqdm bar on stderr per stream is noise.
            pipeline.set_progress_bar_config(disable=True)
        self.name = name or getattr(getattr(pipeline, "config", None), "_name_or_path", None) or type(pipeline).__name__
        self._model_dir = os.fspath(model_dir) if model_dir is not None else None
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._warned: set[str] = set()
        self._vae_for_previews: Any = None
        try:
            signature = inspect.signature(pipeline.__call__)
        except (TypeError, ValueError):
            signature = None
        self._params = dict(signature.parameters) if signature is not None else {}
        # diffusers pipelines take **kwargs only for deprecated arguments that they then ignore, so
        # names are checked against the explicit parameters (a typo must not pass silently).
        self._var_kw = signature is None
        self._taesd = _load_taesd(taesd, self.device, self._vae_dtype) if taesd is not None else None
        self._taesd_by_path: dict[str, Any] = {}
        self._latent_rgb: LatentRGB | None = None
        if latent_rgb is not None:
            self._latent_rgb = self._read_latent_rgb(latent_rgb)
        self._preview_net: Any = None
        if preview_decoder is not None:
            from .preview_decoder import load_preview_decoder

            net = load_preview_decoder(preview_decoder) if isinstance(preview_decoder, (str, os.PathLike)) else preview_decoder
            if self.latent_channels is not None and getattr(net, "latent_channels", None) != self.latent_channels:
                raise InvalidArgumentError(
                    f"preview_decoder takes {getattr(net, 'latent_channels', '?')}-channel latents but this model's "
                    f"have {self.latent_channels}; fit one to this VAE: ms.fit_preview_decoder(model.pipeline.vae)"
                )
            self._preview_net = net.to(self.device)

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
        from .preview_decoder import shipped_preview_decoder_path

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
        if _is_int(patch) and patch > 1:
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

    def __repr__(self) -> str:
        return f"<ImageModel {self.name!r} {type(self._pipe).__name__} on {self.device} {self.dtype}>"

    # -- public API ---------------------------------------------------------------------------

    def stream(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        seed: int | None = None,
        num_images: int = 1,
        preview: str | None = None,
        preview_every: int = 1,
        preview_format: str = "jpeg",
        preview_quality: int = 75,
        preview_max_side: int | None = 256,
        final_format: str = "png",
        final_quality: int = 95,
        taesd: Any = None,
        **pipeline_kwargs: Any,
    ) -> Stream:
        """Start generating; returns a `Stream` of ``image`` events (previews, then the final image).

        ``steps`` and ``guidance_scale`` default to the pipeline's own defaults; ``seed`` makes the
        run reproducible (None picks one, reported in the final event's ``metrics["seed"]``).
        ``preview`` is one of ``"latent"`` (a linear map of the noisy latent: about free), ``"x0"``
        (the model's current estimate of the clean image through the same map: as cheap, far more
        telling early on), ``"tiny"`` (x0 through a tiny decoder fitted to this VAE: the image's
        own colours, about 2 ms a frame on a small CPU; fitted once per VAE if the model ships none),
        ``"taesd"`` (needs ``taesd=`` weights), ``"vae"`` (full decode each preview: slow),
        ``"none"``; ``"x0+taesd"``/``"x0+vae"`` decode x0 with those. None (the default) is the
        model's `default_preview`: ``"tiny"`` for the embedded model, ``"latent"`` for others.
        ``preview_every=k`` previews steps 1, 1+k, 1+2k, ... (``ceil(steps / k)`` previews).
        Previews are ``preview_format`` (jpeg | webp | png) at ``preview_quality``, scaled down to
        ``preview_max_side`` (None: never scaled; a linear-map preview is latent-sized, e.g. 64 px for
        a 512 px image); the final image is ``final_format`` (PNG, lossless, by default) at
        full size. Other keyword arguments go to the pipeline call (e.g. ``max_sequence_length``;
        a ``callback_on_step_end`` of yours is called after multistream's own).

        Bad arguments raise `InvalidArgumentError` here, before anything runs.

        Example:
            >>> for ev in sd.stream("a red circle", steps=10, seed=0, preview="x0"):  # doctest: +SKIP
            ...     ev.image.save(f"step_{ev.step:03d}.png")
        """
        job = self._prepare(
            prompt, negative_prompt, steps, guidance_scale, height, width, seed, num_images, preview,
            preview_every, preview_format, preview_quality, preview_max_side, final_format, final_quality,
            taesd, pipeline_kwargs,
        )  # fmt: skip
        return Stream(functools.partial(self._produce, job=job), kind="image")

    def generate(self, prompt: str, *, on_event: Callable[[Event], Any] | None = None, **kwargs: Any) -> Event:
        """Run to the end, calling ``on_event`` for each event; returns the final event.

        Takes the same arguments as `stream`. Example:
            >>> final = sd.generate("a red circle", steps=10, on_event=print)   # doctest: +SKIP
            >>> final.image.save("out.png")                                     # doctest: +SKIP
        """
        return self.stream(prompt, **kwargs).wait(on_event)

    # -- validation ---------------------------------------------------------------------------

    def _prepare(
        self,
        prompt: Any,
        negative_prompt: Any,
        steps: Any,
        guidance_scale: Any,
        height: Any,
        width: Any,
        seed: Any,
        num_images: Any,
        preview: Any,
        preview_every: Any,
        preview_format: Any,
        preview_quality: Any,
        preview_max_side: Any,
        final_format: Any,
        final_quality: Any,
        taesd: Any,
        pipeline_kwargs: dict[str, Any],
    ) -> _Job:
        if not isinstance(prompt, str):
            raise InvalidArgumentError(f"prompt must be a string, got {type(prompt).__name__}")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise InvalidArgumentError(f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
        steps = _check_int("steps", steps, 1, optional=True)
        if guidance_scale is not None and (
            isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or guidance_scale < 0
        ):
            raise InvalidArgumentError(f"guidance_scale must be a number >= 0, got {guidance_scale!r}")
        num_images = _check_int("num_images", num_images, 1)
        plan = parse_preview(self.default_preview if preview is None else preview)
        throttle = PreviewThrottle(preview_every)
        preview_format = check_format(preview_format, "preview_format")
        preview_quality = check_quality(preview_quality, "preview_quality")
        preview_max_side = _check_int("preview_max_side", preview_max_side, 1, optional=True)
        final_format = check_format(final_format, "final_format")
        final_quality = check_quality(final_quality, "final_quality")
        if seed is not None and (not _is_int(seed) or not 0 <= int(seed) < 2**63):
            raise InvalidArgumentError(f"seed must be an integer from 0 to 2**63-1 or None, got {seed!r}")
        height, width = self._check_size(height, width)

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

        put("prompt", prompt)
        put("negative_prompt", negative_prompt)
        put("num_inference_steps", steps, "steps")
        put("guidance_scale", guidance_scale)
        if "height" in self._params:
            put("height", height)
            put("width", width)
        elif (height, width) != self.default_size and (height is not None or width is not None):
            raise InvalidArgumentError(f"{type(self._pipe).__name__} takes no height/width arguments")
        if num_images != 1 or "num_images_per_prompt" in self._params:
            put("num_images_per_prompt", num_images, "num_images")
        for key, value in pipeline_kwargs.items():
            if key in _RESERVED:
                instead = _RESERVED[key]
                hint = f"; use {instead}" if instead else ""
                raise InvalidArgumentError(f"{key!r} is set by stream() itself{hint}")
            if key == "callback_on_step_end":
                if value is not None and not callable(value):
                    raise InvalidArgumentError("callback_on_step_end must be callable")
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
            if key == "output_type" and value not in ("pil", "np", "pt"):
                raise InvalidArgumentError(
                    f"output_type={value!r} is not supported: the stream encodes images; use 'pil' (default), 'np' or 'pt'"
                )
            if key == "generator" and seed is not None:
                raise InvalidArgumentError("pass either seed= or generator=, not both")
            put(key, value)
        if seed is None and "generator" not in kwargs:
            seed = random.randrange(2**31)
        if "generator" not in kwargs and ("generator" in self._params or self._var_kw):
            kwargs["generator"] = torch.Generator("cpu").manual_seed(int(seed))  # type: ignore[arg-type]
        return _Job(
            call_kwargs=kwargs,
            plan=plan,
            throttle=throttle,
            steps=steps,
            height=height,
            width=width,
            seed=int(seed) if seed is not None else -1,
            num_images=num_images,
            preview_format=preview_format,
            preview_quality=preview_quality,
            preview_max_side=preview_max_side,
            final_format=final_format,
            final_quality=final_quality,
            taesd=taesd_model,
            user_callback=user_callback,
            tensor_inputs=tensor_inputs,
        )

    def _check_size(self, height: Any, width: Any) -> tuple[int | None, int | None]:
        multiple = self.size_multiple
        default_h, default_w = self.default_size
        out = []
        for name, value, default in (("height", height, default_h), ("width", width, default_w)):
            if value is None:
                out.append(default)
                continue
            if not _is_int(value) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
            if value % multiple:
                why = f"the VAE downsamples by {self.vae_scale_factor}"
                if multiple != self.vae_scale_factor:
                    why += " and the denoiser works on patches of latents"
                lower = max(multiple, value - value % multiple)
                raise InvalidArgumentError(
                    f"{name}={value} is not a multiple of {multiple} ({why}); use e.g. {lower} or {lower + multiple}"
                )
            out.append(int(value))
        return out[0], out[1]

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
                self._taesd_by_path[key] = _load_taesd(key, self.device, self._vae_dtype)
            return self._taesd_by_path[key]
        return _load_taesd(taesd, self.device, self._vae_dtype)

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
        vae = self._pipe.vae
        upcasts = hasattr(self._pipe, "upcast_vae") and getattr(vae.config, "force_upcast", False)
        if self._vae_dtype == torch.float16 and upcasts:
            # Where the pipeline upcasts its VAE for the final decode (SDXL's overflows in float16),
            # previews get a float32 copy of their own rather than flipping the pipeline's VAE.
            if self._vae_for_previews is None:
                import copy

                self._vae_for_previews = copy.deepcopy(vae).to(torch.float32)
            return self._vae_for_previews
        return vae

    def _decoder(self, job: _Job) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if job.plan.decoder == "linear":
            return LinearDecoder(self.latent_rgb)
        if job.plan.decoder == "vae":
            return VaeDecoder(self._preview_vae(), "vae")
        if job.plan.decoder == "taesd":
            return VaeDecoder(job.taesd, "taesd")
        if job.plan.decoder == "tiny":
            return TinyDecoder(self._tiny_net())
        return None

    def _tiny_net(self) -> Any:
        """The fitted preview decoder: given, shipped in the model folder, or fitted (once per VAE)."""
        with self._resolve_lock:
            if self._preview_net is None:
                from .preview_decoder import preview_decoder_for, shipped_preview_decoder_path

                if shipped_preview_decoder_path(self._model_dir) is None:
                    logger.warning("fitting a preview decoder to this VAE for preview='tiny' (once; cached per VAE)")
                net = preview_decoder_for(self._pipe, self._model_dir)
                if net is None:
                    raise InvalidArgumentError(f"{type(self._pipe).__name__} has no VAE; preview='tiny' cannot work")
                self._preview_net = net.to(self.device)
            return self._preview_net

    def _latent_rgb_if_ready(self) -> LatentRGB | None:
        """The map if it is known without fitting (nothing may be decoded after a cancel)."""
        if self._latent_rgb is not None:
            return self._latent_rgb
        try:
            return latent_rgb_for(self._pipe, self._model_dir, fit=False)
        except Exception:  # noqa: BLE001 - a cheap look only
            return None

    def _acquire(self, writer: StreamWriter) -> bool:
        while not self._lock.acquire(timeout=0.05):
            if writer.cancelled:
                return False
        return True

    # -- the producer ---------------------------------------------------------------------------

    def _produce(self, writer: StreamWriter, job: _Job) -> None:
        run = _Run(started=time.perf_counter())
        if not self._acquire(writer):
            self._emit_cancelled(writer, job, run)
            return
        try:
            with torch.inference_mode():
                self._run(writer, job, run)
        finally:
            self._lock.release()

    def _run(self, writer: StreamWriter, job: _Job, run: _Run) -> None:
        pipe = self._pipe
        if writer.cancelled:
            self._emit_cancelled(writer, job, run)
            return
        decoder = self._decoder(job)
        tracker = X0Tracker(pipe.scheduler) if job.plan.source == "x0" else None
        worker = FrameWorker(functools.partial(self._emit_preview, writer, job, run), name=f"multistream-frames-{writer.stream_id[:8]}")
        kwargs = dict(job.call_kwargs)
        if "callback_on_step_end" in self._params or self._var_kw:
            kwargs["callback_on_step_end"] = self._make_callback(writer, job, run, decoder, tracker, worker)
            kwargs["callback_on_step_end_tensor_inputs"] = job.tensor_inputs
        run.call_at = time.perf_counter()
        try:
            with tracker if tracker is not None else nullcontext():
                output = pipe(**kwargs)
        except _Cancelled:
            worker.close(flush=True)
            _free_hooks(pipe)
            self._emit_cancelled(writer, job, run, worker)
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
        frames: list[EncodedFrame] = [
            encode_frame(images[i], job.final_format, job.final_quality) for i in range(count)
        ]
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
            self._emit_done(writer, frame, i, total, total, reason, metrics, last=i == count - 1)

    def _make_callback(
        self,
        writer: StreamWriter,
        job: _Job,
        run: _Run,
        decoder: Callable[[torch.Tensor], torch.Tensor] | None,
        tracker: X0Tracker | None,
        worker: FrameWorker,
    ) -> Callable[..., dict[str, Any]]:
        pipe = self._pipe

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
            if writer.cancelled:
                run.stop_step = step
                if latents is not None:
                    x0 = tracker.x0() if tracker is not None else None
                    run.stop_latents = x0 if x0 is not None else latents
                raise _Cancelled()
            if decoder is not None and latents is not None and job.throttle.should_preview(step):
                self._make_preview(pipe, job, run, decoder, tracker, worker, step, latents)
            if job.user_callback is not None:
                result = job.user_callback(pipeline, i, t, callback_kwargs)
                if result is not None:
                    callback_kwargs = result
            return callback_kwargs

        return callback

    def _make_preview(
        self,
        pipe: Any,
        job: _Job,
        run: _Run,
        decoder: Callable[[torch.Tensor], torch.Tensor],
        tracker: X0Tracker | None,
        worker: FrameWorker,
        step: int,
        latents: torch.Tensor,
    ) -> None:
        started = time.perf_counter()
        source = latents
        if tracker is not None:
            x0 = tracker.x0()
            if x0 is not None:
                source = x0
        spatial = unpack_latents(pipe, source, job.height, job.width)
        frames = HostFrames(to_uint8_frames(decoder(spatial), job.preview_max_side))
        total = run.total or step
        for index in range(frames.shape[0]):
            pending = PendingFrame(step, total, index, frames, started)
            run.last_frames[index] = pending
            worker.submit(pending)
        run.previews_made += 1
        run.preview_s += time.perf_counter() - started

    def _emit_preview(self, writer: StreamWriter, job: _Job, run: _Run, frame: PendingFrame) -> None:
        """Runs on the encoder thread."""
        encoded = encode_frame(frame.frames.array(frame.index), job.preview_format, job.preview_quality)
        writer.image(
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

    def _emit_cancelled(self, writer: StreamWriter, job: _Job, run: _Run, worker: FrameWorker | None = None) -> None:
        total = run.total or job.steps or 0
        frames: list[tuple[int, EncodedFrame]] = []
        if run.last_frames:
            for index in sorted(run.last_frames):
                pending = run.last_frames[index]
                pixels = pending.frames.array(index)
                frames.append((pending.step, encode_frame(pixels, job.preview_format, job.preview_quality)))
        elif run.stop_latents is not None:
            spatial = unpack_latents(self._pipe, run.stop_latents, job.height, job.width)
            lrgb = self._latent_rgb_if_ready()
            rgb = latents_to_rgb(spatial, lrgb) if lrgb is not None and lrgb.channels == spatial.shape[1] else false_color(spatial)
            host = HostFrames(to_uint8_frames(rgb, job.preview_max_side))
            for index in range(host.shape[0]):
                frames.append((run.stop_step, encode_frame(host.array(index), job.preview_format, job.preview_quality)))
        else:
            # Cancelled before the first step: nothing to show but a placeholder pixel.
            blank = encode_frame(np.full((1, 1, 3), 128, dtype=np.uint8), job.preview_format, job.preview_quality)
            frames = [(0, blank)] * job.num_images
        extra = {"seed": float(job.seed)} if job.seed >= 0 else {}
        metrics = run.metrics(worker, **extra)
        for i, (step, frame) in enumerate(frames):
            self._emit_done(writer, frame, i, step, total, "cancelled", metrics, last=i == len(frames) - 1)

    @staticmethod
    def _emit_done(
        writer: StreamWriter,
        frame: EncodedFrame,
        index: int,
        step: int,
        total: int,
        reason: str,
        metrics: dict[str, float],
        *,
        last: bool,
    ) -> None:
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


# --- loading ----------------------------------------------------------------------------------


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _class_name_of(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as fh:
            return str(json.load(fh).get("_class_name"))
    except (OSError, ValueError, AttributeError):
        return None


def _hub_class_name(source: str, **kw: Any) -> str | None:
    """The pipeline class named in a hub model's ``model_index.json`` (the hub cache first, then the
    network unless offline), or None: read before loading, so the load uses the right dtype."""
    from diffusers import DiffusionPipeline

    options = {k: kw[k] for k in ("revision", "token", "cache_dir") if k in kw}
    for local_only in (True, False):
        if not local_only and _offline():
            break
        try:
            config = DiffusionPipeline.load_config(source, local_files_only=local_only, **options)
        except Exception:  # noqa: BLE001 - no config: the dtype falls back to the class loaded
            continue
        name = config.get("_class_name") if isinstance(config, dict) else None
        return str(name) if name else None
    return None


def _from_pretrained(source: str, dtype: torch.dtype, local_only: bool, **kw: Any) -> Any:
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(source, local_files_only=local_only, **_dtype_kwarg(dtype), **kw)


def load_image_model(
    name_or_path: Any = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    **kw: Any,
) -> ImageModel:
    """Load a diffusers text-to-image pipeline as a streaming `ImageModel`.

    ``name_or_path`` is a local diffusers folder (``model_index.json`` inside), a Hugging Face hub
    id (needs network, or the hub cache), a pipeline object you already built, or None for the
    project's own small embedded model (offline). ``device="auto"`` picks CUDA with float16 when
    there is a GPU (bfloat16 for Flux), else the CPU with float32; for a pipeline object "auto"
    leaves it where it is. ``taesd=`` and ``latent_rgb=`` go to `ImageModel`; other keywords go
    to ``DiffusionPipeline.from_pretrained`` (e.g. ``variant="fp16"``).

    Raises `ModelLoadError` with the cause and the fix when the model cannot be loaded.

    Example:
        >>> sd = load_image_model()                                   # doctest: +SKIP
        >>> sd = load_image_model("./models/sd-turbo", device="cuda")  # doctest: +SKIP
    """
    model_kw = {k: kw.pop(k) for k in ("taesd", "latent_rgb", "name", "preview_decoder") if k in kw}
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        return ImageModel(
            name_or_path,
            device=None if isinstance(device, str) and device == "auto" else device,
            dtype=dtype,
            **model_kw,
        )
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype)
    if name_or_path is None:
        folder = EMBEDDED_MODEL_DIR
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(
                f"the embedded image model is not installed (no model_index.json in {folder}); pass a "
                "diffusers pipeline folder, hub id or pipeline object: ms.load_image_model('path/to/folder')"
            )
        source, is_dir = str(folder), True
    else:
        source = os.path.expanduser(os.fspath(name_or_path))
        is_dir = os.path.isdir(source)
        if not is_dir and os.path.isfile(source):
            raise ModelLoadError(
                f"{source!r} is a single file; load_image_model takes a diffusers folder (model_index.json "
                "inside). Convert a single-file checkpoint with diffusers' from_single_file(...).save_pretrained(folder)"
            )
    class_name = _class_name_of(source) if is_dir else None
    if torch_dtype is None and class_name is None and not is_dir and torch_device.type == "cuda":
        # Only the dtype depends on the class (Flux: bfloat16), so only then is it looked up.
        class_name = _hub_class_name(source, **kw)
    if torch_dtype is None:
        torch_dtype = _default_dtype(torch_device, class_name)
    try:
        if is_dir:
            pipe = _from_pretrained(source, torch_dtype, True, **kw)
        else:
            try:
                pipe = _from_pretrained(source, torch_dtype, True, **kw)  # the hub cache, if it has it
            except Exception:  # noqa: BLE001 - then try the network, unless told not to
                if _offline():
                    raise
                pipe = _from_pretrained(source, torch_dtype, False, **kw)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one clear error
        if is_dir:
            raise ModelLoadError(
                f"could not load a diffusers pipeline from the folder {source!r}: {type(exc).__name__}: {exc}"
            ) from exc
        raise ModelLoadError(
            f"could not load {source!r}: there is no such local folder, and the Hugging Face hub could not "
            "be reached or does not have it (nor its local cache). Without network access, download the model "
            f"where there is network (e.g. `huggingface-cli download {source} --local-dir ./model`), copy the "
            f"folder here and pass it: ms.load_image_model('./model'). Details: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if class_name is None:
        class_name = type(pipe).__name__
    if dtype is None and torch_dtype == torch.float16 and class_name.startswith("Flux") and torch_device.type == "cuda":
        pipe = pipe.to(dtype=_default_dtype(torch_device, class_name))
    pipe = pipe.to(torch_device)
    return ImageModel(pipe, model_dir=source if is_dir else None, name=model_kw.pop("name", None) or os.fspath(name_or_path or "embedded:shapes"), **model_kw)
