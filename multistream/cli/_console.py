"""What the command line shows on stderr: the libraries' import-time notices filtered, their
progress bars on a terminal only.

A newcomer's first ``multistream image`` printed two transformers notices about torchvision (an
optional backend of image processors multistream never uses): not theirs to fix, so the command
line drops those records; every other warning still shows. Progress bars (tqdm: transformers'
GGUF conversion and weight loading, diffusers' pipeline loading, the preview fit) show on a
terminal and stay out of logs and pipes.

Example:
    >>> from multistream.cli._console import quiet_library_notices, show_progress
    >>> quiet_library_notices()
    >>> show_progress() in (True, False)
    True
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, TextIO

__all__ = ["LibraryNoticeFilter", "progress_stream", "quiet_library_notices", "set_library_progress", "show_progress"]

# (logger name, text in the message): notices a library prints at import or load time about its own
# optional backends. Matched narrowly, so a real warning from the same logger still shows.
NOTICES = (
    ("transformers.utils.import_utils", "requires torchvision (not installed)"),
    ("transformers.utils.import_utils", "torchvision is not available"),
)


class LibraryNoticeFilter(logging.Filter):
    """Drops the records of `NOTICES` on the logger it is attached to; keeps every other record."""

    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(needle in message for needle in self.needles)


def quiet_library_notices() -> None:
    """Attach the filters (idempotent). Loggers exist by name before their library imports, so this
    runs before transformers is imported and costs nothing."""
    by_logger: dict[str, list[str]] = {}
    for name, needle in NOTICES:
        by_logger.setdefault(name, []).append(needle)
    for name, needles in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, LibraryNoticeFilter) for f in logger.filters):
            logger.addFilter(LibraryNoticeFilter(tuple(needles)))


def show_progress(stream: TextIO | None = None) -> bool:
    """Whether progress bars belong on ``stream`` (stderr): only on a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty: Any = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed stream
        return False


def set_library_progress(enabled: bool) -> None:
    """Turn the libraries' own tqdm bars on (a terminal) or off (a log, a pipe)."""
    for module in ("transformers.utils.logging", "diffusers.utils.logging"):
        try:
            logging_module: Any = importlib.import_module(module)
        except ImportError:
            continue
        (logging_module.enable_progress_bar if enabled else logging_module.disable_progress_bar)()


def progress_stream() -> TextIO | None:
    """Where the command line's own tqdm bars go: stderr on a terminal, nowhere otherwise."""
    return sys.stderr if show_progress() else None
