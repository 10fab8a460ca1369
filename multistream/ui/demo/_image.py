"""The Image tab: denoising previews replace each other live, then the full-quality picture.

"Use this" keeps the current picture (``finish_early``); "Apply now" conditions the remaining
steps on the edited prompt (``steer(prompt=...)``). Preview frames travel as ``data:`` URLs inside
the update; only the final image goes through ``gr.Image``.

Example:
    >>> from multistream.testing import ScriptedImageModel
    >>> tab = ImageTab(ModelSlot("image", ScriptedImageModel()), ActiveRuns(), max_fps=15)
    >>> tab.stop(None)                 # nothing running: nothing to stop
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from ...errors import MultistreamError
from ..view import throttled_views
from ._shared import (
    PREVIEW_MODES,
    PREVIEW_SIDE_PX,
    ActiveRuns,
    ModelSlot,
    check_view,
    default_preview,
    image_kwargs,
    image_outputs,
    preview_html,
    run_key,
    ui_error,
)

__all__ = ["ImageTab"]


class ImageTab:
    """The Image tab's layout and handlers; each browser session has its own run.

    Example:
        >>> with gr.Blocks():                                               # doctest: +SKIP
        ...     ImageTab(ModelSlot("image", sd), ActiveRuns(), max_fps=15).build()
    """

    def __init__(self, model: ModelSlot, runs: ActiveRuns, max_fps: float) -> None:
        self.model = model
        self.runs = runs
        self.max_fps = max_fps

    # -- handlers ------------------------------------------------------------------------------

    async def generate(self, prompt: str, steps: float, seed: float, preview: str, every: float, quality: float,
                       side: float, strip: bool, request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """"Generate": (preview box, final image, strip of frames) updates while it draws."""
        model = self.model.get()
        if not (prompt or "").strip():
            raise gr.Error("type a prompt first, e.g. 'a red circle on a blue background'")
        try:
            stream = model.stream(prompt.strip(), **image_kwargs(steps, seed, preview, every, quality, side))
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        key = run_key(request, "image")
        self.runs.start(key, stream)
        frames: list[str] = []
        try:
            yield preview_html(None, "ms-image-preview", "starting…"), None, ""
            async for view in throttled_views(stream, self.max_fps):
                check_view(view)
                yield image_outputs(view, "ms-image-preview", frames, bool(strip))
        finally:
            self.runs.end(key, stream)

    def stop(self, request: gr.Request) -> None:
        """"Stop": cancel this session's picture (the model stops within one step)."""
        self.runs.cancel(run_key(request, "image"))

    def finish(self, request: gr.Request) -> None:
        """"Use this": stop denoising now and keep the current picture at full quality."""
        stream = self.runs.get(run_key(request, "image"))
        if stream is not None:
            stream.finish_early()

    def apply(self, prompt: str, request: gr.Request) -> None:
        """"Apply now": the edited prompt conditions the remaining steps of the running image."""
        prompt = (prompt or "").strip()
        if not prompt:
            raise gr.Error("type the new prompt first, e.g. 'a red circle on a yellow background'")
        stream = self.runs.get(run_key(request, "image"))
        if stream is None:
            raise gr.Error("nothing is being drawn; 'Apply now' changes a running image (press Generate)")
        try:
            stream.steer(prompt=prompt)
        except MultistreamError as exc:
            raise ui_error(exc) from exc

    # -- layout --------------------------------------------------------------------------------

    def build(self) -> None:
        """Lay the tab out and wire its events (inside a ``gr.Blocks`` context)."""
        with gr.Tab("Image", id="image"):
            if self.model.missing:
                gr.Markdown(f"⚠️ No image model: {self.model.why}")
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(value="a red circle on a blue background", label="Prompt", elem_id="ms-image-prompt")
                    with gr.Row():
                        go = gr.Button("Generate", variant="primary", elem_id="ms-image-go")
                        stop = gr.Button("Stop", variant="stop", elem_id="ms-image-stop")
                        finish = gr.Button("Use this", elem_id="ms-image-finish")
                        apply = gr.Button("Apply now", elem_id="ms-image-apply")
                    steps = gr.Slider(1, 100, value=20, step=1, label="Steps", elem_id="ms-image-steps")
                    seed = gr.Number(value=0, precision=0, label="Seed (-1 = random)")
                    preview = gr.Radio(list(PREVIEW_MODES), value=default_preview(self.model), label="Preview")
                    every = gr.Slider(1, 10, value=1, step=1, label="Preview every N steps")
                    with gr.Accordion("Preview frames", open=False):
                        quality = gr.Slider(10, 95, value=75, step=5, label="JPEG quality")
                        side = gr.Slider(64, 512, value=256, step=32, label="Preview max side (px)")
                        strip = gr.Checkbox(value=True, label="Show the strip of frames")
                with gr.Column(scale=2):
                    with gr.Row():
                        live = gr.HTML(preview_html(None, "ms-image-preview"), label="Live preview", elem_id="ms-image-preview")
                        final = gr.Image(label="Final image (full quality)", type="pil", format="png",
                                         height=PREVIEW_SIDE_PX, elem_id="ms-image-final", interactive=False)
                    frames_strip = gr.HTML("", label="Frames so far", elem_id="ms-image-strip")
            inputs = [prompt, steps, seed, preview, every, quality, side, strip]
            outputs = [live, final, frames_strip]
            go.click(self.generate, inputs, outputs, api_name="image", show_progress="hidden")
            prompt.submit(self.generate, inputs, outputs, api_name=False, show_progress="hidden")
            stop.click(self.stop, None, None, api_name="stop_image", queue=False)
            finish.click(self.finish, None, None, api_name="finish_image", queue=False)
            # Edit the prompt while it draws, then Apply now: the remaining steps follow the new one.
            apply.click(self.apply, [prompt], None, api_name="steer_image", queue=False)
