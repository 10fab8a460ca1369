"""The speech family: text-to-speech models that stream audio, sentence by sentence.

One public face over private modules: `SpeechModel` and `load_speech_model` (the model),
`SpeechOptions` and `parse_speech_options` (the one definition of every ``SpeechModel.stream()``
option, shared by the server and the CLI), `speak` (an LLM's answer spoken while it is written),
the sentence splitter and the audio encoders.

Example:
    >>> from multistream.speech import parse_speech_options
    >>> parse_speech_options("Hello.", speed=2).speed
    2.0
    >>> from multistream.speech import load_speech_model
    >>> tts = load_speech_model()                                        # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from ._options import (
    MAX_INPUT_CHARACTERS,
    SPEECH_STREAM_ARGS,
    SpeechOptions,
    check_speech_text,
    parse_speech_options,
)

# The model modules import numpy, onnxruntime (or torch), pysbd and PyAV; they load when first
# asked for, so the options stay light.
_LAZY = {
    "EMBEDDED_VOICE": "._loading",
    "load_speech_model": "._loading",
    "SpeechModel": "._model",
    "SpeechFeed": "._model",
    "SentenceSplitter": "._splitter",
    "split_sentences": "._splitter",
    "AUDIO_FORMATS": "._audio",
    "AudioEncoder": "._audio",
    "resample_pcm": "._audio",
    "wav_bytes": "._audio",
    "speak": "._speak",
}

if TYPE_CHECKING:
    from ._audio import AUDIO_FORMATS, AudioEncoder, resample_pcm, wav_bytes
    from ._loading import EMBEDDED_VOICE, load_speech_model
    from ._model import SpeechFeed, SpeechModel
    from ._speak import speak
    from ._splitter import SentenceSplitter, split_sentences


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "AUDIO_FORMATS",
    "AudioEncoder",
    "EMBEDDED_VOICE",
    "MAX_INPUT_CHARACTERS",
    "SPEECH_STREAM_ARGS",
    "SentenceSplitter",
    "SpeechFeed",
    "SpeechModel",
    "SpeechOptions",
    "check_speech_text",
    "load_speech_model",
    "parse_speech_options",
    "resample_pcm",
    "speak",
    "split_sentences",
    "wav_bytes",
]
