"""Where a model name points before any loader touches it: a local folder, a path that does not
exist, or a Hugging Face hub id, and whether the hub can be reached from here at all.

A hub id on a machine without network would otherwise spend most of a minute in the hub client's
retry loops, and a mistyped folder comes back from it as a complaint about repo-id syntax. Every
loader asks `locate` first: a local folder loads as it is; a path that does not exist, a name that
is no hub id, or a hub id that is neither reachable nor in the hub cache is a `ModelLoadError` with
the cause and the fix, in well under a second. Reachability is one short TCP connect to the hub's
endpoint, remembered for a little while, and the answer is applied per call
(``local_files_only=True``), never by setting ``HF_HUB_OFFLINE`` for the whole process.

Example:
    >>> from multistream._hub import locate
    >>> locate(".", family="text").local
    True
    >>> locate("./no/such/folder", family="text")               # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    multistream.errors.ModelLoadError: no such folder: ...
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .errors import ModelLoadError

__all__ = ["FAMILY_FILES", "HubSource", "hub_reachable", "locate", "looks_like_path"]

# How long the probe waits for the hub (DNS and connect), and how long its answer is kept: a
# machine whose network comes back is noticed within a minute, and a burst of loads probes once.
PROBE_TIMEOUT_S = 1.5
PROBE_TTL_S = 60.0
_TRUE = ("1", "true", "yes", "on")
# A hub id: "name" or "owner/name", letters, digits, "-", "_", "." (huggingface_hub's rule).
# Files a loader may be given, never the end of a hub id.
_FILE_SUFFIXES = (".onnx", ".json", ".gguf", ".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_REPO_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")

_probe_lock = threading.Lock()
_probe: dict[str, tuple[float, bool]] = {}  # endpoint -> (monotonic time, reachable)


@dataclass(frozen=True)
class HubSource:
    """What a model name is: ``path`` (a local folder or file, expanded) when ``local``, else a hub
    id that the loaders fetch with ``local_files_only=offline`` (True: only the hub cache holds it).

    Example:
        >>> HubSource("org/model", local=False, offline=True).from_pretrained_kwargs()
        {'local_files_only': True}
    """

    path: str
    local: bool
    offline: bool = False

    def from_pretrained_kwargs(self) -> dict[str, bool]:
        """What ``from_pretrained`` needs so that it never goes to an unreachable hub."""
        return {"local_files_only": True} if self.offline and not self.local else {}


def _env_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def _connects(host: str, port: int, timeout: float) -> bool:
    """One TCP connect, bounded as a whole: ``getaddrinfo`` has no timeout of its own, so the probe
    runs in a daemon thread that is left behind if DNS hangs."""
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="multistream-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def hub_reachable(*, refresh: bool = False) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT`` or huggingface.co) answers a TCP connect from
    here; False at once under ``HF_HUB_OFFLINE=1``. The answer is kept for a minute.

    Example:
        >>> isinstance(hub_reachable(), bool)
        True
    """
    if _env_offline():
        return False
    host, port = _endpoint()
    key = f"{host}:{port}"
    with _probe_lock:
        seen = _probe.get(key)
        if seen is not None and not refresh and time.monotonic() - seen[0] < PROBE_TTL_S:
            return seen[1]
        reachable = _connects(host, port, PROBE_TIMEOUT_S)
        _probe[key] = (time.monotonic(), reachable)
        return reachable


def looks_like_path(name: str) -> bool:
    """Whether ``name`` was meant as a path rather than a hub id: it starts with ``/``, ``./``,
    ``../``, ``~`` or a drive letter, ends with a file suffix (``.onnx``, ``.gguf``...), or its first
    part exists here (``models/mine`` where ``./models`` is a folder).

    Example:
        >>> looks_like_path("./models/mine"), looks_like_path("HuggingFaceTB/SmolLM2-135M")
        (True, False)
    """
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name in (".", "..") or re.match(r"^[A-Za-z]:[\\/]", name):
        return True
    if "\\" in name or name.count("/") > 1 or name.lower().endswith(_FILE_SUFFIXES):
        return True
    first = name.split("/", 1)[0]
    return "/" in name and os.path.exists(first)


