"""multistream: make generative models stream, through one event protocol.

Example:
    >>> import multistream as ms
    >>> llm = ms.load_text_model()                         # doctest: +SKIP
    >>> for ev in llm.stream("Write a haiku"):             # doctest: +SKIP
    ...     print(ev.delta, end="", flush=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes
from .errors import (
    EngineClosedError,
    EventFormatError,
    InvalidArgumentError,
    ModelLoadError,
    MultistreamError,
    PromptTooLongError,
    StreamConsumedError,
    StreamFinishedError,
)
from .events import (
    AudioEvent,
    ErrorEvent,
    Event,
    ImageEvent,
    TextEvent,
    VideoEvent,
    event_from_dict,
    event_from_json,
    event_json_schema,
)
from .stream import Stream, StreamWriter

__version__ = "0.1.0"

# Heavy modules (torch, transformers, diffusers) load only when their names are first used, so
# `import multistream` stays light enough for thin clients of the protocol.
_LAZY = {
    "TextModel": ".text",
    "load_text_model": ".text",
    "ImageModel": ".image",
    "ImageCheckpoint": ".image",
    "load_image_model": ".image",
    "fit_latent_rgb": ".image",
    "fit_preview_decoder": ".video",  # any VAE: the video decoder for a 3D one, else the image one
    "encode_frame": ".image",
    "SpeechModel": ".speech",
    "load_speech_model": ".speech",
    "speak": ".speech",
    "VideoModel": ".video",
    "load_video_model": ".video",
    "chain": ".compose",
    "merge": ".compose",
    "show": ".ui",
}

if TYPE_CHECKING:
    from .compose import chain, merge
    from .image import (
        ImageCheckpoint,
        ImageModel,
        encode_frame,
        fit_latent_rgb,
        load_image_model,
    )
    from .speech import SpeechModel, load_speech_model, speak
    from .text import TextModel, load_text_model
    from .ui import show
    from .video import VideoModel, fit_preview_decoder, load_video_model


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "AudioEvent",
    "EngineClosedError",
    "ErrorEvent",
    "Event",
    "EventFormatError",
    "ImageCheckpoint",
    "ImageEvent",
    "ImageModel",
    "InvalidArgumentError",
    "ModelLoadError",
    "MultistreamError",
    "PromptTooLongError",
    "SpeechModel",
    "Stream",
    "StreamConsumedError",
    "StreamFinishedError",
    "StreamWriter",
    "TextEvent",
    "TextModel",
    "VideoEvent",
    "VideoModel",
    "chain",
    "encode_frame",
    "event_from_dict",
    "event_from_json",
    "event_json_schema",
    "fit_latent_rgb",
    "fit_preview_decoder",
    "load_image_model",
    "load_speech_model",
    "load_text_model",
    "load_video_model",
    "merge",
    "show",
    "speak",
]
