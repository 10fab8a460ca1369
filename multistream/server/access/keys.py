"""API keys: who a request comes from, with a priority ceiling and a quota per key.

Keys file (``multistream serve --keys FILE``): one key a line, then optional ``name=`` (each key's
own: the name owns its streams, quota and prompt cache; default ``key-N`` for the Nth key),
``max_priority=`` and ``concurrency=`` settings; ``#`` starts a comment::

    s3cret-alice  name=alice  max_priority=10  concurrency=8
    s3cret-batch  name=batch  max_priority=0   concurrency=2

Where a key may come from (`supplied_key`): ``Authorization: Bearer KEY`` everywhere; ``?api_key=``
only on the resume route ``GET /v1/streams/{id}/events`` (EventSource cannot send headers); on the
WebSocket also a ``Sec-WebSocket-Protocol`` entry ``bearer.KEY`` (or, checked by the WebSocket
route, a first message ``{"type": "auth", "api_key": "KEY"}``).

Example:
    >>> keys = parse_keys("k1 name=alice max_priority=3 concurrency=2\\n# comment\\nk2")
    >>> [(k.name, k.max_priority, k.concurrency) for k in keys]
    [('alice', 3, 2), ('key-2', None, None)]
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.types import Scope

from ...errors import InvalidArgumentError
from ..settings import ServerSettings

__all__ = ["ApiKey", "KeyRing", "Principal", "load_keys", "parse_keys", "supplied_key"]

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
    # A key's name is who it is to the server (stream ownership, quota, prompt cache salt): two keys
    # of one name would read and cancel each other's streams.
    names = [k.name for k in keys]
    shared = sorted({n for n in names if names.count(n) > 1})
    if shared:
        raise InvalidArgumentError(f"{source}: two keys are named {shared[0]!r} (a name may be given, or is "
                                   "key-N for the Nth key); give each key its own name=")
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


def supplied_key(scope: Scope, headers: dict[bytes, bytes]) -> bytes | None:
    """The key a request carries, wherever it may come from (see the module docstring), or None."""
    supplied = _bearer(headers)
    path = scope.get("path", "")
    if supplied is None and scope["type"] == "http" and scope.get("method") == "GET" and _RESUME.match(path):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        supplied = (query.get("api_key") or [""])[0].encode() or None
    if supplied is None and scope["type"] == "websocket":
        supplied = _ws_protocol_key(headers)
    return supplied


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
