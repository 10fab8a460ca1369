"""The Video tab: every frame's current estimate plays live while the clip denoises, then the clip.

Each step's preview is one animated WebP of all frames (or a contact sheet), shown in the preview
box as a ``data:`` URL like the Image tab's frames, with the step, the estimated time left and,
on a busy server, the place in the queue. The finished clip goes to ``gr.Video`` (the clip is
written to a file of this tab's own folder: Gradio serves files). "Use this" keeps the clip as it
is now (``finish_early``); "Apply now" conditions the remaining steps on the edited prompt
(``steer(prompt=...)``). "Write and film" lets the LLM turn an idea into the prompt (streamed into
the prompt box), then films exactly that: one composed stream (``ms.chain``).

Example:
    >>> from multistream.testing import ScriptedVideoModel
    >>> tab = VideoTab(ModelSlot("video", ScriptedVideoModel()), ModelSlot("text", None), ActiveRuns(), 15, "shapes")
    >>> tab.stop(None)                 # nothing running: nothing to stop
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from ...compose import chain
from ...errors import MultistreamError
from ...events import VideoEvent
from ..view import LiveView, ending_words, eta_words, throttled_views
from ._picture import DrawWritten
from ._prompts import DEFAULT_VIDEO_IDEA, shapes_video_pattern, video_prompt_messages
from ._shared import PREVIEW_MODES, PREVIEW_SIDE_PX, ActiveRuns, ModelSlot, check_view, progress_box, run_key, ui_error

__all__ = ["VideoTab", "clip_box", "video_kwargs"]

_ELEM = "ms-video-preview"
_WRITING = "the LLM is writing the prompt…"
_EXTENSIONS = {"video/webm": ".webm", "video/mp4": ".mp4"}


def video_kwargs(steps: float, frames: float, seed: float | None, preview: str, preview_format: str) -> dict[str, Any]:
    """The video model's ``stream()`` options from the page's controls (numbers come as floats).

    Example:
        >>> video_kwargs(20, 16, -1, "tiny", "webp")["seed"] is None    # -1: a random seed
        True
    """
    if preview not in PREVIEW_MODES:
        raise gr.Error(f"preview must be one of {list(PREVIEW_MODES)}, got {preview!r}")
    if preview_format not in ("webp", "sheet"):
        raise gr.Error(f"preview format must be 'webp' or 'sheet', got {preview_format!r}")
    return {
        "steps": int(steps),
        "num_frames": int(frames),
        "seed": None if seed is None or int(seed) < 0 else int(seed),
        "preview": preview,
        "preview_format": preview_format,
        "preview_max_side": PREVIEW_SIDE_PX,
    }


def clip_box(view: LiveView | None, last_preview: VideoEvent | None, note: str = "") -> str:
    """The preview box of a clip: the newest preview of every frame (it plays: an animated WebP),
    a progress bar and a line with the step and the time left; once the clip is done, its summary.

    Example:
        >>> 'id="ms-video-preview-box"' in clip_box(None, None)
        True
    """
    frame = view.videos.get(0) if view is not None else None
    if frame is None:
        queued = view.queue_note() if view is not None else ""  # on a busy server: its place in the queue
        return progress_box(_ELEM, None, 0.0, queued or note or "waiting", queued or note or "the clip appears here")
    ev = frame.ev
    pct = 100.0 * ev.step / ev.total_steps if ev.total_steps else 100.0
    if frame.final:
        secs = ((ev.metrics or {}).get("duration_ms") or ev.t * 1000) / 1000
        line = (f"{ending_words(ev.finish_reason)} · {ev.step}/{ev.total_steps} steps in {secs:.2f} s · {ev.num_frames} frames "  # type: ignore[union-attr]
                f"{ev.width}x{ev.height} at {ev.fps:g} fps · {ev.mime.split('/')[-1].upper()} "  # type: ignore[union-attr]
                f"({len(ev.data) / 1024:.1f} KB)")
    else:
        line = (f"step {ev.step}/{ev.total_steps} · {eta_words(ev.eta_s)} · {ev.t:.2f} s · "
                f"{ev.num_frames} frames {ev.width}x{ev.height} ({len(ev.data) / 1024:.1f} KB)")  # type: ignore[union-attr]
    if note:
        line = f"{note} · {line}"
    # The box keeps playing the last preview once the clip is done (the clip itself is in gr.Video).
    return progress_box(_ELEM, last_preview, pct, line)


class VideoTab:
    """The Video tab's layout and handlers; each browser session has its own run.

    ``prompt_style`` is how "Write and film" asks the LLM: ``"shapes"`` (held to the embedded
    video model's vocabulary) or ``"free"``.

    Example:
        >>> with gr.Blocks():                                               # doctest: +SKIP
        ...     VideoTab(ModelSlot("video", vm), ModelSlot("text", llm), ActiveRuns(), 15, "shapes").build()
    """

    def __init__(self, model: ModelSlot, text_model: ModelSlot, runs: ActiveRuns, max_fps: float,
                 prompt_style: str) -> None:
        self.model = model
        self.text_model = text_model
        self.runs = runs
        self.max_fps = max_fps
        self.prompt_style = prompt_style
        # The finished clips, for gr.Video (which serves files); removed with the tab.
        self._clips = tempfile.TemporaryDirectory(prefix="multistream-clips-")

    def _clip_file(self, ev: VideoEvent) -> str:
        fd, path = tempfile.mkstemp(suffix=_EXTENSIONS.get(ev.mime, ".bin"), dir=self._clips.name)
        with os.fdopen(fd, "wb") as fh:
            fh.write(ev.data)
        return path

    async def _follow(self, stream: Any, note: Any) -> AsyncIterator[tuple[LiveView, str, str | None]]:
        """(view, preview box, clip file once done) per page update of a running clip."""
        last_preview: VideoEvent | None = None
        async for view in throttled_views(stream, self.max_fps):
            check_view(view)
            frame = view.videos.get(0)
            clip = None
            if frame is not None and (not frame.final or not frame.ev.mime.startswith("video/")):
                # A preview, or the final of a cancelled clip: its newest preview (the model made no clip).
                last_preview = frame.ev  # type: ignore[assignment]
            elif frame is not None:
                clip = self._clip_file(frame.ev)  # type: ignore[arg-type]
            yield view, clip_box(view, last_preview, note()), clip

    # -- handlers ------------------------------------------------------------------------------

    async def generate(self, prompt: str, steps: float, frames: float, seed: float, preview: str, preview_format: str,
                       request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """"Generate": (preview box, final clip) updates while it films."""
        model = self.model.get()
        if not (prompt or "").strip():
            raise gr.Error("type a prompt first, e.g. 'a red circle moving right on a blue background'")
        try:
            stream = model.stream(prompt.strip(), **video_kwargs(steps, frames, seed, preview, preview_format))
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        key = run_key(request, "video")
        self.runs.start(key, stream)
        try:
            yield clip_box(None, None, "starting…"), None
            async for _, box, clip in self._follow(stream, lambda: ""):
                yield box, clip
        finally:
            self.runs.end(key, stream)

    async def write_and_film(self, idea: str, steps: float, frames: float, seed: float, preview: str,
                             preview_format: str, request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """"Write and film": (prompt box, preview box, final clip) updates: the LLM's prompt grows
        live in the prompt box, then the video model films exactly that text."""
        llm = self.text_model.get()
        vm = self.model.get()
        idea = (idea or "").strip()
        if not idea:
            raise gr.Error(f"type an idea first, e.g. '{DEFAULT_VIDEO_IDEA}'")
        film = DrawWritten(vm, idea, video_kwargs(steps, frames, seed, preview, preview_format))
        constraint = {"allowed": shapes_video_pattern()} if self.prompt_style == "shapes" else {"stop": ["\n"]}
        try:
            first = llm.stream(video_prompt_messages(idea, self.prompt_style), max_new_tokens=40, temperature=0.0,
                               **constraint)
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        stream = chain(first, film)
        key = run_key(request, "video")
        self.runs.start(key, stream)
        try:
            yield "", clip_box(None, None, _WRITING), None
            async for view, box, clip in self._follow(stream, lambda: "" if film.prompt else _WRITING):
                written = film.prompt or (view.text(0) if view.texts else "")
                yield written, box, clip
        finally:
            self.runs.end(key, stream)

    def stop(self, request: gr.Request) -> None:
        """"Stop": cancel this session's clip (the model stops within one step)."""
        self.runs.cancel(run_key(request, "video"))

    def finish(self, request: gr.Request) -> None:
        """"Use this": stop denoising now and keep the clip as it is, at full quality."""
        stream = self.runs.get(run_key(request, "video"))
        if stream is not None:
            stream.finish_early()

    def apply(self, prompt: str, request: gr.Request) -> None:
        """"Apply now": the edited prompt conditions the remaining steps of the running clip."""
        prompt = (prompt or "").strip()
        if not prompt:
            raise gr.Error("type the new prompt first, e.g. 'a red circle moving left on a blue background'")
        stream = self.runs.get(run_key(request, "video"))
        if stream is None:
            raise gr.Error("nothing is being filmed; 'Apply now' changes a running clip (press Generate)")
        try:
            stream.steer(prompt=prompt)
        except MultistreamError as exc:
            raise ui_error(exc) from exc

    # -- layout --------------------------------------------------------------------------------

    def build(self) -> None:
        """Lay the tab out and wire its events (inside a ``gr.Blocks`` context)."""
        frames_default = int(getattr(self.model.model, "default_num_frames", 16) or 16)
        # A causal video VAE makes 1 + t*k frames: the slider offers only those counts.
        frames_step = int(getattr(getattr(self.model.model, "layout", None), "temporal", 1) or 1)
        with gr.Tab("Video", id="video"):
            if self.model.missing:
                gr.Markdown(f"⚠️ No video model: {self.model.why}")
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(value="a red circle moving right on a blue background", label="Prompt",
                                        elem_id="ms-video-prompt")
                    with gr.Row():
                        go = gr.Button("Generate", variant="primary", elem_id="ms-video-go")
                        stop = gr.Button("Stop", variant="stop", elem_id="ms-video-stop")
                        finish = gr.Button("Use this", elem_id="ms-video-finish")
                        apply = gr.Button("Apply now", elem_id="ms-video-apply")
                    steps = gr.Slider(1, 100, value=20, step=1, label="Steps", elem_id="ms-video-steps")
                    frames = gr.Slider(1, 1 + (64 - 1) // frames_step * frames_step, value=frames_default,
                                       step=frames_step, label="Frames", elem_id="ms-video-frames")
                    seed = gr.Number(value=0, precision=0, label="Seed (-1 = random)")
                    # "tiny", the library's default, is instant on the embedded model (it ships its
                    # decoder); another model's first tiny run fits one to its VAE (once, cached).
                    preview = gr.Radio(list(PREVIEW_MODES), value="tiny",
                                       label="Preview (tiny: a decoder fitted to the VAE; x0: a linear map, free)")
                    preview_format = gr.Radio([("animated (WebP)", "webp"), ("contact sheet (JPEG)", "sheet")],
                                              value="webp", label="Preview of every frame as")
                    with gr.Accordion("Let the LLM write the prompt", open=False):
                        if self.text_model.missing:
                            gr.Markdown(f"⚠️ This needs the text model. {self.text_model.why}")
                        idea = gr.Textbox(value=DEFAULT_VIDEO_IDEA, label="Idea", elem_id="ms-video-idea")
                        write = gr.Button("Write and film", elem_id="ms-video-write")
                with gr.Column(scale=2):
                    with gr.Row():
                        live = gr.HTML(clip_box(None, None), label="Every frame, live", elem_id=_ELEM)
                        final = gr.Video(label="Final clip", autoplay=True, loop=True, interactive=False,
                                         height=PREVIEW_SIDE_PX, elem_id="ms-video-final")
            inputs = [prompt, steps, frames, seed, preview, preview_format]
            go.click(self.generate, inputs, [live, final], api_name="video", show_progress="hidden")
            prompt.submit(self.generate, inputs, [live, final], api_name=False, show_progress="hidden")
            write.click(self.write_and_film, [idea, steps, frames, seed, preview, preview_format],
                        [prompt, live, final], api_name="write_and_film", show_progress="hidden")
            stop.click(self.stop, None, None, api_name="stop_video", queue=False)
            finish.click(self.finish, None, None, api_name="finish_video", queue=False)
            apply.click(self.apply, [prompt], None, api_name="steer_video", queue=False)
