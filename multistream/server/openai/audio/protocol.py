"""OpenAI's ``POST /v1/audio/speech`` body (`AudioSpeechRequest`) and the model names it takes.

Example:
    >>> AudioSpeechRequest.model_validate({"model": "tts-1", "input": "Hello."}).response_format
    'mp3'
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field, create_model

from ....speech import MAX_INPUT_CHARACTERS, SpeechOptions
from ...families import family
from ...http.bodies import LAX_BODY
from .._protocol import option_fields

#: OpenAI's speech model names: each means the served speech model (the family table's entry).
OPENAI_SPEECH_MODELS = family("speech").openai_models


OPENAI_PCM_RATE = 24000


class _AudioSpeechBase(BaseModel):
    """OpenAI's ``POST /v1/audio/speech`` body (unknown fields are ignored, as OpenAI's SDK may send more)."""

    model_config = LAX_BODY
    model: str = Field(description="tts-1, tts-1-hd, gpt-4o-mini-tts (all mean the served model) or its own name")
    input: str = Field(description=f"the text to speak, at most {MAX_INPUT_CHARACTERS} characters")
    voice: str = Field(default="alloy", description="an OpenAI voice name (the default voice) or one of the model's")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = Field(
        default="mp3", description="'mp3', 'opus', 'aac', 'flac', 'wav' or 'pcm' (24 kHz 16-bit mono little-endian, as OpenAI's)")
    instructions: Optional[str] = Field(default=None, description="not supported by these voices: leave it out")
    stream_format: Literal["audio", "sse"] = Field(default="audio", description="'audio' (the bytes) or 'sse' (events)")


# The fields that have a `SpeechOptions` namesake (type, default, description from the spec).
# ``voice`` is OpenAI's own (its voice names mean the default voice: `speech_voice`).
SPEECH_OPTION_FIELDS = ("speed", "priority")

AudioSpeechRequest = create_model(
    "AudioSpeechRequest", __base__=_AudioSpeechBase, __doc__=_AudioSpeechBase.__doc__,
    **option_fields(SpeechOptions, SPEECH_OPTION_FIELDS, ("priority",)))
