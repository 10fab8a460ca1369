"""TAESD (diffusers' ``AutoencoderTiny``) weights for ``preview="taesd"``, from a folder or an object.

Example:
    >>> load_taesd(3, torch.device("cpu"), torch.float32)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: taesd must be a folder path or a diffusers AutoencoderTiny object, got int
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._devices import MODULE_BUILD_LOCK
from ..diffusion._pipeline_args import dtype_kwarg
from ..errors import InvalidArgumentError, ModelLoadError

__all__ = ["load_taesd"]


def load_taesd(taesd: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(taesd, (str, os.PathLike)):
        from diffusers import AutoencoderTiny

        path = os.fspath(taesd)
        try:
            with MODULE_BUILD_LOCK:
                model = AutoencoderTiny.from_pretrained(path, local_files_only=os.path.isdir(path), **dtype_kwarg(dtype))
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
