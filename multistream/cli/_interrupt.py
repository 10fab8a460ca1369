"""Ctrl-C on a denoising command: the first one keeps the picture or clip as it is now.

AUTOMATIC1111's "Interrupt" and ComfyUI's cancel hand back the image as far as it got; our
``image`` and ``video`` commands exited with status 130 and wrote nothing but the previews. Now the
first Ctrl-C asks the stream to finish early (`Stream.finish_early`: the current estimate through
the full VAE becomes the final event, ``finish_reason="finished_early"``), the command writes it
where ``--out`` says and exits with status 130; a second Ctrl-C stops at once, writing nothing more.

Example:
    >>> from multistream.testing import ScriptedImageModel
    >>> ctrl_c = CtrlC(print)
    >>> [ev.type for ev in ctrl_c.events(ScriptedImageModel(steps=2, size=8).stream("x"))][-1]
    'image'
    >>> ctrl_c.interrupted
    False
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CtrlC"]

INTERRUPTED_STATUS = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


class CtrlC:
    """Reads a stream's events; the first KeyboardInterrupt finishes the stream early, the second
    propagates. ``say`` prints the one line that tells the user what happens."""

    def __init__(self, say: Callable[[str], Any]) -> None:
        self.say = say
        self.interrupted = False

    def events(self, stream: Any) -> Iterator[Any]:
        while True:
            try:
                # A stream is its own iterator: after an interrupt inside its __next__, the loop
                # goes on from the next event (none is lost).
                for ev in stream:
                    yield ev
                return
            except KeyboardInterrupt:
                if self.interrupted:
                    raise
                self.interrupted = True
                stream.finish_early()
                self.say("interrupted: finishing with the current estimate (Ctrl-C again to stop at once)")

    def status(self, ok: int = 0) -> int:
        """The exit status: 130 once interrupted (what was kept is written), else ``ok``."""
        return INTERRUPTED_STATUS if self.interrupted else ok
