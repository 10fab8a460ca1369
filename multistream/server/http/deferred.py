"""An ASGI app built after the server listens: the Gradio demo, whose import alone takes seconds.

`DeferredApp` is mounted like any app (``app.mount("/demo", deferred)``). Its ``build`` runs on a
daemon thread when `start` is first called (by the server once its models are loaded, or by the
first request that needs it); requests that arrive meanwhile wait for it instead of failing, so
``/healthz``, ``/readyz`` and the API answer from the first second. ``build`` returns the app to
forward to and, optionally, the async context manager of its lifespan (entered on the server's
event loop, exited by `aclose` at shutdown).

Example:
    >>> from starlette.responses import PlainTextResponse
    >>> deferred = DeferredApp(lambda: (PlainTextResponse("built"), None), name="greeting")
    >>> deferred.built
    False
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .problems import Problem

__all__ = ["DeferredApp"]

logger = logging.getLogger("multistream.server")

Build = Callable[[], "tuple[ASGIApp, contextlib.AbstractAsyncContextManager[Any] | None]"]


class DeferredApp:
    """An ASGI app whose (slow) construction starts after the server is up; see the module docstring."""

    def __init__(self, build: Build, name: str) -> None:
        self.name = name
        self._build = build
        self._app: ASGIApp | None = None
        self._failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._lifespans = contextlib.AsyncExitStack()
        self._started = False
        self._finishing: asyncio.Task[None] | None = None

    @property
    def built(self) -> bool:
        return self._app is not None

    @property
    def started(self) -> bool:
        """The build began (by `start`, or by a request that needed the app)."""
        return self._started

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the server's event loop (its lifespan calls this before serving)."""
        self._loop = loop
        self._done = asyncio.Event()

    def start(self) -> None:
        """Begin building, once; safe from any thread once `attach` ran."""
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"{self.name}: attach() the server's event loop before start()")
        if not _in_loop(loop):  # another thread: hop onto the loop
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is shutting down
                loop.call_soon_threadsafe(self.start)
            return
        if self._started:
            return
        self._started = True
        future: asyncio.Future[Any] = loop.create_future()

        def build() -> None:
            # A daemon thread, not the default executor: an executor's threads are joined at
            # interpreter exit, so Ctrl-C during the build would wait for it to finish.
            try:
                result = self._build()
            except BaseException as exc:  # noqa: BLE001 - reported on the loop, logged there
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, future, result, None)

        threading.Thread(target=build, name=f"multistream-build-{self.name}", daemon=True).start()
        self._finishing = loop.create_task(self._finish(future))

    async def _finish(self, future: asyncio.Future[Any]) -> None:
        assert self._done is not None
        try:
            app, lifespan = await future
            if lifespan is not None:
                await self._lifespans.enter_async_context(lifespan)
            self._app = app
            logger.info("%s is ready", self.name)
        except asyncio.CancelledError:
            self._failure = "the server shut down before it was built"
            raise
        except Exception as exc:  # noqa: BLE001 - the rest of the server keeps serving
            self._failure = f"{type(exc).__name__}: {exc}"
            logger.error("%s failed to start: %s", self.name, self._failure, exc_info=exc)
        finally:
            self._done.set()

    async def aclose(self) -> None:
        """Run the built app's lifespan exit (the server's shutdown calls this); a build still
        running is abandoned (its daemon thread ends with the process)."""
        if self._finishing is not None and not self._finishing.done():
            self._finishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._finishing
        await self._lifespans.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            if self._done is None:
                raise RuntimeError(f"{self.name} is served before the server's lifespan attached it")
            self.start()
            await self._done.wait()
        if self._app is None:
            problem = Problem(503, "unavailable", f"the {self.name} failed to start ({self._failure}); "
                              "the server log has the details, the API is unaffected")
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1011, "reason": problem.message[:120]})
                return
            await problem.response()(scope, receive, send)
            return
        await self._app(scope, receive, send)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
