"""Show a stream live in Jupyter: text grows, preview frames replace each other, then the result.

A video stream shows every frame's current estimate per step (the animated preview plays in
place), then the finished clip in a looping ``<video>``.

``ms.show(stream)`` renders any stream (text, image, or a composed one) in one output area that
is updated in place (``display(..., display_id=True)`` then ``.update()``), at most ``max_fps``
times a second and always once more for the final event. Edits show in place too: text follows
each event's ``offset`` (``text = text[:offset] + delta``), so after a ``rewind`` the cut part
disappears and the regenerated text takes its place, with the ``revision`` beside it. Outside Jupyter it prints the text as
it arrives and a progress line for images and clips. It returns the final event. The folding of events and
the update rate are the shared ``LiveView`` and ``Throttle`` (``multistream.ui.view``), as in the demo.

Example (in a notebook cell):
    >>> import multistream as ms
    >>> llm = ms.load_text_model()                                         # doctest: +SKIP
    >>> final = ms.show(llm.stream("Write a haiku", max_new_tokens=48))    # doctest: +SKIP
    >>> final.metrics["tokens_per_s"]                                      # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

from ..errors import InvalidArgumentError
from ..events import Event, ImageEvent, TextEvent, VideoEvent
from ..stream import Stream
from .view import CONFIDENCE_CSS, LiveView, Throttle, audio_summary, confidence_html, ending_words, eta_words

__all__ = ["show"]


def _text_summary(ev: TextEvent) -> str:
    m = ev.metrics or {}
    u = ev.usage or {}
    bits = [ending_words(ev.finish_reason)]
    if ev.revision:
        bits.append(f"revision {ev.revision}")
    if "completion_tokens" in u:
        bits.append(f"{u['completion_tokens']} tokens")
    if m.get("ttft_ms") is not None:
        bits.append(f"TTFT {m['ttft_ms']:.0f} ms")
    if m.get("tokens_per_s") is not None:
        bits.append(f"{m['tokens_per_s']:.1f} tokens/s")
    return " · ".join(bits)


def _image_summary(ev: ImageEvent) -> str:
    m = ev.metrics or {}
    bits = [ending_words(ev.finish_reason), f"{ev.width}x{ev.height}", f"{ev.step}/{ev.total_steps} steps"]
    if m.get("duration_ms") is not None:
        bits.append(f"{m['duration_ms'] / 1000:.2f} s")
    return " · ".join(bits)


def _video_summary(ev: VideoEvent) -> str:
    m = ev.metrics or {}
    bits = [ending_words(ev.finish_reason), f"{ev.num_frames} frames {ev.width}x{ev.height} at {ev.fps:g} fps",
            f"{ev.step}/{ev.total_steps} steps", ev.mime]
    if m.get("duration_ms") is not None:
        bits.append(f"{m['duration_ms'] / 1000:.2f} s")
    return " · ".join(bits)


def _video_html(index: int, frame: Any, width: int) -> str:
    """One clip: while it denoises, every frame's current estimate (an animated WebP plays in an
    ``<img>``; a contact sheet shows them side by side), then the clip in a looping ``<video>``."""
    ev = frame.ev
    src = f"data:{ev.mime};base64,{base64.b64encode(ev.data).decode('ascii')}"
    style = f"width:{width}px;height:auto;border-radius:6px;display:block;background:#ddd"
    if frame.final and ev.mime.startswith("video/"):
        # muted: browsers only autoplay muted media; the clip has no sound anyway.
        media = (f'<video class="ms-video" src="{src}" controls autoplay loop muted playsinline '
                 f'style="{style}"></video>')
        caption = _video_summary(ev)
    else:
        media = f'<img class="ms-video-preview" src="{src}" alt="clip {index}, step {ev.step}" style="{style}"/>'
        caption = (_video_summary(ev) if frame.final else
                   f"step {ev.step}/{ev.total_steps} · {ev.num_frames} frames · {eta_words(ev.eta_s)}")
    pct = 100 * ev.step / ev.total_steps if ev.total_steps else 100
    return (f'<figure style="margin:0;width:{width}px">{media}'
            f'<div style="height:3px;background:rgba(127,127,127,.2);margin-top:4px"><div style="height:3px;'
            f'width:{pct:.0f}%;background:#f97316"></div></div>'
            f'<figcaption style="font-size:12px;opacity:.7">{html.escape(caption)}</figcaption></figure>')


def _render_html(view: LiveView, width: int) -> str:
    """One self-contained HTML block (inline styles, data URLs) so it works in any Jupyter front end."""
    parts: list[str] = ['<div class="multistream-show" style="display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start">']
    if view.texts:
        parts.append('<div style="flex:1 1 320px;min-width:240px">')
        for i, done in enumerate(view.text_done):
            settled, provisional = view.settled(i)
            # A beam search's provisional tail (it may still change) is shown faded.
            body = html.escape(settled) + (
                f'<span class="ms-provisional" style="opacity:.45">{html.escape(provisional)}</span>'
                if provisional else "") or "&#8203;"
            if view.tokens and len(view.texts) == 1 and not provisional:
                # logprobs=True: each token coloured by its probability, its alternatives on hover.
                body = f"<style>{CONFIDENCE_CSS}</style>{confidence_html(view)}"
            cursor = "" if done is not None else '<span style="opacity:.5">▍</span>'
            if done is None and view.revision:
                cursor += f'<span style="font-size:11px;opacity:.6"> revision {view.revision}</span>'
            parts.append(
                '<pre style="white-space:pre-wrap;word-break:break-word;margin:0 0 4px 0;padding:8px;'
                f'border-radius:6px;background:rgba(127,127,127,.08);font-size:13px">{body}{cursor}</pre>'
            )
            if done is not None:
                parts.append(f'<div style="font-size:12px;opacity:.7;margin-bottom:8px">{html.escape(_text_summary(done))}</div>')
        parts.append("</div>")
    for index in sorted(view.images):
        frame = view.images[index]
        ev = frame.ev
        src = f"data:{ev.mime};base64,{base64.b64encode(ev.data).decode('ascii')}"
        caption = _image_summary(ev) if frame.final else f"step {ev.step}/{ev.total_steps} · {eta_words(ev.eta_s)}"
        pct = 100 * ev.step / ev.total_steps if ev.total_steps else 100
        parts.append(
            f'<figure style="margin:0;width:{width}px">'
            f'<img src="{src}" alt="image {index}, step {ev.step}" style="width:{width}px;height:auto;'
            'border-radius:6px;display:block;background:#ddd"/>'
            f'<div style="height:3px;background:rgba(127,127,127,.2);margin-top:4px"><div style="height:3px;width:{pct:.0f}%;background:#f97316"></div></div>'
            f'<figcaption style="font-size:12px;opacity:.7">{html.escape(caption)}</figcaption></figure>'
        )
    for index in sorted(view.videos):
        parts.append(_video_html(index, view.videos[index], width))
    if view.audio_final is not None or view.audio_seconds:
        parts.append(_audio_html(view))
    if view.error is not None:
        parts.append(
            '<div style="flex-basis:100%;color:#b91c1c;font-family:monospace">'
            f"{html.escape(view.error.get('type', 'Error'))}: {html.escape(view.error.get('message', ''))}</div>"
        )
    if view.final is None:
        parts.append(f'<div style="flex-basis:100%;font-size:12px;opacity:.6">streaming… {view.t:.1f} s</div>')
    parts.append("</div>")
    return "".join(parts)


def _audio_html(view: LiveView) -> str:
    """Speech: a live line while it is made, then a player of the whole utterance (autoplay)."""
    final = view.audio_final
    if final is None:
        return (f'<div class="ms-audio" style="flex-basis:100%;font-size:12px;opacity:.7">speaking… '
                f"{view.audio_seconds:.1f} s of audio</div>")
    src = f"data:audio/wav;base64,{base64.b64encode(final.audio or b'').decode('ascii')}"
    return (f'<div class="ms-audio" style="flex-basis:100%"><audio controls autoplay src="{src}"></audio>'
            f'<div style="font-size:12px;opacity:.7">{html.escape(audio_summary(final))}</div></div>')


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (where rich display updates reach a front end)."""
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return False
    try:
        ip = ip_mod.get_ipython()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an odd IPython install must not break show()
        return False
    return ip is not None and getattr(ip, "kernel", None) is not None


