"""Requests waiting in the admission queue whose client already holds their stream id: a native SSE
request that was queued answers 200 at once with ``X-Stream-Id`` and ``X-Resume-Token``
(`native.sse.queued_sse_response`), so ``DELETE /v1/streams/{id}`` must reach it before it has a
record. `WaitingStreams` keeps them by id, with the same access rule as a stream (`SharedAccess`:
its token, or the API key that sent it); cancelling one gives up its place in the queue and ends
its response with one ``error`` event of type ``cancelled``.

Example:
    >>> waiting = WaitingStreams()
    >>> w = waiting.add("abc", "token", owner=None, owner_keyed=False, cancel=lambda: None)
    >>> waiting.find("abc", principal=None, token="token") is w, waiting.find("abc", None, "wrong")
    (True, None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .view import SharedAccess

__all__ = ["WaitingStream", "WaitingStreams"]


class WaitingStream(SharedAccess):
    """One queued request (``cancel`` stops its wait); ``cancelled`` once a client cancelled it by id.
    Only `SharedAccess.allows` is used of its base: nobody follows a stream that has not started."""

    def __init__(self, stream_id: str, token: str, owner: str | None, owner_keyed: bool,
                 cancel: Callable[[], Any]) -> None:
        self.stream_id, self.token, self.owner, self.owner_keyed = stream_id, token, owner, owner_keyed
        self._cancel = cancel
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self._cancel()


class WaitingStreams:
    """The queued requests of this server that hold a stream id, by id."""

    def __init__(self) -> None:
        self._by_id: dict[str, WaitingStream] = {}

    def add(self, stream_id: str, token: str, *, owner: str | None, owner_keyed: bool,
            cancel: Callable[[], Any]) -> WaitingStream:
        waiting = WaitingStream(stream_id, token, owner, owner_keyed, cancel)
        self._by_id[stream_id] = waiting
        return waiting

    def remove(self, stream_id: str) -> None:
        """It was admitted, refused or given up: it is no longer waiting."""
        self._by_id.pop(stream_id, None)

    def find(self, stream_id: str, principal: Any, token: str | None) -> WaitingStream | None:
        """The waiting request ``stream_id`` if ``principal`` (or ``token``) may cancel it, else None."""
        waiting = self._by_id.get(stream_id)
        return waiting if waiting is not None and waiting.allows(principal, token) else None
