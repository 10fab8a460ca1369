"""Arguments of diffusers' ``from_pretrained`` that changed between releases, spelled once.

Example:
    >>> sorted(dtype_kwarg(None))  # doctest: +SKIP
    ['dtype']
"""

from __future__ import annotations

from typing import Any

__all__ = ["dtype_kwarg"]


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument: ``dtype=`` in newer diffusers (which deprecate
    ``torch_dtype=`` with a warning at every load), ``torch_dtype=`` in older ones."""
    try:
        from diffusers.utils import deprecation_utils

        new = hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    except ImportError:
        new = False
    return {"dtype": dtype} if new else {"torch_dtype": dtype}
