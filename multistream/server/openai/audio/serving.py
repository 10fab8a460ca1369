"""OpenAI speech's SSE form (``stream_format: "sse"``) from the encoded audio: `SpeechEvents` turns
each encoded chunk and the stream's end into ``speech.audio.delta`` / ``speech.audio.done`` (or
``error``) payloads; a pure translator, testable without a server.

Example:
    >>> events = SpeechEvents(input_characters=5)
    >>> [name for name, _ in events.payloads(b"\\x00\\x01", None)]
    ['speech.audio.delta']
"""

from __future__ import annotations

import base64
from typing import Any

from ....events import AudioEvent, ErrorEvent

__all__ = ["SpeechEvents"]


class SpeechEvents:
    """The SSE payloads of one OpenAI speech response whose input has ``input_characters``."""

    def __init__(self, input_characters: int) -> None:
        self.input_characters = input_characters

    def usage(self, end: AudioEvent) -> dict[str, Any]:
        """OpenAI's usage of a finished utterance: the input's characters as input tokens, and an
        output token per 20 ms of audio."""
        chars = self.input_characters
        out_tokens = int(round((end.duration_s or 0) * 1000 / 20))
        return {"input_tokens": chars, "output_tokens": out_tokens, "total_tokens": chars + out_tokens,
                "input_characters": chars, "audio_seconds": (end.usage or {}).get("audio_seconds")}

    def payloads(self, data: bytes, end: AudioEvent | ErrorEvent | None) -> list[tuple[str, dict[str, Any]]]:
        """``(SSE event name, payload)`` pairs for an encoded chunk ``data`` and, at the stream's
        end, its final (``end``: the final audio event or an error; None before the end)."""
        out: list[tuple[str, dict[str, Any]]] = []
        if data:
            out.append(("speech.audio.delta", {"type": "speech.audio.delta",
                                               "audio": base64.b64encode(data).decode("ascii")}))
        if isinstance(end, ErrorEvent):
            out.append(("error", {"type": "error", "error": end.error}))
        elif end is not None:
            out.append(("speech.audio.done", {"type": "speech.audio.done", "usage": self.usage(end)}))
        return out
