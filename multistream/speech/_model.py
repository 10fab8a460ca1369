"""The speech model: text in, a `Stream` of ``audio`` events out, on one engine thread.

``ms.load_speech_model()`` gives a `SpeechModel` over the embedded Piper voice; ``stream(text)``
speaks the text sentence by sentence (the first audio comes after the first sentence, or the
first clause of a long one), each chunk an ``audio`` event of 16-bit PCM; the final event holds
the whole utterance as WAV.

Example:
    >>> import multistream as ms
    >>> tts = ms.load_speech_model()                                   # doctest: +SKIP
    >>> for ev in tts.stream("Hello there. How are you?"):             # doctest: +SKIP
    ...     print(ev.sample_offset, ev.num_samples, ev.text_span, ev.is_final)
    >>> open("hello.wav", "wb").write(tts.generate("Hello there.").audio)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..engine import EngineModel
from ..events import Event
from ..stream import Stream, StreamWriter
from ._options import parse_speech_options
from ._scheduler import SpeechRequest, SpeechScheduler
from ._synth import check_voice

__all__ = ["WARM_UP_TIMEOUT_S", "SpeechFeed", "SpeechModel"]

logger = logging.getLogger(__name__)

#: The longest a new `SpeechModel` waits for its voice's first run (one short sentence, done on
#: the engine thread) before it returns anyway.
WARM_UP_TIMEOUT_S = 60.0


class SpeechFeed:
    """The writing end of a speech stream whose text arrives while it is written.

    ``feed(delta)`` adds text (complete sentences start being spoken at once); ``end()`` says the
    text is complete. Made by `SpeechModel.open_stream`.
    """

    def __init__(self, request: SpeechRequest, model: SpeechModel) -> None:
        self._request = request
        # The writer of a speech stream keeps its model (and engine) alive, e.g. in
        # ms.speak(llm.stream(...), ms.load_speech_model()) where nothing else holds the model.
        self._model = model

    def feed(self, delta: str) -> None:
        if delta:
            self._request.feed(delta)

    def end(self) -> None:
        self._request.end()


class SpeechModel(EngineModel):
    """A text-to-speech model that streams audio events; one engine thread runs all its requests.

    Concurrent streams take turns sentence by sentence (higher ``priority`` first). ``voices``
    lists the voice names (the first is the default); ``sample_rate`` is the rate of every chunk.
    A new model is returned ready: its voice's first run (several times slower than later ones)
    is done on the engine thread before the constructor returns.

    Example:
        >>> tts = load_speech_model()                                  # doctest: +SKIP
        >>> final = tts.generate("Hello there.")                       # doctest: +SKIP
        >>> final.duration_s, final.metrics["ttfa_ms"]                 # doctest: +SKIP
    """

    #: Streams a server runs at once on this model (they take turns by sentence).
    capacity = 8

    def __init__(self, synth: Any, *, name: str | None = None, setup: Callable[[], None] | None = None) -> None:
        self.synth = synth
        self.name = name or synth.name
        self._scheduler = SpeechScheduler(synth)

        warmed = threading.Event()

        def start() -> None:
            try:
                if setup is not None:
                    setup()
                # The first run of a session is several times slower than later ones (allocations,
                # kernel choice); one short sentence here keeps that out of the first stream's
                # time to first audio.
                synth.synthesize("Hello.", None, 1.0)
            finally:
                warmed.set()

        self._scheduler.wake = self.start_engine(self._scheduler, name=f"speech-{self.name}", setup=start).wake
        # The model is returned ready: the first run happens inside the load (and inside its pause
        # of the cyclic collector, `multistream._gc`), not alongside whatever the caller does next.
        # Twice in about thirty full test runs a process died of a segmentation fault while its
        # main thread collected garbage during a voice's first onnxruntime run (cause unknown, not
        # reproduced in isolation); this takes that overlap away.
        if not warmed.wait(WARM_UP_TIMEOUT_S):
            logger.warning("speech model %s: its warm-up took over %.0f s; returning without waiting for it",
                           self.name, WARM_UP_TIMEOUT_S)

    @property
    def sample_rate(self) -> int:
        return int(self.synth.sample_rate)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.synth.voices)

    @property
    def default_voice(self) -> str:
        return self.voices[0]

    @property
    def device(self) -> str:
        return str(getattr(self.synth, "device", "cpu"))

    def __repr__(self) -> str:
        return f"<SpeechModel {self.name!r} {self.sample_rate} Hz on {self.device}>"

    def stream(self, text: str, **options: Any) -> Stream:
        """Speak ``text``; returns a `Stream` of ``audio`` events, the last one the whole utterance.

        ``voice`` (None: the default; one of `voices`), ``speed`` (0.25 to 4, 1 is normal) and
        ``priority`` (higher is synthesized first) are declared once in `SpeechOptions`. Empty
        text, more than 4,096 characters, a speed out of range or an unknown voice raise
        `InvalidArgumentError` here, before anything runs. ``cancel()`` stops within one chunk.

        Example:
            >>> s = tts.stream("Hello there. How are you?", speed=1.2)   # doctest: +SKIP
            >>> pcm = b"".join(ev.data for ev in s)                       # doctest: +SKIP
        """
        opts = parse_speech_options(text, **options)
        voice = check_voice(self.voices, opts.voice)

        def submit(writer: StreamWriter) -> None:
            self._engine.submit(SpeechRequest(writer, opts.text, voice=voice, speed=opts.speed, priority=opts.priority))

        return Stream(submit=submit, kind="speech")

    def open_stream(self, *, voice: str | None = None, speed: float = 1.0, priority: int = 0) -> tuple[Stream, SpeechFeed]:
        """A speech stream whose text comes later: ``(stream, feed)``; ``feed.feed(delta)`` as the
        text is written, ``feed.end()`` when it is complete. What `multistream.speak` builds on.

        Example:
            >>> s, feed = tts.open_stream()                               # doctest: +SKIP
            >>> feed.feed("Hello there. How are"); feed.feed(" you?"); feed.end()  # doctest: +SKIP
        """
        opts = parse_speech_options("-", voice=voice, speed=speed, priority=priority)
        voice = check_voice(self.voices, opts.voice)
        holder: list[SpeechRequest] = []

        def submit(writer: StreamWriter) -> None:
            req = SpeechRequest(writer, None, voice=voice, speed=opts.speed, priority=opts.priority)
            holder.append(req)
            self._engine.submit(req)

        stream = Stream(submit=submit, kind="speech")
        return stream, SpeechFeed(holder[0], self)

    def generate(self, text: str, *, on_event: Callable[[Event], Any] | None = None, **options: Any) -> Event:
        """Speak to the end, calling ``on_event`` for each event; returns the final event
        (``final.audio`` is the WAV file).

        Example:
            >>> open("hi.wav", "wb").write(tts.generate("Hi there.").audio)   # doctest: +SKIP
        """
        return self.stream(text, **options).wait(on_event)
