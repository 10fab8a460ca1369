"""Where models run and in what precision: ``device="auto"`` and dtype names, for every adapter.

Example:
    >>> from multistream._devices import resolve_device, resolve_dtype
    >>> resolve_device("cpu").type, resolve_dtype("bf16")
    ('cpu', torch.bfloat16)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .errors import InvalidArgumentError, ModelLoadError

__all__ = ["MODULE_BUILD_LOCK", "check_device", "cuda_problem", "default_dtype", "moved_pipeline", "resolve_device",
           "resolve_dtype"]

#: Held while diffusers builds a model and while multistream builds its own small modules (preview
#: decoders). diffusers' low-memory loading (accelerate's ``init_empty_weights``) patches
#: ``torch.nn.Module`` for the whole process while it builds, so a module built in another thread
#: meanwhile gets its weights on the "meta" device, with no data: a restarted server continuing an
#: image on its preview decoder while it loaded its video model failed so.
MODULE_BUILD_LOCK = threading.RLock()

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None) means CUDA when present, else the CPU; anything else goes to ``torch.device``."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):  # its repr can be pages long (a tokenizer's)
        raise InvalidArgumentError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or a torch.device, got an object of type "
                                   f"{type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from exc


def check_device(device: torch.device, family: str) -> torch.device:
    """``device`` when this torch can run on it; a CUDA device on a torch without CUDA (a CPU
    build, or no GPU visible) is a `ModelLoadError` with the fix, before any weight is read.

    Example:
        >>> check_device(torch.device("cpu"), "text")
        device(type='cpu')
    """
    problem = cuda_problem(device)
    if problem is not None and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device={str(device)!r} asks for CUDA, but {problem}. Fix: "
            f"use device='cpu' (or 'auto'), or install a CUDA build of torch on a machine with an NVIDIA GPU: "
            f"ms.load_{family}_model(..., device='auto')")
    if problem is not None:
        raise ModelLoadError(
            f"device={str(device)!r}: {problem}. "
            f"Fix: use 'cuda' or 'cuda:0'..'cuda:{torch.cuda.device_count() - 1}'")
    return device


def cuda_problem(device: torch.device) -> str | None:
    """Why this torch cannot run on a CUDA ``device`` (no CUDA, or no such GPU), or None: the cause
    only, so that the Python loaders and the command line each word the fix in their own terms.

    Example:
        >>> cuda_problem(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "torch sees no CUDA GPU"
        return f"{build} runs here (torch {torch.__version__})"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a dtype or a name such as ``"float16"``/``"bf16"``; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")


def moved_pipeline(pipeline: Any, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    """A diffusers pipeline object on ``device`` and in ``dtype`` where given (``pipeline.to``), else
    as it was: what `ImageModel` and `VideoModel` do with the pipeline they wrap.

    Example:
        >>> moved_pipeline(pipe, "cpu", "fp32")   # doctest: +SKIP
    """
    torch_dtype = resolve_dtype(dtype)
    if device is None and torch_dtype is None:
        return pipeline
    moves: dict[str, Any] = {}
    if device is not None:
        moves["device"] = resolve_device(device)
    if torch_dtype is not None:
        moves["dtype"] = torch_dtype
    return pipeline.to(**moves)


def default_dtype(device: torch.device, *, prefer_bf16: bool) -> torch.dtype:
    """Full precision on the CPU; half precision on GPUs (bf16 where wanted and supported)."""
    if device.type != "cuda":
        return torch.float32
    if prefer_bf16 and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16
