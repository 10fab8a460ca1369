"""What the command line shows on stderr: the libraries' import-time notices filtered, their
progress bars on a terminal only.

A newcomer's first ``multistream image`` printed two transformers notices about torchvision (an
optional backend of image processors multistream never uses): not theirs to fix, so the command
line drops those records; every other warning still shows. Progress bars (tqdm: transformers'
GGUF conversion and weight loading, diffusers' pipeline loading, the preview fit) show on a
terminal and stay out of logs and pipes. So does the line that says a model is loading
(`loading_notice`): a warm start of the embedded text model still takes seconds (its libraries'
imports), which a newcomer saw as a blank terminal.

Example:
    >>> from multistream.cli._console import quiet_library_notices, show_progress
    >>> quiet_library_notices()
    >>> show_progress() in (True, False)
    True
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from .._notices import LibraryNoticeFilter, progress_modules, quiet_library_notices

__all__ = ["ERASE_LINE", "LibraryNoticeFilter", "loading_notice", "model_loading", "progress_stream", "quiet_library_notices",
           "set_library_progress", "show_progress", "status_line"]

#: Back to the start of the terminal's line and clear it: a status line is rewritten in place.
ERASE_LINE = "\r\x1b[2K"


def show_progress(stream: TextIO | None = None) -> bool:
    """Whether progress bars belong on ``stream`` (stderr): only on a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty: Any = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed stream
        return False


def set_library_progress(enabled: bool, libraries: Iterable[str] = ("transformers", "diffusers")) -> None:
    """Turn the libraries' own tqdm bars on (a terminal) or off (a log, a pipe); a command that loads
    no diffusers pipeline names ``("transformers",)``, so that it does not import diffusers."""
    for module in progress_modules(libraries):
        (module.enable_progress_bar if enabled else module.disable_progress_bar)()


def status_line(text: str, final: bool = False) -> None:
    """A command's progress line on stderr: rewritten in place on a terminal (``final`` ends it
    with a newline), one line each in a log or a pipe."""
    if sys.stderr.isatty():
        sys.stderr.write(ERASE_LINE + text + ("\n" if final else ""))
    else:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def progress_stream() -> TextIO | None:
    """Where the command line's own tqdm bars go: stderr on a terminal, nowhere otherwise."""
    return sys.stderr if show_progress() else None


@contextlib.contextmanager
def loading_notice(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """On a terminal, ``loading <what>...`` on stderr while the block runs (a model loading), erased
    when it ends, so the first output takes the line; nothing in a log or a pipe. The libraries'
    own bars (a first conversion) start with a carriage return and simply write over it.

    Example:
        >>> with loading_notice("the embedded text model"):   # doctest: +SKIP
        ...     llm = load_text_model()
    """
    stream = sys.stderr if stream is None else stream
    if not show_progress(stream):
        yield
        return
    stream.write(f"loading {what}...")
    stream.flush()
    try:
        yield
    finally:
        stream.write(ERASE_LINE)
        stream.flush()


@contextlib.contextmanager
def model_loading(what: str, own_process: bool,
                  libraries: Iterable[str] = ("transformers", "diffusers")) -> Iterator[None]:
    """A command's model load, from its libraries' imports to the loaded model: `loading_notice`,
    the ``libraries``' loading bars on a terminal only (`set_library_progress`), and Python's
    cyclic collector held off (`multistream._gc`). When the command is the process
    (``own_process``: `multistream.cli.entry`), the pause ends with `gc.freeze`: what the load
    built lives until the process exits, so nothing is walked; called from Python, with one
    collection.

    Example:
        >>> with model_loading("the embedded text model", own_process=True, libraries=("transformers",)):  # doctest: +SKIP
        ...     llm = load_text_model()
    """
    from .._gc import paused_collector

    with loading_notice(what), paused_collector(gc.freeze if own_process else gc.collect):
        set_library_progress(show_progress(), libraries)
        yield
