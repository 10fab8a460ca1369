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
the collector comes back when the last one ends, and only if it was on when the first began;
the server's loads, one after another, share one pause (`paused_until`).

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
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["pause_collector", "paused_collector", "paused_until", "pauses_collector"]

_lock = threading.Lock()
_loads = 0  # loads in progress (any thread)
_was_enabled = False  # whether the collector was on when the first of them began

F = TypeVar("F", bound=Callable[..., Any])


def pause_collector(finish: Callable[[], object] = gc.collect) -> Callable[[], None]:
    """Turn the collector off (shared with every pause in progress); returns the function that
    ends this pause (once). The last one to end turns it back on and runs its ``finish``: one
    full collection by default; a process that is all ours (the ``multistream`` command) passes
    `gc.freeze`, which sets the load's objects aside without walking them at all."""
    global _loads, _was_enabled
    with _lock:
        if _loads == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _loads += 1
    ended = False

    def resume() -> None:
        global _loads
        nonlocal ended
        with _lock:
            if ended:
                return
            ended = True
            _loads -= 1
            last = _loads == 0 and _was_enabled
            if last:
                gc.enable()
        if last:
            finish()  # once, now: not at the first tokens' expense

    return resume


@contextlib.contextmanager
def paused_collector(finish: Callable[[], object] = gc.collect) -> Iterator[None]:
    """No cyclic garbage collection while the block runs (see the module's docstring and
    `pause_collector` for ``finish``)."""
    resume = pause_collector(finish)
    try:
        yield
    finally:
        resume()


def paused_until(events: Iterable[threading.Event]) -> None:
    """Pause the collector now and until every event is set (a watcher thread ends the pause):
    the server's models load one after another in threads of their own, and their loads share
    this one pause, so the collector walks what they built once, after the last.

    Example:
        >>> done = threading.Event()
        >>> paused_until([done]); gc.isenabled()
        False
        >>> done.set()
    """
    resume = pause_collector()
    waiting = list(events)

    def watch() -> None:
        for event in waiting:
            event.wait()
        resume()

    threading.Thread(target=watch, name="multistream-collector-pause", daemon=True).start()


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
