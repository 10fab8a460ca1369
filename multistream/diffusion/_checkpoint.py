"""Resumable image runs: a checkpoint of a denoising run after step k, and a run that starts from it.
Video runs use the same checkpoints (``VideoModel.stream(..., on_checkpoint=, resume_from=)``):
what is said here of an image holds for a clip, whose request also records its ``num_frames``.

``ImageModel.stream(..., on_checkpoint=fn, checkpoint_every=k)`` calls ``fn`` with an
`ImageCheckpoint` after every k-th step; ``ImageModel.stream(..., resume_from=checkpoint)`` (the
same arguments as the run it came from) continues from that step and ends with the same final
image, bit for bit where the denoiser itself is deterministic (fp32 on a CPU: exact; the same GPU
and kernels: exact as well) and the run's steps are not batched with other requests'
(``ImageModel(max_batch=1)``; batched steps match within float rounding), and the same previews
after step k with their original step numbers.

A checkpoint holds what the rest of the run depends on:

* the latents after step k (in the run's dtype: fp16 would not be exact for an fp32 run);
* the scheduler's state where it differs from a fresh ``set_timesteps`` of the same run (the
  step index, a multistep solver's ``model_outputs`` and ``lower_order_nums``, Heun's first-order
  sample, ...), so the static tables (betas, alphas, sigmas) are not carried;
* the random generators' states, only where the steps drew noise (ancestral and SDE schedulers);
  a deterministic solver's checkpoint carries none, and the resumed run re-draws the initial
  noise from the seed to put its generators where the original's were;
* the conditioning after any ``steer(...)`` (prompt, negative prompt, guidance scale) and how
  many steers took effect;
* what a resume must match: steps, size, seed, images, scheduler and pipeline class, and a hash of
  the original prompt, negative prompt and guidance scale.

Diffusers pipelines have no "start at step k". The resumed run calls the pipeline as usual, on its
own shallow copy (`image_run._own_pipeline`), with three changes: the pipeline's
``interrupt`` property answers True for the first k iterations of its denoising loop (which it
then skips: no denoiser call, no scheduler step, no callback; the loop's own step counter, which
ControlNet and guidance schedules read, keeps its original values); ``prepare_latents`` draws its
noise as usual and returns the checkpoint's latents; ``set_timesteps`` computes the schedule as
usual and then restores the checkpoint's scheduler state. The first step the run takes is checked
to be step k+1.

`ImageCheckpoint.to_bytes()` is a safetensors file (the tensors, plus a JSON description of the
rest in its metadata), so loading one never unpickles anything. The embedded 64 px model's
checkpoint is 13 KB (fp32 4x16x16 latents and two multistep model outputs; taking one costs the
engine about 0.2 ms a step on a CPU); an SD 1.5 512 px fp16 run's about 100 KB.

Example:
    >>> saved = []
    >>> s = sd.stream("a red circle", steps=20, seed=0, on_checkpoint=saved.append, checkpoint_every=5)  # doctest: +SKIP
    >>> full = s.wait()                                                                                 # doctest: +SKIP
    >>> again = sd.generate("a red circle", steps=20, seed=0, resume_from=saved[1])  # from step 10   # doctest: +SKIP
    >>> again.data == full.data                                                                         # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np
import torch

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ._job import SteeringState

__all__ = ["CheckpointedContext", "CheckpointedJob", "ImageCheckpoint", "RunCheckpoints", "checkpoint_plan"]

logger = logging.getLogger("multistream")

_FORMAT = "multistream.diffusion._checkpoint/1"
_META_KEY = "multistream"
# Scheduler attributes that are not run state: the frozen config, and the wrappers that
# `X0Tracker` and `RunCheckpoints` install on the run's own scheduler while a run lasts.
_NOT_STATE = {"_internal_dict", "config", "step", "set_timesteps"}


class _Unsupported(Exception):
    """A scheduler attribute that a checkpoint cannot carry (a non-tensor object)."""


@dataclass(frozen=True, eq=False)
class ImageCheckpoint:
    """The state of an image run after ``step`` of ``total_steps`` denoising steps.

    Made by a run started with ``on_checkpoint=``; given back as ``resume_from=`` to a run with
    the same arguments, which continues from ``step + 1``. ``to_bytes()``/``from_bytes()`` give
    a compact, pickle-free form (safetensors) for storing it elsewhere (Redis, a file).

    Example:
        >>> saved = []
        >>> sd.generate("a red circle", steps=8, seed=0, on_checkpoint=saved.append)   # doctest: +SKIP
        >>> data = saved[3].to_bytes()                                                # doctest: +SKIP
        >>> sd.generate("a red circle", steps=8, seed=0, resume_from=ImageCheckpoint.from_bytes(data))  # doctest: +SKIP
    """

    step: int
    total_steps: int
    latents: torch.Tensor
    #: The scheduler's state that differs from a fresh ``set_timesteps``: a JSON-ready description
    #: in which tensors are named (``{"tensor": name, "cpu": bool}``), their values in ``tensors``.
    scheduler_state: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: How many random generators' states are in ``tensors`` (``rng.0``, ...); 0 where the steps drew no noise.
    generators: int = 0
    #: The conditioning after steers (``prompt``, ``negative_prompt``, ``guidance_scale``); None if never steered.
    conditioning: dict[str, Any] | None = None
    steers: int = 0
    #: What a resume must match (steps, size, seed, images, scheduler, pipeline, prompt hash).
    request: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data it holds (about the size of ``to_bytes()``, less a little metadata)."""
        return int(self.latents.numel() * self.latents.element_size()) + sum(
            int(t.numel() * t.element_size()) for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        """The checkpoint as a safetensors file (tensors, and a JSON description in its metadata).

        Example:
            >>> data = checkpoint.to_bytes(); ImageCheckpoint.from_bytes(data).step == checkpoint.step  # doctest: +SKIP
            True
        """
        from safetensors.torch import save

        meta = {"format": _FORMAT, "step": self.step, "total_steps": self.total_steps,
                "scheduler_state": self.scheduler_state, "generators": self.generators,
                "conditioning": self.conditioning, "steers": self.steers, "request": self.request}
        tensors = {"latents": self.latents.contiguous(), **{f"t.{k}": v.contiguous() for k, v in self.tensors.items()}}
        return save(tensors, metadata={_META_KEY: json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ImageCheckpoint:
        """Read what `to_bytes` wrote; `InvalidArgumentError` if ``data`` is not such a checkpoint.

        Example:
            >>> ImageCheckpoint.from_bytes(b"junk")                   # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            multistream.errors.InvalidArgumentError: resume_from is not a multistream image checkpoint (...
        """
        from safetensors.torch import load

        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"ImageCheckpoint.from_bytes takes bytes, got {type(data).__name__}")
        raw = bytes(data)
        try:
            meta = json.loads(_metadata(raw)[_META_KEY])
            tensors = load(raw)
            if meta.get("format") != _FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {_FORMAT!r}")
            latents = tensors.pop("latents")
            named = {k[2:]: v for k, v in tensors.items() if k.startswith("t.")}
            return cls(step=int(meta["step"]), total_steps=int(meta["total_steps"]), latents=latents,
                       scheduler_state=dict(meta["scheduler_state"]), tensors=named,
                       generators=int(meta.get("generators") or 0), conditioning=meta.get("conditioning"),
                       steers=int(meta.get("steers") or 0), request=dict(meta.get("request") or {}))
        except InvalidArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed input becomes one clear error
            raise InvalidArgumentError(
                f"resume_from is not a multistream image checkpoint ({type(exc).__name__}: {exc}); pass an "
                "ImageCheckpoint, or the bytes of ImageCheckpoint.to_bytes()"
            ) from None

    def __repr__(self) -> str:
        return (f"<ImageCheckpoint step {self.step}/{self.total_steps} latents {tuple(self.latents.shape)} "
                f"{str(self.latents.dtype).replace('torch.', '')} {self.nbytes} B>")


def _metadata(raw: bytes) -> dict[str, str]:
    """The metadata of a safetensors file held in memory (from its JSON header)."""
    if len(raw) < 8:
        raise ValueError("too short for a safetensors file")
    size = int.from_bytes(raw[:8], "little")
    if size > len(raw) - 8:
        raise ValueError("truncated safetensors header")
    header = json.loads(raw[8:8 + size])
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or _META_KEY not in meta:
        raise ValueError("no multistream metadata")
    return meta


# -- scheduler state: encode to JSON + tensors, and back -------------------------------------------


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else {"float": repr(f)}
    if isinstance(value, torch.Tensor):
        name = f"s{len(tensors)}"
        tensors[name] = value.detach().to("cpu", copy=True)
        return {"tensor": name, "cpu": value.device.type == "cpu"}
    if isinstance(value, np.ndarray):
        name = f"s{len(tensors)}"
        tensors[name] = torch.from_numpy(np.array(value, copy=True))
        return {"ndarray": name}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"list": items} if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}}
    raise _Unsupported(f"{path} is a {type(value).__name__}")


