"""The Speech tab (text in, audio out, live) and the Chat tab's "Speak the answer".

Audio reaches the page through Gradio's streaming ``gr.Audio`` (it plays while later chunks are
still being made; Gradio re-encodes the chunks with Debian's ``ffmpeg``, which ``scripts/setup.sh``
installs). Beside it, the text with the part spoken so far highlighted, from each chunk's
``text_span``.

"Speak the answer" follows the Chat tab's answer as it streams (the text the tab has shown so far)
into a speech stream of its own (`SpeechModel.open_stream`): each sentence is spoken as soon as it
is written, as `multistream.speak` does.

Example:
    >>> tab = SpeechTab(ModelSlot("speech", None, "no voice"), ActiveRuns(), max_fps=15)
    >>> tab.stop(None)                 # nothing running: nothing to stop
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import AsyncIterator, Callable
from typing import Any

import gradio as gr
import numpy as np

from ...errors import MultistreamError
from ...events import AudioEvent, ErrorEvent
from ..view import audio_summary
from ._shared import ActiveRuns, ModelSlot, run_key, ui_error

__all__ = ["SpeechTab", "spoken_html", "speak_while_written"]

_SAMPLE_TEXT = ("Hello there! This is multistream speaking, sentence by sentence. "
                "The first sentence plays while the next ones are still being made.")


def spoken_html(text: str, spoken_to: int, note: str = "") -> str:
    """The text with its spoken part highlighted.

    Example:
        >>> spoken_html("Hi. Bye.", 3)[:60]
        '<div id="ms-speech-text" style="font-size:15px;line-height:1'
    """
    done, rest = html.escape(text[:spoken_to]), html.escape(text[spoken_to:])
    return (f'<div id="ms-speech-text" style="font-size:15px;line-height:1.6"><mark style="background:#fde68a">'
            f'{done}</mark><span style="opacity:.55">{rest}</span></div>'
            f'<div style="font-size:12px;opacity:.7;margin-top:6px">{html.escape(note)}</div>')


def _chunk(ev: AudioEvent) -> tuple[int, np.ndarray]:
    return ev.sample_rate, np.frombuffer(ev.data, dtype="<i2")


class SpeechTab:
    """The Speech tab's layout and handlers; each browser session has its own run."""

    def __init__(self, model: ModelSlot, runs: ActiveRuns, max_fps: float) -> None:
        self.model = model
        self.runs = runs
        self.max_fps = max_fps

    async def speak(self, text: str, speed: float, request: gr.Request) -> AsyncIterator[tuple[Any, str]]:
        """"Speak": (audio chunk, text with the spoken part marked) as each sentence is made."""
        tts = self.model.get()
        text = text or ""
        try:
            stream = tts.stream(text, speed=float(speed))
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        key = run_key(request, "speech")
        self.runs.start(key, stream)
        made = 0.0
        try:
            yield None, spoken_html(text, 0, "speaking…")
            async for ev in stream:
                if isinstance(ev, ErrorEvent):
                    raise gr.Error(f"{ev.error.get('type')}: {ev.error.get('message')}")
                assert isinstance(ev, AudioEvent)
                if ev.is_final:
                    yield None, spoken_html(text, ev.text_span[1], audio_summary(ev))
                else:
                    made += ev.num_samples / ev.sample_rate
                    yield _chunk(ev), spoken_html(text, ev.text_span[1], f"{made:.1f} s of audio made…")
        finally:
            self.runs.end(key, stream)

    def stop(self, request: gr.Request) -> None:
        """"Stop": cancel this session's speech (within one chunk)."""
        self.runs.cancel(run_key(request, "speech"))

    def build(self) -> None:
        with gr.Tab("Speech", id="speech"):
            if self.model.missing:
                gr.Markdown(f"⚠️ No speech model: {self.model.why}")
            with gr.Row():
                with gr.Column(scale=1):
                    text = gr.Textbox(value=_SAMPLE_TEXT, lines=5, label="Text to speak", elem_id="ms-speech-input")
                    speed = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="Speed", elem_id="ms-speech-speed")
                    with gr.Row():
                        go = gr.Button("Speak", variant="primary", elem_id="ms-speech-go")
                        stop = gr.Button("Stop", variant="stop", elem_id="ms-speech-stop")
                with gr.Column(scale=1):
                    audio = gr.Audio(label="Speech (plays while it is made)", streaming=True, autoplay=True,
                                     interactive=False, elem_id="ms-speech-audio")
                    spoken = gr.HTML(spoken_html("", 0), elem_id="ms-speech-spoken")
            go.click(self.speak, [text, speed], [audio, spoken], api_name="speak", show_progress="hidden")
            stop.click(self.stop, None, None, api_name="stop_speech", queue=False)


async def speak_while_written(tts: Any, live_text: Callable[[], str | None], writing: Callable[[], bool],
                              poll_s: float = 0.05) -> AsyncIterator[AudioEvent]:
    """Speak a text that another handler is writing: ``live_text()`` is the text so far (None
    before it starts), ``writing()`` is False once it has ended. Yields the audio events (the
    final one last), each sentence as soon as it is written."""
    audio, feed = tts.open_stream()
    fed = 0

    async def follow() -> None:
        nonlocal fed
        started = False
        try:
            while True:
                text = live_text()
                started = started or text is not None or writing()
                if text and len(text) > fed:
                    feed.feed(text[fed:])
                    fed = len(text)
                if started and not writing():
                    text = live_text()
                    if text and len(text) > fed:
                        feed.feed(text[fed:])
                    return
                await asyncio.sleep(poll_s)
        finally:
            feed.end()

    task = asyncio.ensure_future(follow())
    try:
        async for ev in audio:
            yield ev  # type: ignore[misc]
    finally:
        task.cancel()
        audio.cancel()
