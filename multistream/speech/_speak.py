"""``speak(text_stream, tts)``: an answer spoken while it is written, as one stream.

The text stream's events pass through as they come; its text feeds a speech stream of ``tts``
(`SpeechModel.open_stream`) whose sentences are synthesized as soon as the splitter has them, so
the first audio arrives while the model is still writing. The text's final event arrives as an
ordinary (non-final) event with its ``finish_reason``, ``text``, ``usage`` and ``metrics``; the
composed stream's final event is the audio's final (the whole utterance as WAV), which comes
last since the last sentence is known only when the text has ended. Cancelling the composed
stream cancels both; an error in either ends it with that error and cancels the other.

Example:
    >>> import multistream as ms
    >>> llm, tts = ms.load_text_model(), ms.load_speech_model()              # doctest: +SKIP
    >>> for ev in ms.speak(llm.stream([{"role": "user", "content": "Hi"}]), tts):  # doctest: +SKIP
    ...     print(ev.type, ev.is_final)
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import InvalidArgumentError
from ..events import AudioEvent, ErrorEvent, Event, TextEvent
from ..stream import Stream, StreamWriter

__all__ = ["speak"]


def speak(text_stream: Stream, tts: Any, *, voice: str | None = None, speed: float = 1.0, priority: int = 0) -> Stream:
    """One stream of ``text_stream``'s events and the ``audio`` events of its text spoken by ``tts``.

    ``voice``, ``speed`` and ``priority`` are those of `SpeechModel.stream`.

    Example:
        >>> s = ms.speak(llm.stream("Tell me a joke"), tts)                  # doctest: +SKIP
        >>> first_audio = next(ev for ev in s if ev.type == "audio")         # doctest: +SKIP
    """
    if not isinstance(text_stream, Stream):
        raise InvalidArgumentError(
            f"speak() needs a text Stream as its first argument (e.g. llm.stream(...)), got {type(text_stream).__name__}"
        )
    if not callable(getattr(tts, "open_stream", None)):
        raise InvalidArgumentError(
            f"speak() needs a speech model as its second argument (ms.load_speech_model()), got {type(tts).__name__}"
        )
    audio, feed = tts.open_stream(voice=voice, speed=speed, priority=priority)

    def producer(writer: StreamWriter) -> None:
        def cancel_both() -> None:
            text_stream.cancel()
            audio.cancel()

        writer.on_cancel(cancel_both)
        audio_final: list[Event] = []

        def pump_audio() -> None:
            try:
                for ev in audio:
                    if ev.is_final:
                        audio_final.append(ev)
                        if isinstance(ev, ErrorEvent):
                            text_stream.cancel()
                    else:
                        writer.forward(ev)
            except BaseException as exc:  # noqa: BLE001 - must still end the composed stream
                audio_final.append(ErrorEvent(stream_id=audio.stream_id, seq=0, t=0.0,
                                              error={"type": type(exc).__name__, "message": str(exc)}))

        pump = threading.Thread(target=pump_audio, name=f"multistream-speak-{writer.stream_id[:8]}", daemon=True)
        pump.start()
        text = ""
        fed = 0
        try:
            for ev in text_stream:
                if isinstance(ev, TextEvent):
                    text = text[: ev.offset] + ev.delta
                    if len(text) > fed:  # text already spoken stays spoken, whatever an edit did to it
                        feed.feed(text[fed:])
                        fed = len(text)
                if isinstance(ev, ErrorEvent):
                    audio.cancel()
                    pump.join()
                    writer.forward(ev, is_final=True)
                    return
                writer.forward(ev, is_final=False)
                if ev.is_final and getattr(ev, "finish_reason", None) == "cancelled":
                    audio.cancel()
        except BaseException:
            audio.cancel()
            raise
        finally:
            feed.end()
        pump.join()
        final = audio_final[0]
        if isinstance(final, AudioEvent) and writer.cancelled and final.finish_reason != "cancelled":
            import dataclasses

            final = dataclasses.replace(final, finish_reason="cancelled")
        writer.forward(final, is_final=True)

    return Stream(producer, kind="mixed")
