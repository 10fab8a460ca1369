"""Python's cyclic garbage collector held off while a model loads.

A model's load imports thousands of modules (torch, transformers, diffusers) and builds millions
of objects that all live on. CPython's generational collector keeps examining them as they pile
up: each time the old generation grows by a quarter it walks all of it again. Measured on the
embedded text model (2-core machine, Python 3.11): about 1,100 collections and 1.0 s of a 4.8 s
warm ``load_text_model()``, for no garbage worth the name.

`paused_collector` turns the collector off for the load and back on after it. When the pause
leaves a large backlog (`BACKLOG`: objects allocated and not yet examined), one full collection
follows at once (0.3-0.4 s after a first load): the load's objects then sit in the oldest
generation, so the first tokens after it are not the ones that pay for walking them. A load that
built little (a model object passed in, an argument refused) leaves the collector as it was,
without a collection. The switch is process-wide (``gc.disable``), so other threads' cyclic
garbage waits for the load too (reference counting still frees everything else at once); a hub
download inside a first load keeps it waiting as long. Loads in several threads at once share
one pause: the collector comes back when the last one ends, and only if it was on when the first
began. The server's loads, one after another, share one pause (`paused_until`), ended after
`PAUSE_LIMIT_S` at the latest.

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
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["BACKLOG", "PAUSE_LIMIT_S", "pause_collector", "paused", "paused_collector", "paused_until",
           "pauses_collector"]

#: Objects allocated during a pause (``gc.get_count()[0]``) above which its end collects (or
#: freezes) at once: a warm load of the embedded text model in a new process leaves about 450,000.
BACKLOG = 200_000
#: The longest the server's shared pause lasts (a stalled download, a factory that never returns).
PAUSE_LIMIT_S = 300.0

_lock = threading.RLock()  # reentrant: a finalizer that runs in `finish` may ask `paused()`
_loads = 0  # pauses in progress (any thread)
_was_enabled = False  # whether the collector was on when the first of them began

F = TypeVar("F", bound=Callable[..., Any])


def paused() -> bool:
    """Whether a pause is in progress (the server waits for its end before it freezes start-up)."""
    with _lock:
        return _loads > 0


def pause_collector(finish: Callable[[], object] = gc.collect) -> Callable[[], None]:
    """Turn the collector off (shared with every pause in progress); returns the function that
    ends this pause (once). The last one to end turns it back on and, when the pauses left a
    backlog of `BACKLOG` objects or more, runs its ``finish``: one full collection by default; a
    process that is all ours (the ``multistream`` command) passes `gc.freeze`, which sets the
    load's objects aside without walking them."""
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
            if _loads == 0 and _was_enabled:
                # Before the collector is back: once on, the next allocation would walk the whole
                # backlog as "young" objects first, and this walk would come on top of it.
                if gc.get_count()[0] >= BACKLOG:
                    finish()  # once, now: not at the first tokens' expense
                gc.enable()

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


def paused_until(events: Iterable[threading.Event], finish: Callable[[], object] = gc.collect,
                 limit_s: float = PAUSE_LIMIT_S) -> None:
    """Pause the collector now and until every event is set, or ``limit_s`` has passed (a watcher
    thread ends the pause): the server's models load one after another in threads of their own,
    and their loads share this one pause, so the collector walks what they built once, after
    the last.

    Example:
        >>> done = threading.Event()
        >>> paused_until([done]); gc.isenabled()
        False
        >>> done.set()
    """
    resume = pause_collector(finish)
    waiting = list(events)

    def watch() -> None:
        try:
            deadline = time.monotonic() + limit_s
            for event in waiting:
                if not event.wait(max(0.0, deadline - time.monotonic())):
                    break  # past the limit: the collector comes back while the slow load goes on
        finally:
            resume()

    try:
        threading.Thread(target=watch, name="multistream-collector-pause", daemon=True).start()
    except BaseException:
        resume()
        raise


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
