"""Ctrl-C on a denoising command: the first one keeps the picture or clip as it is now.

AUTOMATIC1111's "Interrupt" and ComfyUI's cancel hand back the image as far as it got; our
``image`` and ``video`` commands exited with status 130 and wrote nothing but the previews. Now the
first Ctrl-C asks the stream to finish early (`Stream.finish_early`: the current estimate through
the full VAE becomes the final event, ``finish_reason="finished_early"``), the command writes it
where ``--out`` says and exits with status 130; a second Ctrl-C stops at once, writing nothing more.
``multistream text`` (without ``--speak``, which keeps the audio its own way) does the same: the
answer ends where it is, with its summary line; it printed a KeyboardInterrupt from the engine's
finalizer instead, and now and then died of SIGABRT while the engine thread was still running.

The first Ctrl-C is taken by a SIGINT handler installed while the events are read, not by catching
KeyboardInterrupt: the interrupt lands wherever the main thread is, often in the loop's body
(printing an event) rather than in the wait for the next one, and from there it would end the
command. The handler only sets flags (`Stream.finish_early` sets a `threading.Event` that the
consumer never holds); the line that says so is printed with the next event, never from inside
the handler, where it could interrupt another write to stderr.

Example:
    >>> from multistream.testing import ScriptedImageModel
    >>> ctrl_c = CtrlC(print)
    >>> [ev.type for ev in ctrl_c.events(ScriptedImageModel(steps=2, size=8).stream("x"))][-1]
    'image'
    >>> ctrl_c.interrupted
    False
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["INTERRUPTED_STATUS", "NOTICE", "TEXT_NOTICE", "CtrlC"]

INTERRUPTED_STATUS = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
NOTICE = "interrupted: finishing with the current estimate (Ctrl-C again to stop at once)"
TEXT_NOTICE = "interrupted: the answer ends here (Ctrl-C again to stop at once)"


class CtrlC:
    """Reads a stream's events; the first SIGINT finishes the stream early, the second raises
    KeyboardInterrupt. ``say`` prints the one line that tells the user what happens."""

    def __init__(self, say: Callable[[str], Any], notice: str = NOTICE) -> None:
        self.say = say
        self.notice = notice
        self.interrupted = False
        self._told = False
        self._stream: Any = None

    def interrupt(self, *_: Any) -> None:
        """What a Ctrl-C does (the SIGINT handler): finish early the first time, stop the second."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        if self._stream is not None:
            self._stream.finish_early()

    def events(self, stream: Any) -> Iterator[Any]:
        self._stream = stream
        installed = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self.interrupt) if installed else None
        try:
            for ev in stream:
                self._tell()
                yield ev
            self._tell()
        finally:
            if installed:
                signal.signal(signal.SIGINT, previous)

    def _tell(self) -> None:
        if self.interrupted and not self._told:
            self._told = True
            self.say(self.notice)

    def status(self, ok: int = 0) -> int:
        """The exit status: 130 once interrupted (what was kept is written), else ``ok``."""
        return INTERRUPTED_STATUS if self.interrupted else ok
