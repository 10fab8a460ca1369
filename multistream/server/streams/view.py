"""What every reader of a stream sees of it, wherever the stream runs: `StreamView`.

Two records implement it: `StreamRecord` (the stream runs in this process, `registry`) and
`durable.event_log.RemoteRecord` (another process or a Ray replica runs it, read from the shared
log). The routes (resume, status, cancel, SSE, WebSocket) take a `StreamView`, so they work the
same on either. The methods both share by meaning (who may read it, how many may follow it) are
written once, in `SharedAccess`.

Example:
    >>> def status(view: StreamView) -> dict[str, object]:
    ...     return {"stream_id": view.stream_id, "done": view.done, "events": len(view.events)}
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from ...events import Event
from ..http.problems import Problem

__all__ = ["SharedAccess", "StreamView"]


@runtime_checkable
class StreamView(Protocol):
    """A stream as its readers see it: identity, state, its events' wire JSON, access, following."""

    stream_id: str
    kind: str
    model_name: str
    resumable: bool
    done: bool
    finish_reason: str | None
    subscribers: int
    token: str
    owner: str | None
    owner_keyed: bool

    @property
    def events(self) -> Sequence[Event | None]:
        """Its events so far (only the length is certain: ``len(events)`` is the next seq)."""
        ...

    @property
    def final(self) -> Event | None:
        """Its final event once it has ended, else None."""
        ...

    def json(self, seq: int) -> str:
        """The wire JSON of event ``seq``."""
        ...

    def allows(self, principal: Any, token: str | None) -> bool:
        """May ``principal`` (with the resume ``token``, if any) read, resume or cancel it?"""
        ...

    def check_follower_room(self) -> None:
        """Raise a 503 when it already has ``max_followers`` readers here."""
        ...

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop it (wherever it runs)."""
        ...

    def drop_subscribers(self) -> None:
        """End every reader's connection here (a drain)."""
        ...

    def subscribe(self, after: int = -1) -> AsyncIterator[Event]:
        """Its events with ``seq > after``, then the live ones, up to the final."""
        ...


class SharedAccess:
    """Access and following, the same for a local and a remote record, which set ``token``,
    ``owner``, ``owner_keyed``, ``subscribers`` and ``stream_id`` and say their ``max_followers``."""

    stream_id: str
    token: str
    owner: str | None
    owner_keyed: bool
    subscribers: int

    @property
    def max_followers(self) -> int:
        raise NotImplementedError

    def allows(self, principal: Any, token: str | None) -> bool:
        """May ``principal`` (with the resume ``token``, if any) read, resume or cancel this stream?

        With API keys: only the key that created it. Without: only whoever has its token.
        """
        if token is not None and self.token and secrets.compare_digest(token.encode(), self.token.encode()):
            return True
        if self.owner_keyed:
            return principal is not None and getattr(principal, "id", None) == self.owner
        return False

    def check_follower_room(self) -> None:
        if self.subscribers >= self.max_followers:
            raise Problem(503, "too_many_followers", f"stream {self.stream_id} already has {self.subscribers} readers "
                          "here (max_followers); retry shortly", {"Retry-After": "2"})