def _check_args(stream: Any, max_fps: float, width: int) -> None:
    if not isinstance(stream, Stream) and not isinstance(stream, Iterable):
        raise InvalidArgumentError(
            f"show() needs a multistream Stream (e.g. llm.stream('hi')), got {type(stream).__name__}"
        )
    if not (isinstance(max_fps, (int, float)) and max_fps > 0):
        raise InvalidArgumentError(f"max_fps must be a number > 0 (updates per second), got {max_fps!r}; try 20")
    if not (isinstance(width, int) and width > 0):
        raise InvalidArgumentError(f"width must be a positive int (pixels), got {width!r}; try 256")


def show(stream: Stream | Iterable[Event], *, max_fps: float = 20.0, width: int = 256, file: TextIO | None = None) -> Event:
    """Render a stream live and return its final event.

    In Jupyter: one output area updated in place, at most ``max_fps`` times a second (the final
    event is always shown). Elsewhere: text is printed as it arrives to ``file`` (stdout by
    default), with a progress line for images and clips (step, estimated time left) and a
    summary line for each finished one. Interrupting (Ctrl-C / the stop button of the
    kernel) cancels the model.

    Example:
        >>> final = ms.show(sd.stream("a red circle on a blue background", steps=20))  # doctest: +SKIP
        >>> final.image                                                            # doctest: +SKIP
    """
    _check_args(stream, max_fps, width)
    view = LiveView()
    throttle = Throttle(max_fps)
    if _in_notebook() and file is None:
        from IPython.display import HTML, display

        handle = display(HTML(_render_html(view, width)), display_id=True)

        def render(final: bool) -> None:
            handle.update(HTML(_render_html(view, width)))  # type: ignore[union-attr]

    else:
        render = _PlainRenderer(view, file or sys.stdout)
    try:
        for ev in stream:
            view.apply(ev)
            now = time.monotonic()
            if ev.is_final or throttle.due(now):
                render(ev.is_final)
                throttle.mark(now)
    except BaseException:
        if isinstance(stream, Stream):
            stream.close()  # e.g. a KeyboardInterrupt from the kernel: stop the model too
        raise
    if view.final is None:
        raise InvalidArgumentError("show() got an iterable that ended without a final event; pass a multistream Stream")
    return view.final


