"""The pipeline call's own arguments a denoising stream passes through (``pipeline_kwargs``:
the names that are not options of `ImageModel.stream` or `VideoModel.stream`), checked before
anything runs: those the stream sets itself are refused with what to use instead, and each error
names the argument (``param``: a server's 400 says which field is at fault).

Example:
    >>> check_pipeline_kwargs({"num_inference_steps": 4}, seed=None, owner="VideoModel.stream()",
    ...                       reserved={"num_inference_steps": "steps="})
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: 'num_inference_steps' is set by VideoModel.stream() itself; use steps=
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["check_pipeline_kwargs"]


def check_pipeline_kwargs(kwargs: Mapping[str, Any], *, seed: Any, owner: str, reserved: Mapping[str, str | None],
                          output_types: Sequence[str] = ()) -> None:
    """Refuse the first argument of ``kwargs`` the stream cannot pass on. ``reserved``: the names
    ``owner`` sets itself, each with what to use instead (or None); ``output_types``: the
    ``output_type`` values it takes, where ``output_type`` is not reserved."""
    for key, value in kwargs.items():
        if key in reserved:
            instead = reserved[key]
            raise InvalidArgumentError(f"{key!r} is set by {owner} itself" + (f"; use {instead}" if instead else ""),
                                       param=key)
        if key == "callback_on_step_end" and value is not None and not callable(value):
            raise InvalidArgumentError("callback_on_step_end must be callable (it runs after multistream's own)",
                                       param=key)
        if key == "output_type" and value not in output_types:
            raise InvalidArgumentError(f"output_type={value!r} is not supported: the stream encodes its frames; use "
                                       f"one of {list(output_types)}", param=key)
        if key == "generator" and seed is not None:
            raise InvalidArgumentError("pass either seed= or generator=, not both", param="generator")
