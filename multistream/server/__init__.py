"""Serve streams over HTTP: SSE with resume, WebSocket, OpenAI-compatible routes, queueing, metrics.

Example:
    >>> from multistream.server import create_app, ServerSettings
    >>> from multistream.testing import ScriptedTextModel
    >>> app = create_app(text_model=ScriptedTextModel(), settings=ServerSettings(api_key="secret"))
    >>> # then: uvicorn.run(app) -- or from the shell: multistream serve --port 8000
"""

from __future__ import annotations

from .app import create_app
from .filtering import STOP, Blocklist, ContentFilter
from .metrics import Metrics
from .registry import Registry, StreamRecord
from .runner import serve, uvicorn_config
from .settings import ServerSettings
from .state import ServerState
from .websocket import decode_message, encode_image_frame

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
