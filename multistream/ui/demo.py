"""The Gradio demo: chat, image previews and prompt-to-picture, all streaming live.

``create_demo()`` builds the page (it is what ``multistream demo``, ``python demos/app.py`` and
``multistream serve`` at ``/demo`` run). Every tab reads one multistream `Stream` and pushes
updates to the browser at most ``max_fps`` times a second; between two pushes newer events are
folded in, so a slow page gets the newest frame, never a backlog, and always the final one.

Edits while a run streams: Chat's "Steer" sends the typed text as a new instruction
(``stream.steer``) and "Regenerate from here" rewinds the answer to where the selected words
begin, or to a character offset (``rewind``, or ``llm.revise`` once it ended); Image's "Use this" keeps the current picture (``finish_early``)
and "Apply now" conditions the remaining steps on the edited prompt (``steer(prompt=...)``).

Preview frames travel as ``data:`` URLs inside the update (no file per frame in Gradio's cache,
no extra request per frame); only the final full-quality image goes through ``gr.Image``.

Example:
    >>> from multistream.ui.demo import create_demo
    >>> demo = create_demo()            # loads the embedded default models   # doctest: +SKIP
    >>> demo.launch()                                                          # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..compose import chain
from ..errors import InvalidArgumentError, MultistreamError
from ..events import ImageEvent, TextEvent
from ..stream import Stream
from .view import LiveView, throttled_views

if TYPE_CHECKING:
    import gradio as gr

__all__ = ["create_demo", "launch", "mount_demo", "prompt_messages", "shapes_prompt_pattern", "throttled_views"]

logger = logging.getLogger("multistream.ui.demo")


def _gradio() -> Any:
    """Import gradio on first use (so the prompt helpers here work without it) and bind ``gr``.

    The module-level name matters: Gradio resolves the string annotations of the handlers
    (``request: gr.Request``) in this module's globals to know which argument gets the request.
    """
    global gr
    # The demo must never phone home (offline machines, privacy); set before gradio is imported.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio

    gr = gradio  # noqa: F811
    return gradio

PREVIEW_MODES = ("tiny", "latent", "x0", "vae", "none")
_PREVIEW_SIDE_PX = 320  # how large the preview box is drawn on the page
_STRIP_MAX = 40  # frames kept in the strip; later ones are skipped so the page stays light

# -- prompt to picture -----------------------------------------------------------------------------

_SHAPES_SYSTEM = (
    "You turn an idea into a picture description for a tiny image model. It can only draw ONE shape "
    "on a plain background. Shapes: circle, square, triangle, star. Colors: red, green, blue, yellow, "
    "orange, purple, white, black. Reply with one line only, exactly in the form: "
    "a <color> <shape> on a <color> background"
)
_SHAPES_FEW_SHOT = (
    ("the sun at night", "a yellow circle on a black background"),
    ("a pine tree in the snow", "a green triangle on a white background"),
    ("a starfish in the sea", "an orange star on a blue background"),
    ("a plum on the grass", "a purple circle on a green background"),
    ("a box of tomatoes", "a red square on a yellow background"),
)
_FREE_SYSTEM = (
    "You write short, vivid prompts for a text-to-image model. Reply with one line of at most 20 words, "
    "no quotes."
)


def shapes_prompt_pattern() -> str:
    """The embedded image model's whole vocabulary as a regular expression, for ``allowed=``.

    The LLM's decoding is held to it, so what the LLM writes is exactly what gets drawn.

    Example:
        >>> import re
        >>> bool(re.fullmatch(shapes_prompt_pattern(), "a small yellow circle on a blue background"))
        True
    """
    from .._shapes import COLORS, SHAPES, SIZES

    colors, shapes, sizes = "|".join(COLORS), "|".join(SHAPES), "|".join(SIZES)
    return rf"an? (({sizes}) )?({colors}) ({shapes}) on an? ({colors}) background"


def prompt_messages(idea: str, style: str) -> list[dict[str, str]]:
    if style == "free":
        return [{"role": "system", "content": _FREE_SYSTEM}, {"role": "user", "content": idea}]
    messages = [{"role": "system", "content": _SHAPES_SYSTEM}]
    for user, assistant in _SHAPES_FEW_SHOT:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": idea})
    return messages


# -- streaming to the page -------------------------------------------------------------------------


class _ActiveRuns:
    """The stream each browser session is running per tab, so its Stop button can cancel it.

    Gradio's ``cancels=`` would only stop the Python generator; cancelling the Stream stops the
    model thread within one step, and the run then ends normally showing "cancelled".
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], Stream] = {}

    def start(self, key: tuple[str, str], stream: Stream) -> None:
        with self._lock:
            old = self._runs.get(key)
            self._runs[key] = stream
        if old is not None:  # one run per session and tab: a new one replaces the old
            old.cancel()

    def end(self, key: tuple[str, str], stream: Stream) -> None:
        with self._lock:
            if self._runs.get(key) is stream:
                del self._runs[key]

    def get(self, key: tuple[str, str]) -> Stream | None:
        with self._lock:
            return self._runs.get(key)

    def cancel(self, key: tuple[str, str]) -> bool:
        with self._lock:
            stream = self._runs.get(key)
        if stream is None:
            return False
        stream.cancel()
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)


