"""Where people watch: the Jupyter view (`show`) and the Gradio demo (`create_demo`, `launch`),
both built on one shared live view of a stream.

Example:
    >>> from multistream.ui import show
    >>> show(llm.stream("Write a haiku"))                                # doctest: +SKIP
"""

from __future__ import annotations

from .notebook import show

__all__ = ["show"]
