"""The Prompt-to-picture tab: the LLM writes an image prompt live, then the image model draws it.

Both run as one composed stream (``ms.chain``): the text part streams into "The LLM writes", then
the preview box fills with the drawing of exactly that text.

Example:
    >>> from multistream.testing import ScriptedImageModel
    >>> draw = DrawWritten(ScriptedImageModel(), DEFAULT_IDEA, {"steps": 4})
    >>> draw.prompt is None                       # set once the LLM has written it
    True
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from ...compose import chain
from ...errors import MultistreamError
from ...events import Event
from ...stream import Stream
from ..view import throttled_views
from ._prompts import DEFAULT_IDEA, prompt_messages, shapes_prompt_pattern
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

__all__ = ["DrawWritten", "PictureTab"]

_WRITING = "the LLM is writing the prompt…"


class DrawWritten:
    """The second half of the chain: draw the text the LLM wrote (its final event), and remember it.

    In the shapes style the LLM is held to the image model's vocabulary, so its text is drawn as is.
    """

    def __init__(self, image_model: Any, idea: str, kwargs: dict[str, Any]) -> None:
        self.image_model = image_model
        self.idea = idea
        self.kwargs = kwargs
        self.prompt: str | None = None

    def __call__(self, final: Event) -> Stream:
        self.prompt = (getattr(final, "text", None) or "").strip() or self.idea
        stream: Stream = self.image_model.stream(self.prompt, **self.kwargs)
        return stream


class PictureTab:
    """The Prompt-to-picture tab's layout and handlers (needs both models).

    ``prompt_style`` is ``"shapes"`` (the LLM constrained to the embedded image model's
    vocabulary) or ``"free"``.

    Example:
        >>> with gr.Blocks():                                               # doctest: +SKIP
        ...     PictureTab(ModelSlot("text", llm), ModelSlot("image", sd), ActiveRuns(), 15, "shapes").build()
    """

    def __init__(self, text_model: ModelSlot, image_model: ModelSlot, runs: ActiveRuns, max_fps: float,
                 prompt_style: str) -> None:
        self.text_model = text_model
        self.image_model = image_model
        self.runs = runs
        self.max_fps = max_fps
        self.prompt_style = prompt_style

    # -- handlers ------------------------------------------------------------------------------

    async def run(self, idea: str, steps: float, seed: float, preview: str,
                  request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """"Write and draw": (written, prompt used, preview box, final image) updates."""
        llm = self.text_model.get()
        sd = self.image_model.get()
        idea = (idea or "").strip()
        if not idea:
            raise gr.Error(f"type an idea first, e.g. '{DEFAULT_IDEA}'")
        draw = DrawWritten(sd, idea, image_kwargs(steps, seed, preview, 1, 75, 256))
        constraint = {"allowed": shapes_prompt_pattern()} if self.prompt_style == "shapes" else {"stop": ["\n"]}
        try:
            first = llm.stream(prompt_messages(idea, self.prompt_style), max_new_tokens=32, temperature=0.0,
                               **constraint)
        except MultistreamError as exc:
            raise ui_error(exc) from exc
        stream = chain(first, draw)
        key = run_key(request, "picture")
        self.runs.start(key, stream)
        try:
            yield "", "", preview_html(None, "ms-picture-preview", _WRITING), None
            async for view in throttled_views(stream, self.max_fps):
                check_view(view)
                written = view.text(0) if view.texts else ""
                note = "" if view.images else (_WRITING if draw.prompt is None else "drawing…")
                box, final_img, _ = image_outputs(view, "ms-picture-preview", [], False, note)
                yield written, draw.prompt or "", box, final_img
        finally:
            self.runs.end(key, stream)

    def stop(self, request: gr.Request) -> None:
        """"Stop": cancel this session's run, whichever half is running."""
        self.runs.cancel(run_key(request, "picture"))

    # -- layout --------------------------------------------------------------------------------

    def build(self) -> None:
        """Lay the tab out and wire its events (inside a ``gr.Blocks`` context)."""
        with gr.Tab("Prompt to picture", id="picture"):
            if self.text_model.missing or self.image_model.missing:
                gr.Markdown(f"⚠️ This tab needs both models. {self.text_model.why} {self.image_model.why}")
            with gr.Row():
                with gr.Column(scale=1):
                    idea = gr.Textbox(value=DEFAULT_IDEA, label="Idea", elem_id="ms-picture-idea")
                    with gr.Row():
                        go = gr.Button("Write and draw", variant="primary", elem_id="ms-picture-go")
                        stop = gr.Button("Stop", variant="stop", elem_id="ms-picture-stop")
                    written = gr.Textbox(label="The LLM writes (streaming)", lines=2, interactive=False,
                                         elem_id="ms-picture-written")
                    used = gr.Textbox(label="Image prompt used", interactive=False, elem_id="ms-picture-used")
                    steps = gr.Slider(1, 100, value=20, step=1, label="Steps", elem_id="ms-picture-steps")
                    seed = gr.Number(value=0, precision=0, label="Seed (-1 = random)")
                    preview = gr.Radio(list(PREVIEW_MODES), value=default_preview(self.image_model), label="Preview")
                with gr.Column(scale=2):
                    with gr.Row():
                        live = gr.HTML(preview_html(None, "ms-picture-preview"), elem_id="ms-picture-preview")
                        final = gr.Image(label="Final image", type="pil", format="png", height=PREVIEW_SIDE_PX,
                                         elem_id="ms-picture-final", interactive=False)
            go.click(self.run, [idea, steps, seed, preview], [written, used, live, final],
                     api_name="prompt_to_picture", show_progress="hidden")
            stop.click(self.stop, None, None, api_name="stop_picture", queue=False)