def _decode(value: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        t = tensors[value["tensor"]]
        return t.clone() if value.get("cpu", True) else t.to(device, copy=True)
    if "ndarray" in value:
        return tensors[value["ndarray"]].numpy().copy()
    if "float" in value:
        return float(value["float"])
    if "list" in value:
        return [_decode(v, tensors, device) for v in value["list"]]
    if "tuple" in value:
        return tuple(_decode(v, tensors, device) for v in value["tuple"])
    if "dict" in value:
        return {k: _decode(v, tensors, device) for k, v in value["dict"].items()}
    raise ValueError(f"unknown scheduler state entry {value!r}")


def _snapshot(scheduler: Any) -> dict[str, Any]:
    """The scheduler's run state now, with tensors copied (so later in-place changes do not leak in)."""
    out: dict[str, Any] = {}
    for key, value in vars(scheduler).items():
        if key in _NOT_STATE or callable(value):
            continue
        out[key] = _copy(value)
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - objects without a plain equality
        return False


# -- the pipeline copy of a resumed run -----------------------------------------------------------


_SKIPPING: dict[type, type] = {}


def _skipping_class(cls: type) -> type:
    """A subclass of the pipeline class whose ``interrupt`` is True for the first
    ``_ms_skip_steps`` reads (the denoising loop reads it once per iteration and skips the
    iteration when it is True)."""
    sub = _SKIPPING.get(cls)
    if sub is None:
        original = cls.interrupt  # type: ignore[attr-defined]

        def interrupt(self: Any) -> bool:
            skip = self.__dict__.get("_ms_skip_steps", 0)
            if skip > 0:
                self.__dict__["_ms_skip_steps"] = skip - 1
                return True
            return bool(original.fget(self))

        sub = type(cls.__name__, (cls,), {"interrupt": property(interrupt), "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _SKIPPING[cls] = sub
    return sub


def _generators(call_kwargs: dict[str, Any]) -> list[torch.Generator]:
    gen = call_kwargs.get("generator")
    if isinstance(gen, torch.Generator):
        return [gen]
    if isinstance(gen, (list, tuple)):
        return [g for g in gen if isinstance(g, torch.Generator)]
    return []


class CheckpointedContext(Protocol):
    """What checkpoints read of a run's model (an image or a video model's run context)."""

    pipeline: Any
    params: Mapping[str, Any]


class CheckpointedJob(Protocol):
    """What checkpoints read of a run's request (`ImageJob`, `multistream.video.VideoJob`)."""

    call_kwargs: dict[str, Any]
    steps: int
    height: int | None
    width: int | None
    seed: int


def _request_of(context: CheckpointedContext, job: CheckpointedJob) -> dict[str, Any]:
    """What a resumed run must share with the run its checkpoint came from (a clip: its frame count too)."""
    kwargs = job.call_kwargs
    conditioning = json.dumps([kwargs.get("prompt"), kwargs.get("negative_prompt"), kwargs.get("guidance_scale")])
    request = {"steps": job.steps, "height": job.height, "width": job.width,
               "num_images": getattr(job, "num_images", 1), "seed": job.seed,
               "scheduler": type(context.pipeline.scheduler).__name__, "pipeline": type(context.pipeline).__name__,
               "prompt_sha256": hashlib.sha256(conditioning.encode()).hexdigest()[:32]}
    if hasattr(job, "num_frames"):
        request["num_frames"] = job.num_frames
    return request


class RunCheckpoints:
    """Checkpointing and resuming of one image run (used by `ImageRun` on the engine thread).

    ``install(pipe, call_kwargs)`` wraps the run's own pipeline copy and scheduler;
    ``after_step(...)`` takes a checkpoint when one is due and hands it to ``on_checkpoint``.
    """

    def __init__(self, context: CheckpointedContext, job: CheckpointedJob, resume: ImageCheckpoint | None,
                 on_checkpoint: Callable[[ImageCheckpoint], Any] | None, every: int) -> None:
        self.request = _request_of(context, job)
        self.resume = resume
        self.sink = on_checkpoint
        self.every = every
        self.taken = 0
        self.first_step: int | None = None
        self._reference: dict[str, Any] | None = None
        self._scheduler: Any = None
        self._device = torch.device("cpu")
        self._rng_after_init: list[torch.Tensor] | None = None
        self._gens: list[torch.Generator] = []

    @property
    def start_step(self) -> int:
        """The number of steps already done when the run starts (0 unless it resumes)."""
        return self.resume.step if self.resume is not None else 0

    @property
    def steers_before(self) -> int:
        """The steers that took effect before the checkpoint this run resumes from (0 if none)."""
        return self.resume.steers if self.resume is not None else 0

    def metrics(self) -> dict[str, float]:
        """What the final event's ``metrics`` say of checkpoints: ``resumed_from_step`` when the run
        resumed, ``checkpoints`` taken when it takes them."""
        out: dict[str, float] = {}
        if self.resume is not None:
            out["resumed_from_step"] = float(self.resume.step)
        if self.sink is not None or self.taken:
            out["checkpoints"] = float(self.taken)
        return out

    def apply_conditioning(self, call_kwargs: dict[str, Any]) -> None:
        """Start from the conditioning the checkpoint was taken under (after its steers)."""
        cond = self.resume.conditioning if self.resume is not None else None
        if not cond:
            return
        for key in ("prompt", "negative_prompt", "guidance_scale"):
            if cond.get(key) is not None:
                call_kwargs[key] = cond[key]

    def install(self, pipe: Any, call_kwargs: dict[str, Any]) -> None:
        """Wrap ``pipe`` (the run's own copy) and its own scheduler for this run."""
        scheduler = pipe.scheduler
        self._scheduler = scheduler
        self._gens = _generators(call_kwargs)
        resume = self.resume
        original_set = scheduler.set_timesteps

        @functools.wraps(original_set)  # pipelines inspect its signature (timesteps=, sigmas=)
        def set_timesteps(*args: Any, **kwargs: Any) -> Any:
            out = original_set(*args, **kwargs)
            self._reference = _snapshot(scheduler)
            if resume is not None:
                count = len(scheduler.timesteps)
                if count != resume.total_steps:
                    raise InvalidArgumentError(
                        f"resume_from was taken from a run of {resume.total_steps} denoising steps; this run has "
                        f"{count}: resume with the arguments of the run the checkpoint came from")
                # Pipelines set the timesteps before they make the latents, so the run's device
                # is not known from those yet: ask the pipeline (a multistep solver's saved model
                # outputs must sit with the latents they are combined with).
                try:
                    device = torch.device(pipe._execution_device)
                except Exception:  # noqa: BLE001 - not a diffusers pipeline: where the timesteps are
                    timesteps = getattr(scheduler, "timesteps", None)
                    device = timesteps.device if isinstance(timesteps, torch.Tensor) else self._device
                for key, value in resume.scheduler_state.items():
                    vars(scheduler)[key] = _decode(value, resume.tensors, device)
            return out

        scheduler.set_timesteps = set_timesteps
        original_prepare = getattr(pipe, "prepare_latents", None)
        if original_prepare is not None:
            @functools.wraps(original_prepare)
            def prepare_latents(*args: Any, **kwargs: Any) -> Any:
                out = original_prepare(*args, **kwargs)  # draws the initial noise: the generators move on as before
                fresh = out[0] if isinstance(out, tuple) else out
                if isinstance(fresh, torch.Tensor):
                    self._device = fresh.device
                self._rng_after_init = [g.get_state() for g in self._gens]
                if resume is None:
                    return out
                if not isinstance(fresh, torch.Tensor) or tuple(fresh.shape) != tuple(resume.latents.shape):
                    got = tuple(fresh.shape) if isinstance(fresh, torch.Tensor) else type(fresh).__name__
                    raise InvalidArgumentError(
                        f"resume_from holds latents of shape {tuple(resume.latents.shape)}; this run makes {got}: "
                        "resume with the arguments of the run the checkpoint came from")
                latents = resume.latents.to(device=fresh.device, dtype=fresh.dtype, copy=True)
                if resume.generators:
                    for i, g in enumerate(self._gens):
                        g.set_state(resume.tensors[f"rng.{i}"])
                return (latents, *out[1:]) if isinstance(out, tuple) else latents

            pipe.__dict__["prepare_latents"] = prepare_latents
        if resume is not None and resume.step > 0:
            pipe.__class__ = _skipping_class(type(pipe))
            pipe.__dict__["_ms_skip_steps"] = resume.step

    def check_step(self, step: int) -> None:
        """The first step the run takes must follow the checkpoint's (else the skip went wrong)."""
        if self.first_step is None:
            self.first_step = step
            if self.resume is not None and step != self.resume.step + 1:
                raise RuntimeError(
                    f"resuming at step {self.resume.step + 1} went wrong: the pipeline took step {step} first "
                    "(its denoising loop does not read `interrupt` once per step); start the run afresh")

    def after_step(self, step: int, total: int, latents: torch.Tensor | None,
                   steering: SteeringState | None) -> None:
        """Take a checkpoint after ``step`` if one is due, and hand it to ``on_checkpoint``."""
        if self.sink is None or latents is None or step % self.every:
            return
        try:
            checkpoint = self.capture(step, total, latents, steering)
        except _Unsupported as exc:
            logger.warning("image checkpoints are off for this run: the %s scheduler's %s, which a checkpoint "
                           "cannot carry", type(self._scheduler).__name__, exc)
            self.sink = None
            return
        self.taken += 1
        self.sink(checkpoint)

    def capture(self, step: int, total: int, latents: torch.Tensor, steering: SteeringState | None) -> ImageCheckpoint:
        if self._reference is None:
            raise _Unsupported("state could not be read (set_timesteps was never called)")
        tensors: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {}
        for key, value in _snapshot(self._scheduler).items():
            if not _same(value, self._reference.get(key, _MISSING)):
                state[key] = _encode(value, tensors, key)
        generators = 0
        rng = [g.get_state() for g in self._gens]
        after = self._rng_after_init
        if rng and (after is None or len(after) != len(rng) or not all(torch.equal(a, b) for a, b in zip(after, rng))):
            generators = len(rng)
            for i, s in enumerate(rng):
                tensors[f"rng.{i}"] = s
        conditioning = None
        steers = 0
        if steering is not None and steering.applied:
            steers = len(steering.applied)
            conditioning = {"prompt": steering.prompt, "negative_prompt": steering.negative_prompt,
                            "guidance_scale": steering.guidance_scale}
        if self.resume is not None:
            steers += self.resume.steers
            if conditioning is None:
                conditioning = self.resume.conditioning
        return ImageCheckpoint(step=step, total_steps=total, latents=latents.detach().to("cpu", copy=True),
                               scheduler_state=state, tensors=tensors, generators=generators,
                               conditioning=conditioning, steers=steers, request=dict(self.request))


def checkpoint_plan(context: CheckpointedContext, job: CheckpointedJob, resume_from: Any, on_checkpoint: Any,
                    checkpoint_every: Any) -> RunCheckpoints | None:
    """Check ``stream()``'s checkpoint arguments; None when the run neither takes nor resumes from one."""
    if on_checkpoint is not None and not callable(on_checkpoint):
        raise InvalidArgumentError(
            f"on_checkpoint must be callable (it gets an ImageCheckpoint), got {type(on_checkpoint).__name__}")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, np.integer)) or checkpoint_every < 1:
        raise InvalidArgumentError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    if resume_from is None and on_checkpoint is None:
        return None
    pipe = context.pipeline
    if "callback_on_step_end" not in context.params:
        raise InvalidArgumentError(
            f"{type(pipe).__name__} has no callback_on_step_end, so its runs cannot be checkpointed or resumed")
    resume: ImageCheckpoint | None = None
    if resume_from is not None:
        if isinstance(resume_from, (bytes, bytearray, memoryview)):
            resume = ImageCheckpoint.from_bytes(resume_from)
        elif isinstance(resume_from, ImageCheckpoint):
            resume = resume_from
        else:
            raise InvalidArgumentError(
                f"resume_from must be an ImageCheckpoint or its to_bytes(), got {type(resume_from).__name__}")
        if not isinstance(inspect.getattr_static(type(pipe), "interrupt", None), property) or not hasattr(pipe, "prepare_latents"):
            raise InvalidArgumentError(
                f"{type(pipe).__name__} cannot resume from a checkpoint (its denoising loop has no `interrupt` "
                "check or it has no prepare_latents); start the run afresh")
        num_images = getattr(job, "num_images", None)
        if num_images and resume.latents.shape[0] % num_images:
            raise InvalidArgumentError(
                f"resume_from holds {resume.latents.shape[0]} latents; this run makes {num_images} images")
        mine = _request_of(context, job)
        for key, theirs in resume.request.items():
            if key == "seed" and (theirs is None or theirs < 0 or mine["seed"] < 0):
                continue  # a caller-made generator: its state is the caller's to match
            if mine.get(key) != theirs:
                what = "prompt, negative_prompt and guidance_scale" if key == "prompt_sha256" else f"{key}={theirs!r}"
                raise InvalidArgumentError(
                    f"resume_from was taken from a run with other arguments ({what}; this call has "
                    f"{'others' if key == 'prompt_sha256' else repr(mine.get(key))}): resume with the arguments of "
                    "the run the checkpoint came from")
    return RunCheckpoints(context, job, resume, on_checkpoint, int(checkpoint_every))
