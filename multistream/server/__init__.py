"""Serve streams over HTTP: SSE with resume, WebSocket, OpenAI-compatible routes, queueing, metrics.

Example:
    >>> from multistream.server import create_app, ServerSettings
    >>> from multistream.testing import ScriptedTextModel
    >>> app = create_app(text_model=ScriptedTextModel(), settings=ServerSettings(api_key="secret"))
    >>> # then: uvicorn.run(app) -- or from the shell: multistream serve --port 8000
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .access.metrics import Metrics
    from .app import create_app
    from .native.websocket import decode_message, encode_image_frame
    from .runner import serve, uvicorn_config
    from .settings import ServerSettings
    from .state import ServerState
    from .streams.filtering import STOP, Blocklist, ContentFilter
    from .streams.registry import Registry, StreamRecord

# Loaded on first use: the command line reads ServerSettings (its flags) at every start, also for
# `multistream text`, and should not pay for fastapi, starlette and the routes there.
_LAZY = {
    "create_app": ".app", "STOP": ".streams.filtering", "Blocklist": ".streams.filtering", "ContentFilter": ".streams.filtering",
    "Metrics": ".access.metrics", "Registry": ".streams.registry", "StreamRecord": ".streams.registry", "serve": ".runner",
    "uvicorn_config": ".runner", "ServerSettings": ".settings", "ServerState": ".state",
    "decode_message": ".native.websocket", "encode_image_frame": ".native.websocket",
}
__all__ = [
    "STOP",
    "Blocklist",
    "ContentFilter",
    "Metrics",
    "Registry",
    "ServerSettings",
    "ServerState",
    "StreamRecord",
    "create_app",
    "decode_message",
    "encode_image_frame",
    "serve",
    "uvicorn_config",
]

__getattr__ = lazy_attributes(__name__, _LAZY, globals())
