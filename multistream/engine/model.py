"""`EngineModel`: what every engine-backed model class shares (its engine, closing, ``with``).

Each family's model (`TextModel`, `ImageModel`, `SpeechModel`, `VideoModel`) runs on one
`Engine`; starting it, closing it (also on garbage collection, with one timeout for every family)
and the context-manager protocol are written here once instead of once per family.

Example:
    >>> class Count:                      # a toy backend with no work
    ...     def admit(self, job): pass
    ...     def has_work(self): return False
    ...     def step(self): pass
    ...     def fail_all(self, exc): pass
    ...     def shutdown(self): pass
    >>> class Toy(EngineModel):
    ...     def __init__(self): self.start_engine(Count(), name="toy")
    >>> with Toy() as toy:
    ...     toy.engine.closed
    False
    >>> toy.engine.closed
    True
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

from .core import Backend, Engine

__all__ = ["ENGINE_CLOSE_TIMEOUT", "EngineModel"]

#: Seconds `EngineModel.close` (and garbage collection) waits for the engine thread to end: a step
#: in progress finishes first (a denoising step of a large model on a CPU can take this long).
ENGINE_CLOSE_TIMEOUT = 30.0

M = TypeVar("M", bound="EngineModel")


class EngineModel:
    """Base of the engine-backed model classes: ``engine``, ``close()``, ``with model: ...``.

    A subclass calls `start_engine` once in its ``__init__``; the engine thread holds no reference
    to the model, so dropping the model closes its engine.
    """

    _engine: Engine
    _finalizer: weakref.finalize

    def start_engine(self, backend: Backend, *, name: str, setup: Callable[[], None] | None = None) -> Engine:
        """Start this model's engine thread on ``backend``; closing happens on `close` or collection."""
        self._engine = Engine(backend, name=name, setup=setup)
        # The engine thread must not keep this object alive; closing on collection ends it.
        self._finalizer = weakref.finalize(self, self._engine.close, ENGINE_CLOSE_TIMEOUT)
        return self._engine

    @property
    def engine(self) -> Engine:
        """The engine thread that runs every stream of this model."""
        return self._engine

    def close(self) -> None:
        """End the engine thread; running streams end with ``finish_reason="cancelled"``.

        Also happens when the model is garbage collected and at interpreter exit.

        Example:
            >>> model.close()      # doctest: +SKIP
        """
        finalizer: Any = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def __enter__(self: M) -> M:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
