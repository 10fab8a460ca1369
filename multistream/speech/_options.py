"""The one definition of every ``SpeechModel.stream()`` option, checked without onnxruntime or torch.

`SpeechOptions` declares each option once (type, default, bounds in its check, description); the
model, the server's request bodies (OpenAI ``/v1/audio/speech`` and native ``/v1/speech``) and the
CLI all go through `parse_speech_options`, so every entry point refuses the same values with the
same message. Whether a voice exists depends on the model, so the model checks that one.

Example:
    >>> parse_speech_options("Hello there.", speed=1.5).speed
    1.5
    >>> parse_speech_options("Hello", speed=9)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: speed must be a number from 0.25 to 4 (1 is normal), got 9
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .._checks import is_int, is_number
from .._spec import option, option_names, parse_options
from ..errors import InvalidArgumentError

__all__ = ["MAX_INPUT_CHARACTERS", "SPEECH_STREAM_ARGS", "SpeechOptions", "check_speech_text", "parse_speech_options"]

MAX_INPUT_CHARACTERS = 4096  # OpenAI's limit for /v1/audio/speech, kept for every entry point
MIN_SPEED, MAX_SPEED = 0.25, 4.0


def check_speech_text(text: Any) -> str:
    """The text to speak, or `InvalidArgumentError` saying what is wrong with it."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"the text to speak must be a string, got {type(text).__name__}")
    if not text.strip():
        # Said without a surface's syntax: the same words reach Python, the CLI and the HTTP routes.
        raise InvalidArgumentError("the text to speak is empty; give some words to speak, e.g. 'Hello there.'")
    if len(text) > MAX_INPUT_CHARACTERS:
        raise InvalidArgumentError(
            f"the text to speak has {len(text)} characters, more than {MAX_INPUT_CHARACTERS}; "
            "split it and speak the parts one after another"
        )
    return text


def _voice(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise InvalidArgumentError(f"voice must be a voice name (a non-empty string) or None, got {v!r}")
    return v  # type: ignore[no-any-return]


def _speed(v: Any) -> float:
    if not is_number(v) or not MIN_SPEED <= float(v) <= MAX_SPEED:
        raise InvalidArgumentError(f"speed must be a number from 0.25 to 4 (1 is normal), got {v!r}")
    return float(v)


def _priority(v: Any) -> int:
    if not is_int(v):
        raise InvalidArgumentError(f"priority must be an integer (higher runs first), got {v!r}")
    return int(v)


@dataclass(frozen=True)
class SpeechOptions:
    """Checked ``SpeechModel.stream()`` options: each declared once, here."""

    text: str
    voice: Optional[str] = option(None, "a voice name of the model; null: its default voice", _voice,
                                  wire=Optional[str])
    speed: float = option(1.0, "a number from 0.25 to 4: speaking rate (1 is normal)", _speed, wire=float, ge=MIN_SPEED, le=MAX_SPEED)
    priority: int = option(0, "an integer; higher is synthesized first, sentence by sentence", _priority, wire=int)


SPEECH_STREAM_ARGS = option_names(SpeechOptions)


def parse_speech_options(text: Any, **options: Any) -> SpeechOptions:
    """Check ``text`` and every option; `InvalidArgumentError` names the first bad one and the fix."""
    return parse_options(SpeechOptions, "SpeechModel.stream()", options, text=check_speech_text(text))
