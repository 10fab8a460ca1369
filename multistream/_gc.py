"""Python's cyclic garbage collector held off while a model loads.

A model's load imports thousands of modules (torch, transformers, diffusers) and builds millions
of objects that all live on. CPython's generational collector keeps examining them as they pile
up: each time the old generation grows by a quarter it walks all of it again. Measured on the
embedded text model (2-core machine, Python 3.11): about 1,100 collections and 1.0 s of a 4.8 s
warm ``load_text_model()``, for no garbage worth the name.

`paused_collector` turns the collector off for the load and back on after it, with one full
collection at the end (0.3-0.4 s): the load's objects then sit in the oldest generation, so the
first tokens after it are not the ones that pay for walking them. The switch is process-wide
(``gc.disable``), so other threads' cyclic garbage waits for the load too (seconds); reference
counting still frees everything else at once. Loads in several threads at once share one pause:
the collector comes back when the last one ends, and only if it was on when the first began.

Example:
    >>> import gc
    >>> with paused_collector():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["paused_collector", "pauses_collector"]

_lock = threading.Lock()
_loads = 0  # loads in progress (any thread)
_was_enabled = False  # whether the collector was on when the first of them began

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """No cyclic garbage collection while the block runs (see the module's docstring)."""
    global _loads, _was_enabled
    with _lock:
        if _loads == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _loads += 1
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            resume = _loads == 0 and _was_enabled
            if resume:
                gc.enable()
        if resume:
            gc.collect()  # once, now: not at the first tokens' expense


def pauses_collector(load: F) -> F:
    """Decorator: ``load`` runs under `paused_collector`.

    Example:
        >>> @pauses_collector
        ... def load_something():
        ...     return gc.isenabled()
        >>> load_something()
        False
    """

    @functools.wraps(load)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with paused_collector():
            return load(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
