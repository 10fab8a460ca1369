"""Loading diffusers video pipelines as streaming `VideoModel`s: folders, hub ids, objects, the embedded model.

Example:
    >>> import multistream as ms
    >>> vm = ms.load_video_model()          # doctest: +SKIP
    >>> vm = ms.load_video_model("./models/wan", device="cuda")   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._devices import MODULE_BUILD_LOCK, check_device, resolve_device, resolve_dtype
from .._gc import pauses_collector
from .._notices import quiet_library_notices, quiet_loading_bars
from ..diffusion._pipeline_args import dtype_kwarg
from ..diffusion._sizes import EMBEDDED_VIDEO_SIZES
from ..errors import ModelLoadError
from ._motion_prior import MotionPrior

if TYPE_CHECKING:
    from ._model import VideoModel

__all__ = ["EMBEDDED_VIDEO_DIR", "VIDEO_DEFAULTS_FILE", "load_video_model", "read_video_defaults"]

# Loading a pipeline makes transformers warn about torchvision, which we never use (`_notices`).
quiet_library_notices()

#: Where the project's own small text-to-video model lives (``load_video_model()`` with no name).
EMBEDDED_VIDEO_DIR = Path(__file__).resolve().parent.parent / "_models" / "shapes_video"
#: A model folder's defaults for ``None`` options: ``{"num_frames", "fps", "steps", "guidance_scale", "width", "height"}``.
VIDEO_DEFAULTS_FILE = "video.json"


def read_video_defaults(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The folder's ``video.json`` (empty where it has none); a broken file is a `ModelLoadError`."""
    path = Path(folder) / VIDEO_DEFAULTS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, e.g. {{\"num_frames\": 16, \"fps\": 8}}")
    keys = ("num_frames", "fps", "steps", "guidance_scale", "width", "height")
    return {k: data[k] for k in keys if data.get(k) is not None}


@pauses_collector  # a load builds millions of lasting objects: `multistream._gc`
def load_video_model(name_or_path: Any = None, *, device: str | torch.device = "auto",
                     dtype: str | torch.dtype | None = None, **kw: Any) -> VideoModel:
    """Load a diffusers text-to-video pipeline as a streaming `VideoModel`.

    ``name_or_path``: None for the project's own embedded model (offline; `ModelLoadError` when it is
    not installed), a local diffusers folder (``model_index.json`` inside; its ``video.json`` sets
    the defaults), a Hugging Face hub id (needs network or the hub cache), or a pipeline object.
    ``device="auto"`` picks CUDA (float16; bfloat16 where supported) when there is a GPU, else the
    CPU (float32); for a pipeline object it leaves it where it is. ``preview_decoder=``, ``sizes=``,
    ``defaults=`` and ``name=`` go to `VideoModel`; other keywords to ``DiffusionPipeline.from_pretrained``.

    Example:
        >>> vm = load_video_model()                                       # doctest: +SKIP
        >>> vm = load_video_model("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", device="cuda")  # doctest: +SKIP
    """
    from ._model import VideoModel

    model_kw = {k: kw.pop(k) for k in ("preview_decoder", "sizes", "defaults", "name") if k in kw}
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        auto = isinstance(device, str) and device == "auto"
        return VideoModel(name_or_path, device=None if auto else check_device(resolve_device(device), "video"),
                          dtype=dtype, **model_kw)
    torch_device = check_device(resolve_device(device), "video")
    torch_dtype = resolve_dtype(dtype)
    if torch_dtype is None:
        torch_dtype = torch.float32 if torch_device.type == "cpu" else (
            torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    if name_or_path is None:
        folder = EMBEDDED_VIDEO_DIR
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(
                f"the embedded video model is not installed (no model_index.json in {folder}); pass a diffusers "
                "video pipeline folder, hub id or pipeline object: ms.load_video_model('path/to/folder')"
            )
        source, name = str(folder), "embedded:shapes_video"
        model_kw.setdefault("sizes", EMBEDDED_VIDEO_SIZES)
    else:
        from .._hub import locate

        found = locate(name_or_path, family="video", revision=kw.get("revision"))
        source, name = found.path, os.fspath(name_or_path)
    is_dir = os.path.isdir(source)
    if is_dir:
        kw = {**_saved_as_none(Path(source)), **kw}
    from diffusers import DiffusionPipeline

    try:
        try:
            bars = quiet_loading_bars() if name_or_path is None else contextlib.nullcontext()
            with MODULE_BUILD_LOCK, bars:
                pipe = DiffusionPipeline.from_pretrained(source, local_files_only=True, **dtype_kwarg(torch_dtype), **kw)
        except Exception:  # noqa: BLE001 - a hub id not in the cache: then the network
            if is_dir:
                raise
            with MODULE_BUILD_LOCK:
                pipe = DiffusionPipeline.from_pretrained(source, **dtype_kwarg(torch_dtype), **kw)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one clear error
        raise ModelLoadError(
            f"could not load a diffusers video pipeline from {source!r}: {type(exc).__name__}: {str(exc)[:300]}. "
            "Pass a local folder with model_index.json (download it where there is network first), or a pipeline object"
        ) from exc
    pipe = pipe.to(torch_device)
    defaults = read_video_defaults(source) if is_dir else {}
    defaults.update(model_kw.pop("defaults", None) or {})
    return VideoModel(pipe, model_dir=source if is_dir else None, name=model_kw.pop("name", None) or name,
                      defaults=defaults, motion_prior=MotionPrior.from_folder(source) if is_dir else None, **model_kw)


def _saved_as_none(folder: Path) -> dict[str, None]:
    """The components a pipeline folder was saved without (``[null, null]`` in model_index.json),
    passed back as None: diffusers writes them so, but pipelines whose ``__init__`` requires one
    (``AnimateDiffSDXLPipeline``'s ``motion_adapter`` when the UNet already holds the motion modules,
    the embedded model's) refuse to load without it.

    Example:
        >>> _saved_as_none(EMBEDDED_VIDEO_DIR)                             # doctest: +SKIP
        {'feature_extractor': None, 'image_encoder': None, 'motion_adapter': None, 'text_encoder': None, 'tokenizer': None}
    """
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return {}  # no index, or a broken one: from_pretrained says what is wrong
    return {k: None for k, v in index.items() if not k.startswith("_") and v == [None, None]}
