"""Where models run and in what precision: ``device="auto"`` and dtype names, for every adapter.

Example:
    >>> from multistream._devices import resolve_device, resolve_dtype
    >>> resolve_device("cpu").type, resolve_dtype("bf16")
    ('cpu', torch.bfloat16)
"""

from __future__ import annotations

import torch

from .errors import InvalidArgumentError

__all__ = ["default_dtype", "resolve_device", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None) means CUDA when present, else the CPU; anything else goes to ``torch.device``."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from exc


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a dtype or a name such as ``"float16"``/``"bf16"``; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")


def default_dtype(device: torch.device, *, prefer_bf16: bool) -> torch.dtype:
    """Full precision on the CPU; half precision on GPUs (bf16 where wanted and supported)."""
    if device.type != "cuda":
        return torch.float32
    if prefer_bf16 and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16
