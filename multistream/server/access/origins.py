"""Cross-site checks: the WebSocket ``Origin`` (other sites' pages must not get in) and the
``Host`` names the server answers to (``allowed_hosts``, against DNS rebinding).

Example:
    >>> from multistream.server import ServerSettings
    >>> origin_allowed("http://localhost:5173", "127.0.0.1:8000", ServerSettings())
    True
    >>> origin_allowed("https://evil.example", "127.0.0.1:8000", ServerSettings())
    False
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from ..settings import ServerSettings

__all__ = ["host_allowed", "origin_allowed"]


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


def host_allowed(host: str, settings: ServerSettings) -> bool:
    """Whether a request's ``Host`` header (with or without its port) is one the server answers to."""
    if not settings.allowed_hosts:
        return True
    return host.split(":")[0].lower() in settings.allowed_hosts or host.lower() in settings.allowed_hosts
