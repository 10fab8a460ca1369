"""Library notices about optional backends multistream never uses, dropped from their loggers;
and the libraries' loading bars, hidden while an embedded model loads.

Loading a diffusers pipeline makes transformers print, once per process, that its image
processors "require torchvision (not installed)": an optional backend of image processors that
multistream never uses, and not the user's to fix. The image and video loaders (and the command
line, before anything imports transformers) attach a filter to that logger which drops exactly
those records; every other warning, from the same logger too, still shows.

The embedded image and video models load from the package in a fraction of a second, yet
diffusers and transformers drew two progress bars for it ("Loading pipeline components",
"Loading weights") in a plain ``load_image_model()``: noise a newcomer took for a download.
`quiet_loading_bars` hides them for that load only and puts the libraries' setting back after;
a hub or folder model keeps its bars (a download or a large load is worth watching).

Example:
    >>> quiet_library_notices()
    >>> import logging
    >>> any(isinstance(f, LibraryNoticeFilter) for f in logging.getLogger("transformers.utils.import_utils").filters)
    True
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["NOTICES", "LibraryNoticeFilter", "progress_modules", "quiet_library_notices", "quiet_loading_bars"]

# The libraries whose tqdm bars a load draws; each has is_progress_bar_enabled / enable / disable.
_PROGRESS_MODULES = ("transformers.utils.logging", "diffusers.utils.logging")

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


def progress_modules() -> Iterator[Any]:
    """The installed libraries' logging modules that switch their tqdm bars (``is_progress_bar_enabled``,
    ``enable_progress_bar``, ``disable_progress_bar``): transformers' and diffusers'."""
    for name in _PROGRESS_MODULES:
        try:
            yield importlib.import_module(name)
        except ImportError:
            continue


@contextlib.contextmanager
def quiet_loading_bars() -> Iterator[None]:
    """Hide transformers' and diffusers' progress bars inside the block, then restore each library's
    own setting (a user who turned them off keeps them off).

    Example:
        >>> import diffusers.utils.logging as dl
        >>> before = dl.is_progress_bar_enabled()
        >>> with quiet_loading_bars():
        ...     dl.is_progress_bar_enabled()
        False
        >>> dl.is_progress_bar_enabled() == before
        True
    """
    turned_off: list[Any] = []
    for module in progress_modules():
        if module.is_progress_bar_enabled():
            module.disable_progress_bar()
            turned_off.append(module)
    try:
        yield
    finally:
        for module in turned_off:
            module.enable_progress_bar()
