"""Who may do what: API keys with a priority ceiling and a quota each, stream ownership,
cross-site checks (WebSocket ``Origin``, allowed ``Host`` names), a connection cap, request ids,
and keys kept out of the logs.

Keys file (``multistream serve --keys FILE``): one key a line, then optional ``name=``,
``max_priority=`` and ``concurrency=`` settings; ``#`` starts a comment::

    s3cret-alice  name=alice  max_priority=10  concurrency=8
    s3cret-batch  name=batch  max_priority=0   concurrency=2

Where a key may come from: ``Authorization: Bearer KEY`` everywhere; ``?api_key=`` only on the
resume route ``GET /v1/streams/{id}/events`` (EventSource cannot send headers); on the WebSocket
also a ``Sec-WebSocket-Protocol`` entry ``bearer.KEY`` or a first message
``{"type": "auth", "api_key": "KEY"}``.

Example:
    >>> keys = parse_keys("k1 name=alice max_priority=3 concurrency=2\\n# comment\\nk2")
    >>> [(k.name, k.max_priority, k.concurrency) for k in keys]
    [('alice', 3, 2), ('key-2', None, None)]
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from ...errors import InvalidArgumentError
from ..http.problems import Problem
from ..settings import ServerSettings

__all__ = ["ApiKey", "Principal", "SecurityMiddleware", "install_log_redaction", "parse_keys"]

logger = logging.getLogger("multistream.server")

_OPENAI_PATHS = ("/v1/chat/", "/v1/images/", "/v1/audio/", "/v1/models", "/v1/responses", "/v1/videos")
_OPEN_PATHS = ("/healthz", "/readyz", "/", "/favicon.ico", "/static/app.js")
_RESUME = re.compile(r"^/v1/streams/[^/]+/events$")


@dataclass(frozen=True)
class ApiKey:
    """One client's key and what it may do (None: the server-wide default)."""

    key: str
    name: str
    max_priority: int | None = None
    concurrency: int | None = None


def parse_keys(text: str, source: str = "keys file") -> list[ApiKey]:
    keys: list[ApiKey] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, *opts = line.split()
        fields: dict[str, Any] = {"name": f"key-{len(keys) + 1}"}
        for opt in opts:
            name, sep, value = opt.partition("=")
            if not sep or name not in ("name", "max_priority", "concurrency"):
                raise InvalidArgumentError(f"{source} line {n}: unknown setting {opt!r}; use name=, max_priority=, "
                                           "concurrency=")
            if name == "name":
                fields[name] = value
            else:
                try:
                    fields[name] = int(value)
                except ValueError:
                    raise InvalidArgumentError(f"{source} line {n}: {name} must be an integer, got {value!r}") from None
                if fields[name] < (0 if name == "max_priority" else 1):
                    raise InvalidArgumentError(f"{source} line {n}: {name} is out of range ({value})")
        keys.append(ApiKey(key=key, **fields))
    if len({k.key for k in keys}) != len(keys):
        raise InvalidArgumentError(f"{source}: a key appears twice")
    return keys


def load_keys(settings: ServerSettings) -> list[ApiKey]:
    keys: list[ApiKey] = []
    if settings.api_key:
        keys.append(ApiKey(key=settings.api_key, name="default"))
    if settings.keys_file:
        try:
            text = Path(settings.keys_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the keys file {settings.keys_file!r}: {exc.strerror}") from None
        keys += parse_keys(text, settings.keys_file)
    return keys


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a key's name, or (on an open server) the client address."""

    id: str
    max_priority: int
    concurrency: int
    keyed: bool


class KeyRing:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.keys = load_keys(settings)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def find(self, supplied: str | bytes | None) -> ApiKey | None:
        if not supplied:
            return None
        raw = supplied.encode() if isinstance(supplied, str) else supplied
        found = None
        for k in self.keys:  # compare with every key, so timing says nothing about which matched
            if hmac.compare_digest(raw, k.key.encode()):
                found = k
        return found

    def principal(self, key: ApiKey | None, client: str | None) -> Principal:
        s = self.settings
        if key is not None:
            return Principal(f"key:{key.name}", s.max_priority if key.max_priority is None else key.max_priority,
                             s.client_concurrency if key.concurrency is None else key.concurrency, True)
        return Principal(f"addr:{client or 'unknown'}", s.max_priority, s.client_concurrency, False)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers") or []}


def _bearer(headers: dict[bytes, bytes]) -> bytes | None:
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    return None


def _ws_protocol_key(headers: dict[bytes, bytes]) -> bytes | None:
    for proto in headers.get(b"sec-websocket-protocol", b"").split(b","):
        proto = proto.strip()
        if proto.startswith(b"bearer."):
            return proto[7:]
    return None


def _is_local(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in ("localhost",) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, host_header: str | None, settings: ServerSettings) -> bool:
    """Browsers send ``Origin`` on WebSocket handshakes; other sites' pages must not get in."""
    if not origin:
        return True  # not a browser (or a same-origin request that omits it)
    if origin in settings.allowed_origins or "*" in settings.allowed_origins:
        return True
    parts = urlsplit(origin)
    if parts.hostname is None:
        return False
    if _is_local(parts.hostname):
        return True
    return bool(host_header) and parts.netloc.lower() == host_header.lower()


class SecurityMiddleware:
    """ASGI middleware in front of every route: request id, allowed hosts, the connection cap,
    the API key (which also names the `Principal`) and the WebSocket ``Origin`` check."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, keyring: KeyRing, demo_path: str | None = None) -> None:
        self.app = app
        self.settings = settings
        self.keyring = keyring
        self.demo_path = demo_path.rstrip("/") if demo_path else None
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        headers = _headers(scope)
        path = scope.get("path", "")
        openai = path.startswith(_OPENAI_PATHS)
        host = headers.get(b"host", b"").decode("latin-1")
        if self.settings.allowed_hosts and host.split(":")[0].lower() not in self.settings.allowed_hosts \
                and host.lower() not in self.settings.allowed_hosts:
            await self._refuse(scope, receive, send, Problem(
                400, "invalid_host", f"this server does not answer to Host {host!r}; add it to allowed_hosts"), openai)
            return
        if self.active >= self.settings.max_connections:
            await self._refuse(scope, receive, send, Problem(
                503, "server_busy", f"the server has {self.active} open requests (max_connections); retry shortly",
                {"Retry-After": "2"}), openai)
            return
        key = None
        supplied = _bearer(headers)
        if supplied is None and scope["type"] == "http" and scope.get("method") == "GET" and _RESUME.match(path):
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            supplied = (query.get("api_key") or [""])[0].encode() or None
        if supplied is None and scope["type"] == "websocket":
            supplied = _ws_protocol_key(headers)
        if self.keyring.enabled:
            key = self.keyring.find(supplied)
            if key is None and not self._open(path, scope):
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

    def _open(self, path: str, scope: Scope) -> bool:
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


_SECRET_QUERY = re.compile(r"((?:api_key|token)=)[^&\s\"]*", re.IGNORECASE)


class _RedactSecrets(logging.Filter):
    """Blank ``api_key=`` and ``token=`` values in log lines (uvicorn's access log prints URLs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_SECRET_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str) and ("api_key=" in record.msg or "token=" in record.msg):
            record.msg = _SECRET_QUERY.sub(r"\1***", record.msg)
        return True


def install_log_redaction() -> None:
    for name in ("uvicorn.access", "uvicorn.error", "multistream.server"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _RedactSecrets) for f in log.filters):
            log.addFilter(_RedactSecrets())