def _session(request: gr.Request | None) -> str:
    return (getattr(request, "session_hash", None) or "anonymous") if request is not None else "anonymous"


def _data_url(ev: ImageEvent) -> str:
    return f"data:{ev.mime};base64,{base64.b64encode(ev.data).decode('ascii')}"


def _preview_html(view: LiveView | None, elem: str, note: str = "") -> str:
    """The live preview box: the newest frame (or the final image), a progress bar and a step line."""
    side = _PREVIEW_SIDE_PX
    frame = view.images.get(0) if view is not None else None
    box = (
        f"width:{side}px;height:{side}px;border-radius:10px;background:#e5e7eb;display:flex;"
        "align-items:center;justify-content:center;overflow:hidden;color:#6b7280;font-size:14px"
    )
    if frame is None:
        inner = html.escape(note or "the preview appears here")
        pct, line = 0.0, note and "" or "waiting"
        body = f'<div style="{box}">{inner}</div>'
    else:
        ev = frame.ev
        body = (
            f'<div style="{box}"><img class="ms-frame" alt="step {ev.step}" src="{_data_url(ev)}" '
            f'style="width:{side}px;height:{side}px;object-fit:contain"/></div>'
        )
        pct = 100.0 * ev.step / ev.total_steps if ev.total_steps else 100.0
        if frame.final:
            kb = len(ev.data) / 1024
            secs = ((ev.metrics or {}).get("duration_ms") or ev.t * 1000) / 1000
            line = f"{ev.finish_reason} · {ev.step}/{ev.total_steps} steps in {secs:.2f} s · final {ev.width}x{ev.height} {ev.mime.split('/')[-1].upper()} ({kb:.1f} KB)"
        else:
            kb = len(ev.data) / 1024
            line = f"step {ev.step}/{ev.total_steps} · {ev.t:.2f} s · preview {ev.width}x{ev.height} ({kb:.1f} KB)"
        if note:
            line = f"{note} · {line}"
    return (
        f'<div id="{elem}-box" style="display:flex;flex-direction:column;gap:6px;width:{side}px">{body}'
        f'<div style="height:4px;border-radius:2px;background:rgba(127,127,127,.25)">'
        f'<div style="height:4px;border-radius:2px;width:{pct:.0f}%;background:#f97316"></div></div>'
        f'<div class="ms-step" style="font-size:13px;font-variant-numeric:tabular-nums">{html.escape(line)}</div></div>'
    )


_SELECTION_JS = """() => {
  document.addEventListener("mouseup", () => {
    const sel = window.getSelection();
    const chat = document.getElementById("ms-chatbot");
    const box = document.querySelector("#ms-chat-selection textarea");
    if (!sel || sel.isCollapsed || !chat || !box || !chat.contains(sel.anchorNode)) return;
    box.value = sel.toString();
    box.dispatchEvent(new Event("input", { bubbles: true }));
  });
}"""


