"""What the scripted fakes share: argument checks that raise like the real models', a sleep a cancel
cuts short, a `Stream` whose producer thread starts once its command handler is in place, and the
counters tests read.

Example:
    >>> from multistream.testing._scripted import Counters
    >>> c = Counters(); c.enter(); c.leave("stop"); (c.active, c.started, c.finish_reasons)
    (0, 1, ['stop'])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from ..stream import Stream, StreamWriter, run_producer

__all__ = ["Counters", "pause", "prompt_text", "require", "start_stream"]


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgumentError(message)


def pause(writer: StreamWriter, seconds: float) -> None:
    """Sleep in small slices so a cancel is seen within one step."""
    end = time.perf_counter() + seconds
    while not writer.cancelled:
        left = end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.01))


def start_stream(kind: str, producer: Callable[[StreamWriter], None],
           on_command: Callable[[str, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> Stream:
    """A Stream whose producer thread starts after the command handler is in place (so a steer
    right after ``stream()`` returns is never refused)."""

    def submit(writer: StreamWriter) -> None:
        if on_command is not None:
            writer.on_command(on_command)
        threading.Thread(target=run_producer, args=(producer, writer), daemon=True,
                         name=f"multistream-scripted-{kind}-{writer.stream_id[:8]}").start()

    return Stream(submit=submit, kind=kind)


def prompt_text(prompt: str | list[dict[str, str]]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m.get("content") or "" for m in prompt)


class Counters:
    """Thread-safe bookkeeping tests read: how many streams run now and how each one ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.started = 0
        self.finish_reasons: list[str] = []

    def enter(self) -> None:
        with self._lock:
            self.active += 1
            self.started += 1

    def leave(self, reason: str) -> None:
        with self._lock:
            self.active -= 1
            self.finish_reasons.append(reason)


class CountedModel:
    """What the scripted fakes show tests of their `Counters` (``self._counters``)."""

    _counters: Counters

    @property
    def active(self) -> int:
        """Generations running right now (their producer thread has not ended)."""
        return self._counters.active

    @property
    def finish_reasons(self) -> list[str]:
        """How each generation that ended so far ended, in order."""
        return list(self._counters.finish_reasons)
