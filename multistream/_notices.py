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

`quiet_here` drops given notices only where multistream says the same thing itself: the records
its own thread emits inside the block (a pipeline call on a model's engine thread), so the same
library call made by the user, on another thread or after the block, still warns.

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
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["NOTICES", "LibraryNoticeFilter", "progress_modules", "quiet_here", "quiet_library_notices",
           "quiet_loading_bars"]

# The libraries whose tqdm bars a load draws (library -> its logging module); each module has
# is_progress_bar_enabled / enable / disable.
_PROGRESS_MODULES = {"transformers": "transformers.utils.logging", "diffusers": "diffusers.utils.logging"}

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


def progress_modules(libraries: Iterable[str] = tuple(_PROGRESS_MODULES)) -> Iterator[Any]:
    """The installed libraries' logging modules that switch their tqdm bars (``is_progress_bar_enabled``,
    ``enable_progress_bar``, ``disable_progress_bar``): transformers' and diffusers', or those of
    ``libraries`` only. Importing one imports its library (diffusers' costs 1.5 s of torch._dynamo),
    so a text-only caller names ``("transformers",)``."""
    for library in libraries:
        try:
            yield importlib.import_module(_PROGRESS_MODULES[library])
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


class _HereFilter(logging.Filter):
    """Drops a record when a `quiet_here` block is open on the thread that emits it and the
    record's message contains one of that block's needles."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.open: Counter[tuple[int, str]] = Counter()  # (thread ident, needle): blocks open

    def filter(self, record: logging.LogRecord) -> bool:
        with self.lock:
            needles = [needle for thread, needle in self.open if thread == record.thread]
        if not needles:
            return True
        message = record.getMessage()
        return not any(needle in message for needle in needles)


_here_lock = threading.Lock()
_here_filters: dict[str, _HereFilter] = {}  # logger name -> its filter, while a block is open on it


@contextlib.contextmanager
def quiet_here(notices: Iterable[tuple[str, str]]) -> Iterator[None]:
    """Drop the records of ``notices`` ((logger name, text in the message)) that this thread emits
    inside the block. Other threads' records, and every record once the block ends, still show;
    blocks may open and close in any order (requests interleave on one engine thread), and the
    last one out takes its filter off the logger.

    Example:
        >>> import logging
        >>> with quiet_here([("demo.lib", "too long")]):
        ...     logging.getLogger("demo.lib").warning("input too long, cut")   # dropped
        >>> logging.getLogger("demo.lib").filters
        []
    """
    thread = threading.get_ident()
    keys = list(dict.fromkeys(notices))
    with _here_lock:
        for name, needle in keys:
            here = _here_filters.get(name)
            if here is None:
                here = _here_filters[name] = _HereFilter()
                logging.getLogger(name).addFilter(here)
            with here.lock:
                here.open[(thread, needle)] += 1
    try:
        yield
    finally:
        with _here_lock:
            for name, needle in keys:
                here = _here_filters[name]
                with here.lock:
                    here.open[(thread, needle)] -= 1
                    if here.open[(thread, needle)] <= 0:
                        del here.open[(thread, needle)]
                    idle = not here.open
                if idle:
                    logging.getLogger(name).removeFilter(here)
                    del _here_filters[name]
