"""Loading diffusers pipelines as streaming `ImageModel`s: local folders, hub ids, the embedded model.

Example:
    >>> import multistream as ms
    >>> sd = ms.load_image_model()                                  # doctest: +SKIP  (embedded, offline)
    >>> sd = ms.load_image_model("./models/sd-turbo", device="cuda")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._devices import MODULE_BUILD_LOCK, check_device, default_dtype, resolve_device, resolve_dtype
from .._gc import pauses_collector
from .._hub import locate
from .._notices import quiet_library_notices, quiet_loading_bars
from ..diffusion._pipeline_args import dtype_kwarg
from ..diffusion._sizes import EMBEDDED_IMAGE_SIZES
from ..errors import ModelLoadError

if TYPE_CHECKING:
    from ._model import ImageModel

__all__ = ["EMBEDDED_MODEL_DIR", "load_image_model"]

# Loading a pipeline makes transformers warn about torchvision, which we never use (`_notices`).
quiet_library_notices()

#: Where the project's own small text-to-image model lives (``load_image_model()`` with no name).
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent.parent / "_models" / "shapes"

def _default_dtype(device: torch.device, class_name: str | None) -> torch.dtype:
    # Flux overflows float16 (black images); its weights are bfloat16 to begin with.
    return default_dtype(device, prefer_bf16=bool(class_name and class_name.startswith("Flux")))


# --- loading ----------------------------------------------------------------------------------


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _class_name_of(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as fh:
            return str(json.load(fh).get("_class_name"))
    except (OSError, ValueError, AttributeError):
        return None


def _hub_class_name(source: str, *, offline: bool, **kw: Any) -> str | None:
    """The pipeline class named in a hub model's ``model_index.json`` (the hub cache first, then the
    network unless offline), or None: read before loading, so the load uses the right dtype."""
    from diffusers import DiffusionPipeline

    options = {k: kw[k] for k in ("revision", "token", "cache_dir") if k in kw}
    for local_only in (True, False):
        if not local_only and offline:
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

    with MODULE_BUILD_LOCK:
        return DiffusionPipeline.from_pretrained(source, local_files_only=local_only, **dtype_kwarg(dtype), **kw)


@pauses_collector  # a load builds millions of lasting objects: `multistream._gc`
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
    leaves it where it is. ``taesd=``, ``latent_rgb=``, ``preview_decoder=``, ``max_batch=`` and ``sizes=`` (the
    accepted heights and widths, `ImageSizes`) go to `ImageModel`; other keywords go
    to ``DiffusionPipeline.from_pretrained`` (e.g. ``variant="fp16"``).

    Raises `ModelLoadError` with the cause and the fix when the model cannot be loaded.

    Example:
        >>> sd = load_image_model()                                   # doctest: +SKIP
        >>> sd = load_image_model("./models/sd-turbo", device="cuda")  # doctest: +SKIP
    """
    from ._model import ImageModel

    model_kw = {k: kw.pop(k) for k in ("taesd", "latent_rgb", "name", "preview_decoder", "max_batch", "sizes") if k in kw}
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        return ImageModel(
            name_or_path,
            device=None if isinstance(device, str) and device == "auto" else check_device(resolve_device(device), "image"),
            dtype=dtype,
            **model_kw,
        )
    torch_device = check_device(resolve_device(device), "image")
    torch_dtype = resolve_dtype(dtype)
    offline = _offline()
    if name_or_path is None:
        folder = EMBEDDED_MODEL_DIR
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(
                f"the embedded image model is not installed (no model_index.json in {folder}); pass a "
                "diffusers pipeline folder, hub id or pipeline object: ms.load_image_model('path/to/folder')"
            )
        source, is_dir = str(folder), True
    else:
        # A missing folder, a name that is no hub id, or a hub the machine cannot reach (and whose
        # cache lacks the model) fails here, in a fraction of a second, instead of in hub retries.
        found = locate(name_or_path, family="image", revision=kw.get("revision"))
        source, offline = found.path, offline or found.offline
        is_dir = os.path.isdir(source)  # a local file, or a folder without model_index.json, was refused there
    class_name = _class_name_of(source) if is_dir else None
    if torch_dtype is None and class_name is None and not is_dir and torch_device.type == "cuda":
        # Only the dtype depends on the class (Flux: bfloat16), so only then is it looked up.
        class_name = _hub_class_name(source, offline=offline, **kw)
    if torch_dtype is None:
        torch_dtype = _default_dtype(torch_device, class_name)
    try:
        if is_dir:
            with quiet_loading_bars() if name_or_path is None else contextlib.nullcontext():
                pipe = _from_pretrained(source, torch_dtype, True, **kw)
        else:
            try:
                pipe = _from_pretrained(source, torch_dtype, True, **kw)  # the hub cache, if it has it
            except Exception:  # noqa: BLE001 - then try the network, unless there is none
                if offline:
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
    if is_dir and "sizes" not in model_kw and Path(source).resolve() == EMBEDDED_MODEL_DIR:
        # The embedded model's range is what it was trained for (`EMBEDDED_IMAGE_SIZES`), not
        # what its pipeline's factor alone allows.
        model_kw["sizes"] = EMBEDDED_IMAGE_SIZES
    return ImageModel(pipe, model_dir=source if is_dir else None, name=model_kw.pop("name", None) or os.fspath(name_or_path or "embedded:shapes"), **model_kw)
