"""The Gradio demo: chat, image previews, prompt-to-picture, video and speech, all streaming live.

``create_demo()`` builds the page (it is what ``multistream demo``, ``python demos/app.py`` and
``multistream serve`` at ``/demo`` run). Every tab reads one multistream `Stream` and pushes
updates to the browser at most ``max_fps`` times a second (``throttled_views`` over the shared
``LiveView``); between two pushes newer events are folded in, so a slow page gets the newest
frame, never a backlog, and always the final one.

Layout: one module per tab, each a small class with its layout and named handlers: ``_chat``
(streaming chat; Steer and Regenerate from here edit the answer while it streams), ``_image``
(live denoising previews; Use this, Apply now), ``_picture`` (the LLM writes an image prompt that
the image model then draws, one composed stream), ``_video`` (every frame's preview per step,
then the clip; Use this, Apply now, and "Write and film": the LLM writes the clip's prompt),
``_speech`` (speech that plays while it is made); ``_shared`` holds what they share (models,
runs per session, the preview box), ``_prompts`` the LLM prompts, ``_page`` the page and its serving.

Gradio is imported only when ``create_demo``, ``launch``, ``mount_demo`` or ``demo_asgi_app`` is first used, so the
prompt helpers here work without it.

Example:
    >>> from multistream.ui.demo import create_demo
    >>> demo = create_demo()            # loads the embedded default models   # doctest: +SKIP
    >>> demo.launch()                                                          # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..view import throttled_views
from ._prompts import (
    DEFAULT_IDEA,
    DEFAULT_VIDEO_IDEA,
    prompt_messages,
    shapes_prompt_pattern,
    shapes_video_pattern,
    video_prompt_messages,
)

if TYPE_CHECKING:
    from ._page import create_demo, demo_asgi_app, launch, mount_demo

_NEEDS_GRADIO = ("create_demo", "demo_asgi_app", "launch", "mount_demo")


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_GRADIO:
        raise AttributeError(f"module 'multistream.ui.demo' has no attribute {name!r}")
    # The demo must never phone home (offline machines, privacy); set before gradio is imported.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from ._page import create_demo, demo_asgi_app, launch, mount_demo

    value = {"create_demo": create_demo, "demo_asgi_app": demo_asgi_app, "launch": launch,
             "mount_demo": mount_demo}[name]
    globals()[name] = value
    return value


__all__ = ["DEFAULT_IDEA", "DEFAULT_VIDEO_IDEA", "create_demo", "demo_asgi_app", "launch", "mount_demo", "prompt_messages",
           "shapes_prompt_pattern", "shapes_video_pattern", "throttled_views", "video_prompt_messages"]
