"""What the scripted fakes share: argument checks that raise like the real models', a sleep a cancel
cuts short, a `Stream` whose producer thread starts once its command handler is in place, one
thread that runs every scripted text stream of the process step by step (`scheduled_stream`, as
the real engine runs all its rows from one thread), and the counters tests read.

Example:
    >>> from multistream.testing._scripted import Counters
    >>> c = Counters(); c.enter(); c.leave("stop"); (c.active, c.started, c.finish_reasons)
    (0, 1, ['stop'])
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from ..errors import InvalidArgumentError, StreamFinishedError
from ..events import Event
from ..stream import Stream, StreamWriter, producer_ended, run_producer

__all__ = ["CountedModel", "Counters", "ScriptedDenoiser", "SteerQueue", "pause", "prompt_text", "require",
           "scheduled_stream", "start_stream"]

#: A scripted producer run by `scheduled_stream`: it yields the seconds to wait before its next step.
Steps = Generator[float, None, Any]


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


class _StepClock:
    """One thread that runs many scripted producers, each a generator of waits (`Steps`): a
    producer runs until it yields a delay, then the clock resumes it when the delay is up (or at
    once when its stream is cancelled). A thread per stream instead (``start_stream``) puts a
    waking thread per stream against the consumer's event loop for the GIL, so at hundreds of
    streams it measured the fake rather than the server (`benchmarks/sse_anchor.py`).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Steps, StreamWriter]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, steps: Steps, writer: StreamWriter) -> None:
        with self._cond:
            if self._thread is None or self._pid != os.getpid():  # first use, or a forked child (no thread)
                self._pid, self._heap = os.getpid(), []
                self._thread = threading.Thread(target=self._loop, name="multistream-scripted-clock", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (time.perf_counter(), next(self._order), steps, writer))
            self._cond.notify()
        writer.on_cancel(lambda: self._now(steps))

    def _now(self, steps: Steps) -> None:
        """A cancelled stream's producer runs at once (it sees ``cancelled`` and ends), not after its wait."""
        with self._cond:
            for i, (_, order, queued, writer) in enumerate(self._heap):
                if queued is steps:
                    self._heap[i] = (0.0, order, queued, writer)
                    heapq.heapify(self._heap)
                    self._cond.notify()
                    return

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.perf_counter():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.perf_counter())
                now = time.perf_counter()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap))
            for _, _, steps, writer in due:
                self._step(steps, writer)

    def _step(self, steps: Steps, writer: StreamWriter) -> None:
        try:
            wait = next(steps)
        except StopIteration:
            producer_ended(writer)
            return
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
            producer_ended(writer, exc)
            return
        # A cancel while this step ran found nothing queued to hurry (`_now`): the flag says it.
        due = 0.0 if writer.cancelled else time.perf_counter() + max(float(wait), 0.0)
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._order), steps, writer))


_CLOCK = _StepClock()


def scheduled_stream(kind: str, producer: Callable[[StreamWriter], Steps],
                     on_command: Callable[[str, tuple[Any, ...], dict[str, Any]], Any] | None = None) -> Stream:
    """A Stream whose producer, a generator that yields the seconds to wait between its steps, is
    run by the process's one scripted-stream thread (`_StepClock`) instead of a thread of its own.

    Example:
        >>> def two_tokens(w):
        ...     for i, piece in enumerate(["a", "b"]):
        ...         yield 0.001
        ...         w.text(piece, [i], i)
        ...     w.finish_text("", [], 2, finish_reason="length", text="ab", usage={}, metrics={})
        >>> scheduled_stream("text", two_tokens).wait().text
        'ab'
    """

    def submit(writer: StreamWriter) -> None:
        if on_command is not None:
            writer.on_command(on_command)
        _CLOCK.add(producer(writer), writer)

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


class ScriptedDenoiser(CountedModel):
    """What the scripted image and video models share: ``generate`` and the producer's bookkeeping
    around their own ``_run(writer, args, steering)``, which returns the finish reason."""

    def stream(self, prompt: str, **options: Any) -> Stream:
        raise NotImplementedError

    def _run(self, w: StreamWriter, a: dict[str, Any], steering: Any) -> str:
        """Write one generation's events; return its finish reason."""
        raise NotImplementedError

    def generate(self, prompt: str, on_event: Callable[[Event], Any] | None = None, **kwargs: Any) -> Event:
        """Stream to the end, calling ``on_event`` for each event; return the final event."""
        return self.stream(prompt, **kwargs).wait(on_event)

    def _produce(self, w: StreamWriter, a: dict[str, Any], steering: SteerQueue) -> None:
        reason = "error"
        try:
            reason = self._run(w, a, steering)
        finally:
            steering.close()
            self._counters.leave(reason)


class SteerQueue:
    """Steer commands of one scripted denoising stream: each is checked when made (`check`, the
    real model's rules) and its prompt applied from the next step (`take`); once the stream
    finished denoising (`close`), a steer raises ``finished_message``."""

    finished_message = "the stream has finished denoising; it can no longer be steered"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[str] = []
        self.applied = 0
        self.closed = False

    def check(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The new prompt ("" when the steer keeps it); raise on a command the model refuses."""
        raise NotImplementedError

    def handle(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        prompt = self.check(name, args, kwargs)
        with self._lock:
            if self.closed:
                raise StreamFinishedError(self.finished_message)
            self._queue.append(prompt)

    def take(self) -> list[str]:
        """The prompts steered since the last call, in order."""
        with self._lock:
            taken, self._queue = self._queue, []
        self.applied += len(taken)
        return [p for p in taken if p]

    def close(self) -> None:
        with self._lock:
            self.closed = True