class _PlainRenderer:
    """Prints what is new since the last call: text deltas as they come, a line per image."""

    def __init__(self, view: LiveView, out: TextIO) -> None:
        self.view = view
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.printed: list[str] = []  # text printed per text part (to see what a rewind cut)
        self.summarized_text: set[int] = set()
        self.summarized_images: set[int] = set()
        self.summarized_videos: set[int] = set()
        self.progress_shown = False

    def _clear_progress(self) -> None:
        if self.progress_shown:
            self.out.write("\r\x1b[K")
            self.progress_shown = False

    def __call__(self, final: bool) -> None:
        view, out = self.view, self.out
        for i in range(len(view.texts)):
            if i >= len(self.printed):
                self._clear_progress()
                if i:
                    out.write("\n")
                self.printed.append("")
            text = view.text(i)
            shown = self.printed[i]
            if text != shown:
                self._clear_progress()
                if text.startswith(shown):
                    out.write(text[len(shown) :])
                else:
                    # A rewind: a terminal cannot take text back, so say where the new text begins.
                    keep = 0
                    while keep < min(len(text), len(shown)) and text[keep] == shown[keep]:
                        keep += 1
                    out.write(f"\n[revision {view.revision}: from character {keep}]\n{text[keep:]}")
                self.printed[i] = text
            done = view.text_done[i]
            if done is not None and i not in self.summarized_text:
                self.summarized_text.add(i)
                out.write(f"\n[{_text_summary(done)}]\n")
        for index in sorted(view.images):
            frame = view.images[index]
            if frame.final and index not in self.summarized_images:
                self.summarized_images.add(index)
                self._clear_progress()
                out.write(f"[image {index}: {_image_summary(frame.ev)}]\n")
            elif not frame.final and self.tty:
                out.write(f"\r\x1b[K[image {index}: step {frame.ev.step}/{frame.ev.total_steps}, "
                          f"{eta_words(frame.ev.eta_s)}]")
                self.progress_shown = True
        for index in sorted(view.videos):
            frame = view.videos[index]
            if frame.final and index not in self.summarized_videos:
                self.summarized_videos.add(index)
                self._clear_progress()
                out.write(f"[video {index}: {_video_summary(frame.ev)}]\n")  # type: ignore[arg-type]
            elif not frame.final and self.tty:
                out.write(f"\r\x1b[K[video {index}: step {frame.ev.step}/{frame.ev.total_steps}, "
                          f"{eta_words(frame.ev.eta_s)}]")
                self.progress_shown = True
        if view.audio_final is not None and final:
            out.write(f"\n[audio: {audio_summary(view.audio_final)}]\n")
        if view.error is not None and final:
            self._clear_progress()
            out.write(f"\n[error {view.error.get('type')}: {view.error.get('message')}]\n")
        out.flush()
