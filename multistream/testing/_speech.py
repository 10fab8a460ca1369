"""`ScriptedSpeechModel`: the real `SpeechModel` over a tone synthesizer, for tests without a voice.

Example:
    >>> from multistream.testing import ScriptedSpeechModel
    >>> tts = ScriptedSpeechModel()
    >>> tts.generate("Hi.").finish_reason
    'stop'
    >>> tts.close()
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..speech import SpeechModel

__all__ = ["ScriptedSpeechModel"]


class _ToneSynth:
    """A synthesizer for tests: a quiet 220 Hz tone, ``samples_per_char`` samples a character,
    ``delay_s`` a piece (no model, no voice files)."""

    def __init__(self, sample_rate: int, samples_per_char: int, delay_s: float, voices: tuple[str, ...]) -> None:
        self.sample_rate = sample_rate
        self.samples_per_char = samples_per_char
        self.delay_s = delay_s
        self.voices = voices
        self.name = "scripted-speech"
        self.device = "cpu"
        self.calls: list[str] = []

    def synthesize(self, text: str, voice: str | None, speed: float) -> Any:
        import numpy as np

        self.calls.append(text)
        if self.delay_s:
            time.sleep(self.delay_s)
        n = max(1, int(len(text.strip()) * self.samples_per_char / speed))
        t = np.arange(n, dtype=np.float32) / self.sample_rate
        return (np.sin(2 * np.pi * 220.0 * t) * 3000).astype("<i2")


class ScriptedSpeechModel(SpeechModel):
    """A speech model for tests: the real `SpeechModel` (engine, splitter, options, events) over a
    tone synthesizer (``samples_per_char`` samples of a 220 Hz tone a character, ``delay_s`` a
    sentence), so servers and clients are tested without a voice. ``model.synth.calls`` lists
    the pieces it spoke.

    Example:
        >>> tts = ScriptedSpeechModel()
        >>> final = tts.generate("Hello there. Bye.")
        >>> final.finish_reason, final.sample_rate, final.metrics["chunks"]
        ('stop', 16000, 2)
        >>> tts.close()
    """

    def __init__(self, sample_rate: int = 16000, samples_per_char: int = 400, delay_s: float = 0.0,
                 voices: Sequence[str] = ("tone",)) -> None:
        super().__init__(_ToneSynth(sample_rate, samples_per_char, delay_s, tuple(voices)))