def _chat_stats(view: LiveView) -> str:
    line = _chat_line(view)
    return f"{line} · revision {view.revision}" if view.revision and view.error is None else line


def _chat_line(view: LiveView) -> str:
    final = view.final
    if isinstance(final, TextEvent) and final.metrics is not None:
        m, u = final.metrics, final.usage or {}
        ttft = m.get("ttft_ms")
        tps = m.get("tokens_per_s")
        return (
            f"**{final.finish_reason}** · TTFT {ttft:.0f} ms · {tps:.1f} tokens/s · "
            f"{u.get('completion_tokens', view.text_tokens)} tokens in {(m.get('duration_ms') or 0) / 1000:.2f} s"
            if ttft is not None and tps is not None
            else f"**{final.finish_reason}** · {u.get('completion_tokens', view.text_tokens)} tokens"
        )
    if view.error is not None:
        return f"**error** · {view.error.get('type')}: {view.error.get('message')}"
    if view.first_text_t is None:
        return f"waiting for the first token… {view.t:.2f} s"
    # Decode speed after the first token: the prefill is already counted in the TTFT.
    decode_s = view.t - view.first_text_t
    rate = f"{(view.text_tokens - 1) / decode_s:.1f}" if view.text_tokens > 1 and decode_s > 0 else "–"
    return f"streaming · TTFT {view.first_text_t * 1000:.0f} ms · {rate} tokens/s · {view.text_tokens} tokens"


