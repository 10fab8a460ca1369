"""Step-level scheduling of image requests on one engine thread, with greenlets.

A diffusers pipeline call is one long loop over denoising steps. To interleave several calls on
one thread, each request's call runs in its own greenlet (a coroutine of the same OS thread): its
step callback switches back to the engine, which then picks the next request to step. So every
torch op of every request runs on the engine thread, a 4-step request finishes while a 50-step
one runs, and a higher priority takes the very next step.

Order: highest priority first; within a priority, the fewest steps left first, less two for each
step a request has waited since it last ran (so a 4-step request started while a 40-step one runs
finishes first, requests of equal length take turns, and a long request still advances when short
ones keep coming), then arrival. A request cancelled before its first step ends at once.

Batched steps: with ``max_batch > 1``, the request that comes first takes its step together with
up to ``max_batch - 1`` others of the same priority (next in the same order); their denoiser calls
of that step run as one batched call where their shapes match (`denoiser_batch`). Each request
still runs its own pipeline, scheduler, callback and previews.

Example (what `ImageModel` does):
    >>> stepper = ImageStepper()                       # doctest: +SKIP
    >>> engine = Engine(stepper, name="image-shapes")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from itertools import count
from typing import Any, Callable

from greenlet import getcurrent, greenlet

from ._denoiser_batch import Parked, call_together

__all__ = ["ImageRequest", "ImageStepper"]

logger = logging.getLogger("multistream")


_AGING = 2  # steps of priority a waiting request gains per step it waits


class _Shutdown(BaseException):
    """Thrown into a request's greenlet when the engine closes; its run ends as cancelled."""


class ImageRequest:
    """One image stream waiting for, or taking, its steps.

    ``start(yield_step)`` runs the whole request (and must emit its final event); it calls
    ``yield_step()`` between two denoising steps. ``fail(exc)`` ends it with an error event.
    """

    def __init__(self, start: Callable[[Callable[[], None]], None], fail: Callable[[BaseException], None],
                 cancel: Callable[[], None], *, priority: int = 0,
                 steps_left: Callable[[], int] | None = None, cancelled: Callable[[], bool] | None = None) -> None:
        self.start = start
        self.fail = fail
        self.cancel = cancel
        self.priority = priority
        self.steps_left = steps_left or (lambda: 0)
        self.cancelled = cancelled or (lambda: False)
        self.order = 0
        self.last_step = -1
        self.glet: greenlet | None = None


class ImageStepper:
    """The engine backend of an image model (see the module docstring)."""

    def __init__(self, max_batch: int = 1) -> None:
        self.requests: list[ImageRequest] = []
        self.max_batch = max_batch
        self._arrivals = count()
        self._now = 0  # steps taken by this engine, the clock of waiting
        self.steps = 0
        self.batched_calls = 0  # denoiser calls shared by several requests (tests, benchmarks)
        self.gathering = False  # True while a group's members run up to their denoiser calls
        self.trace: list[tuple[int, int]] | None = None  # (request order, tick); tests switch it on

    def admit(self, request: ImageRequest) -> None:
        request.order = next(self._arrivals)
        request.last_step = self._now
        self.requests.append(request)

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> None:
        for waiting in [r for r in self.requests if r.glet is None and r.cancelled()]:
            self.requests.remove(waiting)
            waiting.cancel()
        if not self.requests:
            return
        now = self._now
        ranked = sorted(self.requests, key=lambda r: (-r.priority, r.steps_left() - _AGING * (now - r.last_step), r.order))
        lead = ranked[0]
        group = [lead]
        if self.max_batch > 1 and not lead.cancelled():  # a cancelled lead ends alone, at once
            group += [r for r in ranked[1:] if r.priority == lead.priority and not r.cancelled()][: self.max_batch - 1]
        self._now = now + 1
        for req in group:
            req.last_step = now
            if self.trace is not None:
                self.trace.append((req.order, req.last_step))
        if len(group) == 1:
            self._switch(group[0])
        else:
            self._step_together(group)
        self.steps += 1

    def _step_together(self, group: list[ImageRequest]) -> None:
        """One step of every member, their denoiser calls batched (see the module docstring)."""
        parked: list[tuple[ImageRequest, Parked]] = []
        self.gathering = True
        try:
            for req in group:
                out = self._switch(req)  # runs up to its denoiser call (or yields, or ends)
                if isinstance(out, Parked):
                    parked.append((req, out))
        finally:
            self.gathering = False
        replies, shared = call_together([call for _, call in parked])
        self.batched_calls += shared
        for (req, _), reply in zip(parked, replies):
            self._switch(req, reply)  # on to its scheduler step, callback and preview

    def _switch(self, req: ImageRequest, value: Any = None) -> Any:
        """Run ``req`` until it hands control back; what it handed back (a `Parked` call or None)."""
        if req.glet is None:
            engine = getcurrent()
            req.glet = greenlet(lambda: self._run(req), parent=engine)
            req.yield_step = engine.switch  # type: ignore[attr-defined]
        try:
            return req.glet.switch(value) if value is not None else req.glet.switch()
        finally:
            if req.glet.dead:
                self.requests.remove(req)

    @staticmethod
    def _run(req: ImageRequest) -> None:
        try:
            req.start(req.yield_step)  # type: ignore[attr-defined]
        except _Shutdown:
            req.cancel()
        except BaseException as exc:  # noqa: BLE001 - one request's fault ends that request only
            logger.error("a denoising stream failed", exc_info=exc)  # image or video: one stepper
            req.fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        # A fault outside any request's greenlet; the requests themselves are intact.
        logger.error("image engine step failed: %s", exc)

    def shutdown(self) -> None:
        for req in list(self.requests):
            if req.glet is None:
                req.cancel()
            elif not req.glet.dead:
                try:
                    req.glet.throw(_Shutdown())
                except BaseException:  # noqa: BLE001
                    logger.debug("ending an image request at shutdown failed", exc_info=True)
        self.requests.clear()