def _in_hub_cache(repo_id: str, revision: str | None) -> bool:
    """Whether the hub cache holds ``repo_id`` (any of its files at ``revision``)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for filename in ("config.json", "model_index.json", "tokenizer_config.json"):
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(found, str):
            return True
    return False


# What a folder of each family holds (the fix of a "no such folder" error).
FAMILY_FILES = {
    "text": "a transformers causal LM (config.json, weights, tokenizer files)",
    "image": "a diffusers pipeline (model_index.json inside)",
    "video": "a diffusers text-to-video pipeline (model_index.json inside)",
    "speech": "a Piper voice (.onnx with its .onnx.json) or a transformers VitsModel folder",
}


def locate(name: str | os.PathLike[str], *, family: str, revision: str | None = None,
           files: str | None = None, pass_as: str | None = None) -> HubSource:
    """Where ``name`` points, or a `ModelLoadError` saying why it cannot load (see the module doc).

    ``family`` ("text", "image", "speech") names the loader in the fix; ``files`` says what a
    folder should hold (`FAMILY_FILES` by default); ``pass_as``: how the fix passes a downloaded
    folder, ``"ms.load_text_model('./model')"`` by default (the command line gives its flag:
    ``"--model ./model"``).

    Example:
        >>> source = locate("~", family="text")
        >>> source.local, source.from_pretrained_kwargs()
        (True, {})
    """
    raw = os.fspath(name)
    files = files or FAMILY_FILES.get(family, "a model")
    path = os.path.expanduser(raw)
    loader = f"ms.load_{family}_model"
    if os.path.exists(path):
        if family in _PIPELINE_FOLDER_FAMILIES:
            _check_pipeline_folder(raw, path, family)
        return HubSource(path, local=True)
    if not raw.strip():
        raise ModelLoadError(f"the {family} model name is empty. Fix: pass a local folder or a hub id to {loader}()")
    if looks_like_path(raw):
        parent = _nearest_existing(Path(path))
        what = "file" if raw.lower().endswith(_FILE_SUFFIXES) else "folder"
        raise ModelLoadError(
            f"no such {what}: {raw!r} ({os.path.abspath(path)} does not exist; the nearest existing folder is "
            f"{parent}). Fix: check the path; pass {files}")
    if not _REPO_ID.match(raw) or ".." in raw or raw.endswith((".", "-")):
        raise ModelLoadError(
            f"{raw!r} is neither a folder here nor a Hugging Face hub id (hub ids look like 'owner/name'). "
            f"Fix: pass an existing folder holding {files}, or a hub id such as 'owner/model-name'")
    if hub_reachable():
        return HubSource(raw, local=False)
    if _in_hub_cache(raw, revision):
        return HubSource(raw, local=False, offline=True)
    pass_as = pass_as or f"{loader}('./model')"
    why = "HF_HUB_OFFLINE is set" if _env_offline() else f"{':'.join(map(str, _endpoint()))} cannot be reached"
    raise ModelLoadError(
        f"cannot load {raw!r}: it is not a folder here, the Hugging Face hub is not reachable from this machine "
        f"({why}), and the hub cache does not hold it. Fix: download it where there is network "
        f"(`huggingface-cli download {raw} --local-dir ./model`), copy the folder here and pass the local folder "
        f"instead of the id; pass it: {pass_as}")


#: The families whose local model is a diffusers folder: a file, or a folder without its
#: model_index.json, is refused here, before the loader imports torch and diffusers (8 s, then
#: "HFValidationError: Repo id must use alphanumeric chars" for a file).
_PIPELINE_FOLDER_FAMILIES = frozenset({"image", "video"})


def _check_pipeline_folder(raw: str, path: str, family: str) -> None:
    if not os.path.isdir(path):
        raise ModelLoadError(
            f"{raw!r} is a single file; load_{family}_model takes a diffusers folder (model_index.json inside). "
            "Convert a single-file checkpoint with diffusers' from_single_file(...).save_pretrained(folder)")
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise ModelLoadError(
            f"the folder {raw!r} holds no model_index.json, so it is no diffusers pipeline. Fix: pass a folder "
            f"holding {FAMILY_FILES[family]}, as `huggingface-cli download OWNER/NAME --local-dir DIR` makes one")


def _nearest_existing(path: Path) -> str:
    for parent in path.absolute().parents:
        if parent.exists():
            return str(parent)
    return "/"
