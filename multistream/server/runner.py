"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT.

The first signal stops admitting (new generation requests get 503, the socket stays open so
clients hear why), lets running streams finish up to ``shutdown_deadline_s``, cancels the rest
(each ends with a final ``cancelled`` event), then stops the server. A second signal exits at once.

Example:
    >>> from multistream.server import create_app, serve
    >>> serve(create_app("default"), host="127.0.0.1", port=8000)   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType
from typing import Any

import uvicorn

__all__ = ["DrainingServer", "serve"]

logger = logging.getLogger("multistream.server")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the multistream app before stopping."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = _find_state(self.config.loaded_app)
        if self._draining or state is None or self._loop is None:
            self.should_exit = True
            if self._draining:
                self.force_exit = True
            return
        self._draining = True
        logger.info("signal %s: draining before shutdown", sig)

        def stop() -> None:
            self.should_exit = True

        self._loop.call_soon_threadsafe(lambda: state.begin_drain(on_drained=stop))


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


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **uvicorn_kwargs: Any) -> None:
    """Run ``app`` until SIGTERM/SIGINT, draining streams first (see the module docstring)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            **uvicorn_kwargs)
    DrainingServer(config).run()
