"""The edit queue of a text request: steers and rewinds, queued on the caller's thread and taken
on the engine thread at the next step boundary.

Example:
    >>> queue = EditQueue()
    >>> queue.put(Edit("steer", [42], instruction="shorter"))
    >>> bool(queue), [e.kind for e in queue.take()], bool(queue)
    (True, ['steer'], False)
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the queue itself needs no torch
    from ._sampling import RowSampler

__all__ = ["Edit", "EditQueue"]


@dataclass
class Edit:
    """A steer or rewind waiting for the request's next step."""

    kind: str  # "steer" | "rewind"
    inserted: list[int]  # tokens that carry the instruction into the context ([] for none)
    instruction: str | None = None
    offset: int | None = None  # rewind: character of the answer to cut at (snapped to a token)
    sampler: RowSampler | None = None  # rewind with new sampling options
    token_id: int | None = None  # rewind: the first regenerated token, chosen by the caller (a branch)


class EditQueue:
    """Edits in the order they were asked; thread-safe (the caller puts, the engine takes)."""

    def __init__(self) -> None:
        self._edits: deque[Edit] = deque()
        self._lock = threading.Lock()

    def put(self, edit: Edit) -> None:
        with self._lock:
            self._edits.append(edit)

    def take(self) -> list[Edit]:
        """Every queued edit, oldest first; the queue is empty afterwards."""
        with self._lock:
            edits = list(self._edits)
            self._edits.clear()
        return edits

    def __bool__(self) -> bool:
        # A racy read is fine: an edit put just after is seen at the next step.
        return bool(self._edits)
