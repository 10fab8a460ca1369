"""Scripted stand-ins for the text, image, speech and video models, for fast tests of anything built on streams.

`ScriptedTextModel`, `ScriptedImageModel` and `ScriptedVideoModel` have the same ``.stream()`` / ``.generate()``
signatures as the real models and emit scripted events through a real `Stream` (so seq,
backpressure, cancel and error handling behave exactly as in production), without torch or
weights. They check their arguments with the code the real models use
(`multistream.text._options`, `multistream.image._options`), so they refuse the same mistakes with
the same messages and an image stream previews the same steps as a real one. They honour
``cancel()`` and ``finish_early()`` within one step, and take edits in a simple scripted way: text ``steer(text)``
starts a new revision and the script goes on; text ``rewind(offset)`` cuts the answer at
``offset`` and the script goes on from there; ``ScriptedTextModel.revise(final, offset)``
regenerates a finished answer from ``offset``; image ``steer(prompt=...)`` recolours the picture
to the prompt's colours from the next step.

Example:
    >>> from multistream.testing import ScriptedTextModel, ScriptedImageModel
    >>> llm = ScriptedTextModel(["Hello", ",", " world"])
    >>> "".join(ev.delta for ev in llm.stream("hi"))
    'Hello, world'
    >>> llm.generate("hi").finish_reason
    'stop'
    >>> sd = ScriptedImageModel(steps=4, size=32)
    >>> events = list(sd.stream("a red circle"))   # previews (a slow reader gets only the newest), then the final
    >>> events[-1].step, events[-1].is_final, events[-1].mime
    (4, True, 'image/png')
"""

from __future__ import annotations

from ._image import ScriptedImageModel
from ._speech import ScriptedSpeechModel
from ._text import DEFAULT_TOKENS, ScriptedTextModel
from ._video import ScriptedVideoModel

__all__ = ["DEFAULT_TOKENS", "ScriptedImageModel", "ScriptedSpeechModel", "ScriptedTextModel", "ScriptedVideoModel"]
