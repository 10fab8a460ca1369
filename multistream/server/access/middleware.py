"""The ASGI middleware in front of every route: a request id, the allowed ``Host`` names, the
connection cap, the API key (which also names the request's `Principal`) and the WebSocket
``Origin`` check. Refusals come in OpenAI's error shape on the OpenAI routes, ours elsewhere.

Example:
    >>> app.add_middleware(SecurityMiddleware, settings=settings, keyring=KeyRing(settings),
    ...                    openai_paths=("/v1/chat/completions",))   # doctest: +SKIP
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ..http.problems import Problem
from ..settings import ServerSettings
from .keys import KeyRing, supplied_key
from .origins import host_allowed, origin_allowed

__all__ = ["SecurityMiddleware"]

_OPEN_PATHS = ("/healthz", "/readyz", "/", "/favicon.ico", "/static/app.js")


class SecurityMiddleware:
    """See the module docstring. ``openai_paths``: the path prefixes whose refusals take OpenAI's
    error shape (the app derives them from the OpenAI routers, so a new endpoint is covered)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, keyring: KeyRing, demo_path: str | None = None,
                 openai_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.settings = settings
        self.keyring = keyring
        self.demo_path = demo_path.rstrip("/") if demo_path else None
        self.openai_paths = openai_paths
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        path = scope.get("path", "")
        openai = bool(self.openai_paths) and path.startswith(self.openai_paths)
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.settings):
            await self._refuse(scope, receive, send, Problem(
                400, "invalid_host", f"this server does not answer to Host {host!r}; add it to allowed_hosts"), openai)
            return
        if self.active >= self.settings.max_connections:
            await self._refuse(scope, receive, send, Problem(
                503, "server_busy", f"the server has {self.active} open requests (max_connections); retry shortly",
                {"Retry-After": "2"}), openai)
            return
        key = None
        supplied = supplied_key(scope, headers)
        if self.keyring.enabled:
            key = self.keyring.find(supplied)
            if key is None and not self._open(path):
                if scope["type"] == "websocket" and supplied is None:
                    scope["state"]["auth_pending"] = True  # may come as the first message
                else:
                    await self._refuse(scope, receive, send, Problem(
                        401, "unauthorized", "missing or wrong API key: send `Authorization: Bearer <key>`"), openai)
                    return
        client = scope.get("client")
        scope["state"]["principal"] = self.keyring.principal(key, client[0] if client else None)
        if scope["type"] == "websocket" and not origin_allowed(
                headers.get(b"origin", b"").decode("latin-1") or None, host, self.settings):
            await self._refuse(scope, receive, send, Problem(
                403, "origin_not_allowed", "this page's origin may not open the WebSocket; add it to allowed_origins"),
                openai)
            return

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        self.active += 1
        try:
            await self.app(scope, receive, send_with_id if scope["type"] == "http" else send)
        finally:
            self.active -= 1

    def _open(self, path: str) -> bool:
        if path in _OPEN_PATHS or path.startswith("/static/"):
            return True
        # The demo page has its own login (Gradio's auth with the API key as password).
        return bool(self.demo_path) and (path == self.demo_path or path.startswith(self.demo_path + "/"))

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, problem: Problem, openai: bool) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            if "websocket.http.response" in scope.get("extensions", {}):
                response = problem.response()
                await send({"type": "websocket.http.response.start", "status": problem.status,
                            "headers": response.raw_headers})
                await send({"type": "websocket.http.response.body", "body": response.body})
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": problem.type})
            return
        await problem.response(openai=openai)(scope, receive, send)
