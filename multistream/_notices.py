"""Library notices about optional backends multistream never uses, dropped from their loggers.

Loading a diffusers pipeline makes transformers print, once per process, that its image
processors "require torchvision (not installed)": an optional backend of image processors that
multistream never uses, and not the user's to fix. The image and video loaders (and the command
line, before anything imports transformers) attach a filter to that logger which drops exactly
those records; every other warning, from the same logger too, still shows.

Example:
    >>> quiet_library_notices()
    >>> import logging
    >>> any(isinstance(f, LibraryNoticeFilter) for f in logging.getLogger("transformers.utils.import_utils").filters)
    True
"""

from __future__ import annotations

import logging

__all__ = ["NOTICES", "LibraryNoticeFilter", "quiet_library_notices"]

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
