"""Where people watch: the Jupyter view (`show`) and the Gradio demo (`multistream.ui.demo`:
`create_demo`, `launch`), both built on one shared live view of a stream (`LiveView`, `Throttle`).

Example:
    >>> from multistream.ui import show
    >>> show(llm.stream("Write a haiku"))                                # doctest: +SKIP
"""

from __future__ import annotations

from .notebook import show
from .view import Frame, LiveView, Throttle, throttled_views

__all__ = ["Frame", "LiveView", "Throttle", "show", "throttled_views"]
