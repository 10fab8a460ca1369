"""The engine thread: requests join and leave between steps; a backend says what a step is.

Why one thread per model: torch work from several threads at once makes their OpenMP thread teams
fight over the cores (a small CPU loses 2x and more), concurrent text streams cannot share one
batched forward, and a lock around the model serves requests strictly one after another. One
thread that owns the model fixes all three, and gives one place where priorities, cancels and
edits apply: between two steps.

Example:
    >>> class Count:                     # a toy backend: each request counts to 3
    ...     def __init__(self): self.jobs = []
    ...     def admit(self, job): self.jobs.append(job)
    ...     def has_work(self): return bool(self.jobs)
    ...     def step(self):
    ...         job = self.jobs[0]; job.append(len(job))
    ...         if len(job) == 3: self.jobs.pop(0)
    ...     def fail_all(self, exc): self.jobs.clear()
    ...     def shutdown(self): self.jobs.clear()
    >>> engine = Engine(Count(), name="toy")
    >>> job = []; engine.submit(job); engine.run_on_engine(lambda: None)
    >>> engine.close(); job
    [0, 1, 2]
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from ..errors import EngineClosedError

__all__ = ["DEFAULT_CAPACITY", "Backend", "Engine", "capacity_of"]

#: Streams one model's engine serves at once when the model says nothing else: the image model's
#: default, a server's admission for a model without ``capacity``, a Ray replica's report. (A text
#: model's capacity is its ``max_batch``, `multistream.text.DEFAULT_MAX_BATCH`.)
DEFAULT_CAPACITY = 4


def capacity_of(model: Any, default: int = DEFAULT_CAPACITY) -> int:
    """The model's ``capacity`` (streams its engine serves at once) when it has a valid one, else ``default``.

    Example:
        >>> capacity_of(object())
        4
    """
    value = getattr(model, "capacity", None)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return default

logger = logging.getLogger("multistream")


class Backend(Protocol):
    """What an engine drives. Every method is called on the engine thread only."""

    def admit(self, request: Any) -> None:
        """Take a new request; it joins the work at the next step."""

    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    def step(self) -> None:
        """Do one unit of work (one batched decode, one prefill chunk, one denoising step)."""

    def fail_all(self, exc: BaseException) -> None:
        """End every request with an error event after an unexpected fault of the engine itself."""

    def shutdown(self) -> None:
        """The engine is closing: end every request (cancelled) and free what the backend holds."""


class _Call:
    """A function to run on the engine thread between two steps, with its result as a Future."""

    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()


class Engine:
    """One long-lived thread that runs every request of one model, one step at a time.

    ``submit(request)`` hands a request to the backend at the next step boundary; ``close()``
    ends the thread after ending every request (their streams get a final ``cancelled`` event).
    An exception escaping a step is logged, fails the requests in flight, and the engine goes on
    serving new ones.
    """

    def __init__(self, backend: Backend, *, name: str, setup: Callable[[], None] | None = None) -> None:
        self.name = name
        self._backend = backend
        self._setup = setup
        self._cond = threading.Condition(threading.Lock())
        self._inbox: deque[Any] = deque()
        # 1 while a request (not a call) waits in the inbox: native code polls it part-way through a
        # step (`arrivals`), where a Python check would mean one C call per part.
        self._arrivals = ctypes.c_int32(0)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"multistream-engine-{name}", daemon=True)
        self._thread.start()
        _LIVE_ENGINES.add(self)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def arrivals(self) -> ctypes.c_int32:
        """A flag that is nonzero while a request waits to be taken (read without the lock, as
        `poll_arrivals` reads the inbox: a step that misses it sees it at its next point).

        Example:
            >>> engine.arrivals.value in (0, 1)   # doctest: +SKIP
            True
        """
        return self._arrivals

    def submit(self, request: Any) -> None:
        """Queue a request for the backend; raises `EngineClosedError` after `close()`."""
        with self._cond:
            if self._closed:
                raise EngineClosedError(
                    f"the {self.name} model was closed; load it again to start new streams"
                )
            self._inbox.append(request)
            if not isinstance(request, _Call):
                self._arrivals.value = 1
            self._cond.notify()

    def run_on_engine(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` on the engine thread between two steps and return its result (or raise)."""
        if threading.current_thread() is self._thread:
            return fn()
        call = _Call(fn)
        self.submit(call)
        return call.future.result(timeout)

    def poll_arrivals(self) -> int:
        """On the engine thread, inside a long step: admit the requests that arrived since it began.

        For backends that can start new work part-way through a step (`TextBatcher` prefills a
        newcomer between two layers of a batched decode). Function calls (`run_on_engine`) stay
        queued for the step boundary. Returns how many requests were admitted.
        """
        if not self._inbox:  # the common case, without the lock: a deque's length is safe to read
            return 0
        with self._cond:
            arrived = [item for item in self._inbox if not isinstance(item, _Call)]
            if not arrived or self._closed:
                return 0
            calls = [item for item in self._inbox if isinstance(item, _Call)]
            self._inbox.clear()
            self._inbox.extend(calls)
            self._arrivals.value = 0
        self._take(arrived)
        return len(arrived)

    def wake(self) -> None:
        """Wake an idle engine (e.g. after a request's flags changed)."""
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float | None = 10.0) -> None:
        """End every request and the thread. Safe to call twice, and from any thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        _LIVE_ENGINES.discard(self)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        if self._setup is not None:
            try:
                self._setup()
            except Exception:  # noqa: BLE001 - settings are best effort; the engine still serves
                logger.exception("engine %s: setup failed", self.name)
        backend = self._backend
        while True:
            with self._cond:
                while not self._inbox and not self._closed and not backend.has_work():
                    self._cond.wait()
                if self._closed:
                    items = list(self._inbox)
                    self._inbox.clear()
                    self._arrivals.value = 0
                    break
                items = list(self._inbox)
                self._inbox.clear()
                self._arrivals.value = 0
            self._take(items)
            items = []  # an idle engine must hold no request (nor, through it, its model)
            if backend.has_work():
                try:
                    backend.step()
                except Exception as exc:  # noqa: BLE001 - the engine must outlive any one fault
                    logger.exception("engine %s: a step failed; failing the requests in flight", self.name)
                    backend.fail_all(exc)
        # Closing: calls still get answered, requests get their final event.
        for item in items:
            if isinstance(item, _Call):
                item.future.set_exception(EngineClosedError(f"the {self.name} model was closed"))
            else:
                try:
                    backend.admit(item)
                except Exception:  # noqa: BLE001
                    logger.exception("engine %s: admitting a request while closing failed", self.name)
        try:
            backend.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("engine %s: shutdown failed", self.name)

    def _take(self, items: list[Any]) -> None:
        for item in items:
            if isinstance(item, _Call):
                try:
                    item.future.set_result(item.fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    item.future.set_exception(exc)
                continue
            try:
                self._backend.admit(item)
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop the engine
                logger.exception("engine %s: a request could not start", self.name)
                fail = getattr(item, "fail", None)
                if callable(fail):
                    fail(exc)


_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_all_engines() -> None:
    # Engine threads are daemons; one still inside a torch op when the interpreter tears down
    # aborts the process ("terminate called without an active exception"). Ending them here,
    # before finalization, lets a script that left a stream early exit with status 0.
    for engine in list(_LIVE_ENGINES):
        engine.close(timeout=30.0)