def _content_text(content: Any) -> str:
    """A chat message's text, whatever shape Gradio hands it in (str, dict, list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or content.get("content") or "")
    if isinstance(content, (list, tuple)):
        return "".join(_content_text(c) for c in content)
    return ""


def _gr_error(exc: BaseException) -> gr.Error:
    return _gradio().Error(str(exc) or type(exc).__name__)


def _load_default(kind: str) -> tuple[Any, str]:
    """Load an embedded default model; on failure return (None, why), so the rest of the page works."""
    try:
        if kind == "text":
            from ..text import load_text_model

            return load_text_model(), ""
        from ..image import load_image_model  # type: ignore[import-not-found]

        return load_image_model(), ""
    except (ImportError, MultistreamError, OSError, RuntimeError) as exc:
        logger.warning("demo: no default %s model: %s", kind, exc)
        return None, f"{type(exc).__name__}: {exc}"


_PAGE_STYLE = (
    "<style>#ms-image-final img, #ms-picture-final img {width:100%;height:100%;object-fit:contain}"
    "#ms-style {display:none}</style>"
)

# -- the page --------------------------------------------------------------------------------------


def create_demo(
    text_model: Any = None,
    image_model: Any = None,
    *,
    max_fps: float = 15.0,
    concurrency_limit: int = 4,
    prompt_style: str = "auto",
    title: str = "multistream",
) -> gr.Blocks:
    """Build the demo page: Chat, Image and Prompt-to-picture tabs, each streaming live.

    ``text_model`` / ``image_model`` default to the embedded models (loaded now; a model that
    cannot load leaves its tabs showing why). Either may also be a zero-argument callable that
    returns the model when a request comes (for a server that loads models in the background). ``max_fps`` caps the updates per second sent to
    each page; ``concurrency_limit`` is how many generations run at once (more users wait in
    Gradio's queue). ``prompt_style`` is ``"shapes"`` (constrain the LLM to the embedded image
    model's vocabulary), ``"free"``, or ``"auto"`` (shapes when the image model is the default).

    Example:
        >>> from multistream.testing import ScriptedTextModel, ScriptedImageModel
        >>> demo = create_demo(ScriptedTextModel(), ScriptedImageModel())
        >>> demo.launch(prevent_thread_lock=True)                       # doctest: +SKIP
    """
    gr = _gradio()
    if not (isinstance(max_fps, (int, float)) and not isinstance(max_fps, bool) and max_fps > 0):
        raise InvalidArgumentError(f"max_fps must be a number > 0 (page updates per second), got {max_fps!r}; try 15")
    if not (isinstance(concurrency_limit, int) and not isinstance(concurrency_limit, bool) and concurrency_limit >= 1):
        raise InvalidArgumentError(f"concurrency_limit must be an int >= 1, got {concurrency_limit!r}; try 4")
    if prompt_style not in ("auto", "shapes", "free"):
        raise InvalidArgumentError(f"prompt_style must be 'auto', 'shapes' or 'free', got {prompt_style!r}")
    default_image = image_model is None
    text_why = image_why = ""
    if text_model is None:
        text_model, text_why = _load_default("text")
    if image_model is None:
        image_model, image_why = _load_default("image")
    if prompt_style == "auto":
        name = str(getattr(image_model, "name", "") or "")
        prompt_style = "shapes" if default_image or "shapes" in name.lower() else "free"
    runs = _ActiveRuns()
    answers: dict[tuple[str, str], TextEvent] = {}  # each session's last finished chat answer
    live_text: dict[tuple[str, str], str] = {}  # each session's answer as it streams (after edits)

    def need(model: Any, kind: str, why: str) -> Any:
        if model is not None and not hasattr(model, "stream") and callable(model):
            try:  # a provider (e.g. the server's model slot, loaded in the background)
                model = model()
            except Exception as exc:  # noqa: BLE001 - shown on the page rather than crashing it
                raise gr.Error(f"the {kind} model is not ready: {exc}") from exc
        if model is None:
            raise gr.Error(f"no {kind} model is loaded ({why or 'none given'}); start the demo with --{kind}-model PATH")
        return model

    # -- chat ----------------------------------------------------------------------------------

    async def chat(message: str, history: list[dict[str, Any]], max_tokens: float, temperature: float,
                   top_p: float, seed: float, request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        model = need(text_model, "text", text_why)
        message = (message or "").strip()
        if not message:
            raise gr.Error("type a message first")
        turns = [{"role": m["role"], "content": _content_text(m.get("content"))} for m in (history or [])]
        turns = [t for t in turns if t["role"] in ("user", "assistant", "system") and t["content"]]
        prompt = [*turns, {"role": "user", "content": message}]
        try:
            stream = model.stream(
                prompt,
                max_new_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                seed=None if seed is None or int(seed) < 0 else int(seed),
            )
        except MultistreamError as exc:
            raise _gr_error(exc) from exc
        key = (_session(request), "chat")
        shown = [*turns, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        async for out in _stream_answer(key, stream, shown, None, "waiting for the first token…"):
            yield out

    async def _stream_answer(key: tuple[str, str], stream: Stream, shown: list[dict[str, Any]], view: LiveView | None,
                             first_note: str) -> AsyncIterator[tuple[Any, ...]]:
        runs.start(key, stream)
        answers.pop(key, None)
        try:
            yield shown, "", first_note
            async for view in throttled_views(stream, max_fps, view):
                shown[-1] = {"role": "assistant", "content": view.text(0) if view.texts else ""}
                live_text[key] = shown[-1]["content"]
                if view.error is not None:
                    shown[-1]["content"] += f"\n\n⚠️ {view.error.get('message')}"
                elif isinstance(view.final, TextEvent):
                    answers[key] = view.final  # "Regenerate from here" revises it once it ended
                # The box was cleared once above; now it is left alone, so the user can type an
                # instruction for "Steer" while the answer streams.
                yield shown, gr.skip(), _chat_stats(view)
        finally:
            runs.end(key, stream)
            live_text.pop(key, None)

    def stop_chat(request: gr.Request) -> None:
        runs.cancel((_session(request), "chat"))

    def steer_chat(instruction: str, request: gr.Request) -> str:
        """"Steer": the typed text becomes a new instruction for the answer being written."""
        instruction = (instruction or "").strip()
        if not instruction:
            raise gr.Error("type how the answer should change (e.g. 'make it shorter'), then press Steer")
        stream = runs.get((_session(request), "chat"))
        if stream is None:
            raise gr.Error("no answer is being written; Steer changes an answer while it streams (use Send)")
        try:
            stream.steer(instruction)
        except MultistreamError as exc:
            raise _gr_error(exc) from exc
        return ""

    async def regenerate_chat(offset: float, selection: str, instruction: str, history: list[dict[str, Any]],
                              request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        """"Regenerate from here": rewind the streaming answer to where the selected text begins
        (or to ``offset`` characters when nothing is selected), or revise the finished answer from
        there (``llm.revise``), optionally under the typed instruction."""
        key = (_session(request), "chat")
        instruction = (instruction or "").strip() or None
        stream = runs.get(key)
        final = answers.get(key)
        if selection and selection.strip():
            text = live_text.get(key, "") if stream is not None else (final.text or "" if final is not None else "")
            at = text.find(selection)
            if at < 0:
                at = text.find(selection.strip())
            if at < 0:
                raise gr.Error("the selected text is not in the answer (any more); select it again, "
                               "or clear the selection and set 'From character'")
        elif offset is None or int(offset) < 0:
            raise gr.Error("select text in the answer, or set 'From character' (0 = the start)")
        else:
            at = int(offset)
        if stream is not None:
            try:
                stream.rewind(at, instruction=instruction)
            except MultistreamError as exc:
                raise _gr_error(exc) from exc
            yield gr.skip(), "", gr.skip(), ""  # the running chat handler shows the new text
            return
        if final is None or not history:
            raise gr.Error("no answer to regenerate yet; Send a message first")
        model = need(text_model, "text", text_why)
        revise = getattr(model, "revise", None)
        if revise is None:
            raise gr.Error(f"{type(model).__name__} cannot revise a finished answer")
        try:
            stream = revise(final, at, instruction=instruction)
        except MultistreamError as exc:
            raise _gr_error(exc) from exc
        shown = [{"role": m["role"], "content": _content_text(m.get("content"))} for m in history]
        kept = (final.text or "")[:at]
        shown[-1] = {"role": "assistant", "content": kept}
        seeded = LiveView()
        seeded.apply(TextEvent(stream_id=stream.stream_id, seq=0, t=0.0, delta=kept, token_ids=[], index=0))
        seeded.events, seeded.first_text_t = 0, None
        async for out in _stream_answer(key, stream, shown, seeded, f"regenerating from character {at}…"):
            yield (*out, "")

    # -- image ---------------------------------------------------------------------------------

    def image_kwargs(steps: float, seed: float, preview: str, every: float, quality: float, side: float) -> dict[str, Any]:
        if preview not in PREVIEW_MODES:
            raise gr.Error(f"preview must be one of {list(PREVIEW_MODES)}, got {preview!r}")
        return {
            "steps": int(steps),
            "seed": None if seed is None or int(seed) < 0 else int(seed),
            "preview": preview,
            "preview_every": int(every),
            "preview_format": "jpeg",
            "preview_quality": int(quality),
            "preview_max_side": int(side),
        }

    def strip_html(frames: list[str]) -> str:
        # Only ever appended to, so Gradio's streaming diff sends just the new <img> each update.
        return "".join(frames)

    def image_outputs(view: LiveView, elem: str, frames: list[str], keep_strip: bool, note: str = "") -> tuple[Any, ...]:
        frame = view.images.get(0)
        final_img = frame.ev.image if frame is not None and frame.final else None
        if keep_strip and frame is not None and not frame.final and len(frames) < _STRIP_MAX:
            frames.append(
                f'<img src="{_data_url(frame.ev)}" title="step {frame.ev.step}" '
                'style="display:inline-block;width:64px;height:64px;object-fit:cover;margin:2px;border-radius:4px"/>'
            )
        return _preview_html(view, elem, note), final_img, strip_html(frames)

    async def image(prompt: str, steps: float, seed: float, preview: str, every: float, quality: float,
                    side: float, strip: bool, request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        model = need(image_model, "image", image_why)
        if not (prompt or "").strip():
            raise gr.Error("type a prompt first, e.g. 'a red circle on a blue background'")
        try:
            stream = model.stream(prompt.strip(), **image_kwargs(steps, seed, preview, every, quality, side))
        except MultistreamError as exc:
            raise _gr_error(exc) from exc
        key = (_session(request), "image")
        runs.start(key, stream)
        frames: list[str] = []
        try:
            yield _preview_html(None, "ms-image-preview", "starting…"), None, ""
            async for view in throttled_views(stream, max_fps):
                if view.error is not None:
                    raise gr.Error(f"{view.error.get('type')}: {view.error.get('message')}")
                yield image_outputs(view, "ms-image-preview", frames, bool(strip))
        finally:
            runs.end(key, stream)

    def stop_image(request: gr.Request) -> None:
        runs.cancel((_session(request), "image"))

    def finish_image(request: gr.Request) -> None:
        """"Use this": stop denoising now and keep the current picture at full quality."""
        stream = runs.get((_session(request), "image"))
        if stream is not None:
            stream.finish_early()

    def apply_image(prompt: str, request: gr.Request) -> None:
        """"Apply now": the edited prompt conditions the remaining steps of the running image."""
        prompt = (prompt or "").strip()
        if not prompt:
            raise gr.Error("type the new prompt first, e.g. 'a red circle on a yellow background'")
        stream = runs.get((_session(request), "image"))
        if stream is None:
            raise gr.Error("nothing is being drawn; 'Apply now' changes a running image (press Generate)")
        try:
            stream.steer(prompt=prompt)
        except MultistreamError as exc:
            raise _gr_error(exc) from exc

    # -- prompt to picture ---------------------------------------------------------------------

    async def picture(idea: str, steps: float, seed: float, preview: str,
                      request: gr.Request) -> AsyncIterator[tuple[Any, ...]]:
        llm = need(text_model, "text", text_why)
        sd = need(image_model, "image", image_why)
        idea = (idea or "").strip()
        if not idea:
            raise gr.Error("type an idea first, e.g. 'the sun over the sea'")
        chosen: dict[str, str] = {}
        kwargs = image_kwargs(steps, seed, preview, 1, 75, 256)

        def draw(final: Any) -> Stream:
            # The shapes style constrains the LLM to the image model's vocabulary: its text is drawn as is.
            prompt = (final.text or "").strip() or idea
            chosen["prompt"] = prompt
            return sd.stream(prompt, **kwargs)

        constraint = {"allowed": shapes_prompt_pattern()} if prompt_style == "shapes" else {"stop": ["\n"]}
        try:
            first = llm.stream(prompt_messages(idea, prompt_style), max_new_tokens=32, temperature=0.0, **constraint)
        except MultistreamError as exc:
            raise _gr_error(exc) from exc
        stream = chain(first, draw)
        key = (_session(request), "picture")
        runs.start(key, stream)
        try:
            yield "", "", _preview_html(None, "ms-picture-preview", "the LLM is writing the prompt…"), None
            async for view in throttled_views(stream, max_fps):
                if view.error is not None:
                    raise gr.Error(f"{view.error.get('type')}: {view.error.get('message')}")
                written = view.text(0) if view.texts else ""
                note = "" if view.images else ("the LLM is writing the prompt…" if "prompt" not in chosen else "drawing…")
                preview_html, final_img, _ = image_outputs(view, "ms-picture-preview", [], False, note)
                yield written, chosen.get("prompt", ""), preview_html, final_img
        finally:
            runs.end(key, stream)

    def stop_picture(request: gr.Request) -> None:
        runs.cancel((_session(request), "picture"))

    # -- layout --------------------------------------------------------------------------------

    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        # Inline so the page looks the same however it is started (launch() or mounted): a small
        # final image (the embedded model draws 64x64) is scaled up to fill its box.
        gr.HTML(_PAGE_STYLE, padding=False, elem_id="ms-style")
        gr.Markdown(
            "## multistream\nOne event protocol for LLM tokens and diffusion previews: "
            "everything below streams live from the model."
        )
        with gr.Tab("Chat", id="chat"):
            if text_model is None:
                gr.Markdown(f"⚠️ No text model: {text_why}")
            chatbot = gr.Chatbot(label="Chat", height=380, elem_id="ms-chatbot")
            with gr.Row():
                msg = gr.Textbox(placeholder="Ask something…", show_label=False, scale=5, elem_id="ms-chat-input")
                send = gr.Button("Send", variant="primary", scale=1, elem_id="ms-chat-send")
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="ms-chat-stop")
                steer = gr.Button("Steer", scale=1, elem_id="ms-chat-steer")
            with gr.Row():
                selection = gr.Textbox(label="Selected in the answer (select text above)", scale=3, max_lines=2,
                                       elem_id="ms-chat-selection")
                rewind_at = gr.Number(value=0, precision=0, minimum=0, label="or from character", scale=1,
                                      elem_id="ms-chat-offset")
                regenerate = gr.Button("Regenerate from here", scale=2, elem_id="ms-chat-rewind")
            chat_stats = gr.Markdown("", elem_id="ms-chat-stats")
            with gr.Accordion("Sampling", open=False):
                with gr.Row():
                    max_tokens = gr.Slider(1, 512, value=128, step=1, label="Max new tokens", elem_id="ms-chat-max-tokens")
                    temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature (0 = greedy)",
                                            elem_id="ms-chat-temperature")
                    top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                    chat_seed = gr.Number(value=-1, precision=0, label="Seed (-1 = random)")
            clear = gr.Button("Clear", size="sm")
            chat_inputs = [msg, chatbot, max_tokens, temperature, top_p, chat_seed]
            chat_outputs = [chatbot, msg, chat_stats]
            send.click(chat, chat_inputs, chat_outputs, api_name="chat", show_progress="hidden")
            msg.submit(chat, chat_inputs, chat_outputs, api_name=False, show_progress="hidden")
            stop.click(stop_chat, None, None, api_name="stop_chat", queue=False)
            # Typing while the answer streams, then Steer: a new instruction from the next token on.
            steer.click(steer_chat, [msg], [msg], api_name="steer_chat", queue=False)
            regenerate.click(regenerate_chat, [rewind_at, selection, msg, chatbot], [*chat_outputs, selection],
                             api_name="regenerate_chat", show_progress="hidden")
            clear.click(lambda: ([], ""), None, [chatbot, chat_stats], api_name=False, queue=False)

        with gr.Tab("Image", id="image"):
            if image_model is None:
                gr.Markdown(f"⚠️ No image model: {image_why}")
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(value="a red circle on a blue background", label="Prompt", elem_id="ms-image-prompt")
                    with gr.Row():
                        go = gr.Button("Generate", variant="primary", elem_id="ms-image-go")
                        istop = gr.Button("Stop", variant="stop", elem_id="ms-image-stop")
                        ifinish = gr.Button("Use this", elem_id="ms-image-finish")
                        iapply = gr.Button("Apply now", elem_id="ms-image-apply")
                    steps = gr.Slider(1, 100, value=20, step=1, label="Steps", elem_id="ms-image-steps")
                    seed = gr.Number(value=0, precision=0, label="Seed (-1 = random)")
                    # The model's own default: "tiny" (a fitted decoder on x0) for the embedded model.
                    preview = gr.Radio(list(PREVIEW_MODES), value=getattr(image_model, "default_preview", "latent"), label="Preview")
                    every = gr.Slider(1, 10, value=1, step=1, label="Preview every N steps")
                    with gr.Accordion("Preview frames", open=False):
                        quality = gr.Slider(10, 95, value=75, step=5, label="JPEG quality")
                        side = gr.Slider(64, 512, value=256, step=32, label="Preview max side (px)")
                        strip = gr.Checkbox(value=True, label="Show the strip of frames")
                with gr.Column(scale=2):
                    with gr.Row():
                        live = gr.HTML(_preview_html(None, "ms-image-preview"), label="Live preview", elem_id="ms-image-preview")
                        final = gr.Image(label="Final image (full quality)", type="pil", format="png",
                                         height=_PREVIEW_SIDE_PX, elem_id="ms-image-final", interactive=False)
                    frames_strip = gr.HTML("", label="Frames so far", elem_id="ms-image-strip")
            image_inputs = [prompt, steps, seed, preview, every, quality, side, strip]
            go.click(image, image_inputs, [live, final, frames_strip], api_name="image", show_progress="hidden")
            prompt.submit(image, image_inputs, [live, final, frames_strip], api_name=False, show_progress="hidden")
            istop.click(stop_image, None, None, api_name="stop_image", queue=False)
            ifinish.click(finish_image, None, None, api_name="finish_image", queue=False)
            # Edit the prompt while it draws, then Apply now: the remaining steps follow the new one.
            iapply.click(apply_image, [prompt], None, api_name="steer_image", queue=False)

        with gr.Tab("Prompt to picture", id="picture"):
            if text_model is None or image_model is None:
                gr.Markdown(f"⚠️ This tab needs both models. {text_why} {image_why}")
            with gr.Row():
                with gr.Column(scale=1):
                    idea = gr.Textbox(value="the sun over the sea", label="Idea", elem_id="ms-picture-idea")
                    with gr.Row():
                        pgo = gr.Button("Write and draw", variant="primary", elem_id="ms-picture-go")
                        pstop = gr.Button("Stop", variant="stop", elem_id="ms-picture-stop")
                    written = gr.Textbox(label="The LLM writes (streaming)", lines=2, interactive=False, elem_id="ms-picture-written")
                    used = gr.Textbox(label="Image prompt used", interactive=False, elem_id="ms-picture-used")
                    psteps = gr.Slider(1, 100, value=20, step=1, label="Steps", elem_id="ms-picture-steps")
                    pseed = gr.Number(value=0, precision=0, label="Seed (-1 = random)")
                    ppreview = gr.Radio(list(PREVIEW_MODES), value=getattr(image_model, "default_preview", "latent"), label="Preview")
                with gr.Column(scale=2):
                    with gr.Row():
                        plive = gr.HTML(_preview_html(None, "ms-picture-preview"), elem_id="ms-picture-preview")
                        pfinal = gr.Image(label="Final image", type="pil", format="png", height=_PREVIEW_SIDE_PX,
                                          elem_id="ms-picture-final", interactive=False)
            pic_inputs = [idea, psteps, pseed, ppreview]
            pic_outputs = [written, used, plive, pfinal]
            pgo.click(picture, pic_inputs, pic_outputs, api_name="prompt_to_picture", show_progress="hidden")
            pstop.click(stop_picture, None, None, api_name="stop_picture", queue=False)

        # Selecting text in the chat answer fills "Selected in the answer" (Regenerate from here
        # starts where it begins); the server finds it in the raw answer, so markdown rendering
        # cannot shift the offset.
        demo.load(None, None, None, js=_SELECTION_JS)

    # Several users each get their own streams; on a CPU more than a few at once only slow everyone.
    demo.queue(default_concurrency_limit=concurrency_limit, max_size=64)
    demo.multistream_runs = runs  # type: ignore[attr-defined]  # tests and the benchmark look at it
    return demo


def mount_demo(app: Any, text_model: Any = None, image_model: Any = None, path: str = "/demo", *,
               auth: Any = None, **kwargs: Any) -> Any:
    """Serve the demo page from an existing FastAPI app (``multistream serve`` does this at /demo).

    ``auth`` is Gradio's login check (``fn(username, password) -> bool``; the server passes one
    that takes an API key as the password).

    Example:
        >>> from fastapi import FastAPI
        >>> app = mount_demo(FastAPI(), llm, sd)                        # doctest: +SKIP
    """
    if not isinstance(path, str) or not path.startswith("/") or path == "/":
        raise InvalidArgumentError(f"path must start with '/' and not be the root, got {path!r}; try '/demo'")
    demo = create_demo(text_model, image_model, **kwargs)
    return _gradio().mount_gradio_app(app, demo, path=path.rstrip("/"), auth=auth)


def launch(
    text_model: Any = None,
    image_model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = 7860,
    block: bool = True,
    **kwargs: Any,
) -> gr.Blocks:
    """Create and start the demo (used by ``multistream demo`` and ``demos/app.py``)."""
    demo = create_demo(text_model, image_model, **kwargs)
    demo.launch(server_name=host, server_port=port, share=False, prevent_thread_lock=not block, show_error=True)
    return demo
