"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

The first signal stops admitting (new generation requests get 503, the socket stays open so
clients hear why), lets running streams finish up to ``shutdown_deadline_s``, cancels the rest
(each ends with a final ``cancelled`` event; with a Redis event log those another server can
continue are handed off instead, unfinished, for the next server on the log: see
`multistream.server.durable.continuation`), then stops the server. With streams running, it says
so in one line (how many, for how long, and that a second Ctrl-C stops now).

A second signal stops at once: every running stream ends with a final ``cancelled`` event (no
deadline, no hand-off), the connections get about a second to send it, and `serve` returns
128 + the signal's number (130 for Ctrl-C, as a shell reports an interrupted command), quietly:
one line says so, and the CancelledError tracebacks of what it cancelled are not logged. A third
signal stops waiting even for that (uvicorn's force exit: no app shutdown), as quietly.

Once the streams are drained, `multistream serve` gives the rest of the shutdown (closing the
connections, the event log's Redis client, the interpreter's wait for its threads)
``shutdown_stall_s``; a shutdown still under way then prints which threads still run and where
each one is, and the process exits anyway with the status it would have had
(`_exit_if_stalled`). A library's teardown that never returns would otherwise hold a redeploy
until the orchestrator's SIGKILL, with nothing in the log to say why.

A model that fails to load stops the server at once (`serve` returns 1, as vLLM exits at start-up),
with the reason and its fix in the log; with ``ServerSettings.allow_partial`` the server keeps
serving the models that loaded (and exits only when none did).

Example:
    >>> from multistream.server import create_app, serve
    >>> serve(create_app("default"), host="127.0.0.1", port=8000)   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from .._gc import paused as collector_paused
from .collector import ServingCollector

try:  # uvicorn's C parser (httptools): several times cheaper per request and per SSE chunk than h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpProtocol
except ImportError:  # pragma: no cover - httptools not installed: the pure-Python h11
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HttpProtocol  # type: ignore[assignment]

__all__ = ["DrainingServer", "serve", "uvicorn_config"]

logger = logging.getLogger("multistream.server")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the multistream app before stopping, and
    whose second stops it at once (see the module docstring). ``say`` prints the line that tells
    the operator what a signal does (default: the log, at warning level); ``exit_status`` is 0
    until a second signal sets it.

    Example:
        >>> server = DrainingServer(uvicorn_config(app), say=print)   # doctest: +SKIP
        >>> server.run(); server.exit_status                          # doctest: +SKIP
        130
    """

    def __init__(self, config: uvicorn.Config, say: Callable[[str], Any] | None = None,
                 exit_if_stalled_s: float | None = None) -> None:
        super().__init__(config)
        self.say = say or logger.warning
        self.exit_if_stalled_s = exit_if_stalled_s  # `_exit_if_stalled` once shutting down (the CLI's server)
        self.exit_status = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.failed_models: dict[str, str] = {}
        self._settled = False  # every model loaded or failed, and said so
        self.collector: ServingCollector | None = None  # started once the models have settled

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self._watcher = self._loop.create_task(self._watch_loading())

    async def _watch_loading(self) -> None:
        """Until every model has settled: a failed one ends the server (unless partial is allowed)."""
        while not self.should_exit:
            if self._check_loading(_find_state(self.config.loaded_app)):
                return
            await asyncio.sleep(0.1)

    def _check_loading(self, state: Any) -> bool:
        """Whether the models have settled (then said once: "serving degraded" where one failed),
        or one failed and the server must exit; False while any is still loading."""
        if state is None:
            return False
        if self._settled:
            return True
        slots = state.models.values()
        failed = state.failed
        # Settled once every load is over and so is their collector pause (`multistream._gc`):
        # start-up's objects are collected and frozen after it, never during it.
        settled = not any(s.state in ("pending", "loading") for s in slots) and not collector_paused()
        nothing_loaded = settled and not any(s.state == "ready" for s in slots)
        if failed and (not state.settings.allow_partial or nothing_loaded):
            self.failed_models = failed
            for reason in failed.values():
                logger.error("%s", reason)
            logger.error("exiting with status 1: %s", "no model loaded" if state.settings.allow_partial
                         else "a model failed to load (--allow-partial serves the models that loaded)")
            self.should_exit = True
            return True
        if not settled:
            return False
        self._settled = True
        if failed:
            logger.warning("serving degraded: %s", "; ".join(failed.values()))
        _freeze_startup_objects()
        if self._loop is not None:  # from now on, collections wait for a moment without live streams
            registry = state.registry
            self.collector = ServingCollector(lambda: registry.idle_for(0.02))
            self.collector.start(self._loop)
        return True

    @property
    def exit_code(self) -> int:
        """What `serve` returns: 1 when a model failed to load, else ``exit_status``."""
        return 1 if self.failed_models else self.exit_status

    async def shutdown(self, sockets: Any = None) -> None:
        if self.exit_if_stalled_s:
            _exit_if_stalled(self.exit_if_stalled_s, lambda: self.exit_code)
        await super().shutdown(sockets)

    async def serve(self, sockets: Any = None) -> None:
        try:
            await super().serve(sockets)
        finally:  # `run` comes here too (asyncio.run(self.serve())), and so does ``await server.serve()``
            if self.collector is not None:
                self.collector.stop()

    def run(self, sockets: Any = None) -> None:
        try:
            super().run(sockets)
        finally:  # after asyncio.run has cancelled what was left: its tracebacks are filtered till then
            _UVICORN_LOG.removeFilter(_drop_cancelled)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only sets flags and hands the work to the loop. Printing from here
        # could cut into a line the main thread is writing.
        state = _find_state(self.config.loaded_app)
        if state is None or self._loop is None:  # before the app started: nothing to drain
            self.should_exit = True
            return
        if self.exit_status:  # a third signal: stop waiting for connections and the app's shutdown
            self.force_exit = True
            return
        if self._draining:
            self.exit_status = 128 + int(sig)
            self.should_exit = True
            self._loop.call_soon_threadsafe(self._stop_now, state)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._drain, state, sig)

    def _drain(self, state: Any, sig: int) -> None:
        running = state.registry.active()
        logger.info("signal %s: draining before shutdown", sig)
        if running:
            self.say(_drain_notice(running, state.settings.shutdown_deadline_s, sig))

        def stop() -> None:
            # A signal within a poll of the models settling: the settled server's report still comes.
            self._check_loading(state)
            self.should_exit = True

        state.begin_drain(on_drained=stop)

    def _stop_now(self, state: Any) -> None:
        # What is cancelled from here on (a connection that does not end in time, the app's tasks
        # at the loop's end) is cancelled on purpose: uvicorn would log each as a traceback.
        _UVICORN_LOG.addFilter(_drop_cancelled)
        # The streams' finals are written at once; a second is plenty to send them.
        timeout = self.config.timeout_graceful_shutdown
        self.config.timeout_graceful_shutdown = 1 if timeout is None else min(timeout, 1)
        cancelled = state.stop_now()
        self.say(f"stopping now; {_streams(cancelled)} cancelled" if cancelled else "stopping now")


def _exit_if_stalled(after_s: float, exit_code: Callable[[], int]) -> threading.Thread:
    """Exit the process ``after_s`` seconds from now unless it has ended by then, first printing to
    stderr the threads still running and every thread's stack (`faulthandler`). A daemon thread:
    a process that ends in time ends with it. Only for a process that is the server (the CLI's):
    it exits with ``os._exit(exit_code())``.

    Example:
        >>> _exit_if_stalled(15.0, lambda: 0)   # doctest: +SKIP
    """

    def watch() -> None:
        time.sleep(after_s)
        # No logging: a stuck thread may hold the logging lock. The stderr descriptor itself.
        running = ", ".join(t.name for t in threading.enumerate()
                            if not t.daemon and t is not threading.main_thread()) or "none"
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.write(2, (f"multistream serve: the shutdown is still under way {after_s:g} s after the streams were "
                     f"drained (threads still running besides the main one: {running}); exiting anyway. "
                     "Where each thread is:\n").encode())
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(2, all_threads=True)
        os._exit(exit_code())

    watcher = threading.Thread(target=watch, name="multistream-shutdown-watch", daemon=True)
    watcher.start()
    return watcher


def _streams(n: int) -> str:
    return f"{n} running stream{'' if n == 1 else 's'}"


def _drain_notice(running: int, deadline_s: float, sig: int) -> str:
    """The line the first signal prints while streams run.

    Example:
        >>> _drain_notice(2, 20.0, signal.SIGINT)
        'stopping; waiting up to 20 s for 2 running streams to finish (Ctrl-C again to stop now)'
    """
    again = "Ctrl-C again" if sig == signal.SIGINT else "a second signal"
    if deadline_s <= 0:
        return f"stopping; cancelling {_streams(running)} ({again} to stop without waiting for them)"
    return f"stopping; waiting up to {deadline_s:g} s for {_streams(running)} to finish ({again} to stop now)"


_UVICORN_LOG = logging.getLogger("uvicorn.error")


def _drop_cancelled(record: logging.LogRecord) -> bool:
    """A logging filter: False for a CancelledError's traceback, as uvicorn logs it for a request
    (``exc_info``) or starlette's lifespan hands it over (the formatted text)."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, asyncio.CancelledError):
        return False
    return not str(record.msg).rstrip().endswith("CancelledError")


def _freeze_startup_objects() -> None:
    """Once the models are loaded: move what start-up made (modules, the models' weights and
    tokenizers, the app) out of the garbage collector's sight, as gunicorn and Instagram do
    (`gc.freeze`). A full collection then walks only what serving made, so its pauses (measured:
    up to 0.1 s on the event loop at 200 SSE clients of the scripted model) stop landing on
    streams' first tokens.

    It freezes without a collection first, as Python's documentation of `gc.freeze` does before a
    fork: with the four embedded models loaded the walk took 0.33-0.48 s on the event loop, and
    ``/readyz`` waited behind it, for about 14,000 unreachable objects (the resident size did not
    move when they were freed). They stay set aside with the rest."""
    gc.freeze()


def _find_state(app: Any) -> Any:
    """Find the multistream ServerState under uvicorn's middleware wrappers."""
    seen = 0
    while app is not None and seen < 10:
        state = getattr(getattr(app, "state", None), "multistream", None)
        if state is not None:
            return state
        app = getattr(app, "app", None)
        seen += 1
    return None


class _HeadTimeoutProtocol(_HttpProtocol):  # type: ignore[valid-type,misc]
    """uvicorn's HTTP protocol (httptools, else h11) with a deadline for the request head: a
    client that trickles its headers (slowloris) is disconnected after ``header_timeout_s``
    instead of holding a connection forever."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None and self.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head():
            self.transport.close()

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm_head_timer()
        super().data_received(data)
        if not self._waiting_for_head() and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def uvicorn_config(app: Any, settings: Any = None, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config with the server's connection limits: ``limit_concurrency`` (a hard cap
    above the app's own 503 at ``max_connections``), a request-head deadline, WebSocket messages
    no bigger than ``max_body_bytes``."""
    if settings is None:
        settings = _find_settings(app)
    protocol = type("HeadTimeoutProtocol", (_HeadTimeoutProtocol,), {"header_timeout_s": settings.header_timeout_s})
    kwargs.setdefault("timeout_graceful_shutdown", 5)
    return uvicorn.Config(app, http=protocol, limit_concurrency=settings.max_connections + 64,
                          ws_max_size=settings.max_body_bytes + 1024, timeout_keep_alive=5, **kwargs)


def _find_settings(app: Any) -> Any:
    settings = getattr(app, "multistream_settings", None)
    if settings is None:
        from .settings import ServerSettings

        settings = ServerSettings()
    return settings


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          say: Callable[[str], Any] | None = None, exit_if_stalled: bool = False, **uvicorn_kwargs: Any) -> int:
    """Run ``app`` until SIGTERM/SIGINT, draining streams first (see the module docstring).

    Returns the process's exit status: 0; 1 when a model failed to load (see ``allow_partial``);
    128 + the signal's number (130 for Ctrl-C) when a second signal stopped it at once. ``say``
    prints what a signal does, one line (default: the log, at warning level). With
    ``exit_if_stalled`` (the CLI's: the process is the server), a shutdown that takes longer than
    the settings' ``shutdown_stall_s`` after the drain ends the process (`_exit_if_stalled`)."""
    state = getattr(app, "state", None)
    if state is not None:  # the models' load pause ends without a walk: `_freeze_startup_objects` freezes start-up
        state.runner_freezes_startup = True
    config = uvicorn_config(app, host=host, port=port, log_level=log_level, **uvicorn_kwargs)
    stall_s = _find_settings(app).shutdown_stall_s if exit_if_stalled else 0
    server = DrainingServer(config, say=say, exit_if_stalled_s=stall_s or None)
    with _multistream_log_like_uvicorns(log_level):
        server.run()
    return server.exit_code


_LOG_LOCK = threading.Lock()
_log_users = 0  # serve() calls running with the handler below attached
_log_restore: tuple[logging.Handler, int] | None = None


@contextlib.contextmanager
def _multistream_log_like_uvicorns(log_level: str | int) -> Iterator[None]:
    """While the server runs, multistream's own log lines ("text model ... is ready (loaded in
    6.2 s)", "serving degraded", what a signal does) go to stderr at ``log_level`` in uvicorn's
    format, beside its lines, when nobody configured logging: until now the INFO lines were
    dropped and the errors came through Python's last-resort handler without a level. Logging a
    caller configured (a handler on the root logger, ``multistream`` or any ``multistream.*``
    logger) is left as it is. Servers run at once in one process share the one handler."""
    global _log_users, _log_restore
    with _LOG_LOCK:
        if _log_users == 0 and _logging_configured():
            attached = False
        else:
            attached = True
            if _log_users == 0:
                from uvicorn.logging import DefaultFormatter

                log = logging.getLogger("multistream")
                handler = logging.StreamHandler()
                handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
                _log_restore = (handler, log.level)
                log.addHandler(handler)
                log.setLevel(logging.getLevelName(log_level.upper()) if isinstance(log_level, str) else log_level)
            _log_users += 1
    try:
        yield
    finally:
        if attached:
            with _LOG_LOCK:
                _log_users -= 1
                if _log_users == 0 and _log_restore is not None:
                    handler, level = _log_restore
                    log = logging.getLogger("multistream")
                    log.removeHandler(handler)
                    log.setLevel(level)
                    _log_restore = None


def _logging_configured() -> bool:
    """Whether a handler sits on the root logger or on any ``multistream`` logger."""
    if logging.getLogger().handlers:
        return True
    loggers = logging.Logger.manager.loggerDict
    return any(isinstance(lg, logging.Logger) and lg.handlers and (name == "multistream" or name.startswith("multistream."))
               for name, lg in list(loggers.items()))
