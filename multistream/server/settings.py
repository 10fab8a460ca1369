"""Server settings: limits, timeouts, queueing and retention, with validation.

Example:
    >>> from multistream.server import ServerSettings
    >>> s = ServerSettings(grace_period_s=5, max_new_tokens=512)
    >>> s.grace_period_s, s.max_new_tokens
    (5.0, 512)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["ServerSettings"]


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything operational about the server; every field has a production-safe default.

    Streams:
        grace_period_s: how long a generation keeps running after its last client disconnected,
            so a reconnect can resume it; then it is cancelled.
        retention_s / max_retained_streams / max_retained_bytes: finished streams stay replayable
            for this long, bounded in count and bytes (oldest evicted first).
        heartbeat_s: SSE comment lines on idle connections (0 disables).
        send_timeout_s: a client that does not take a message within this is dropped.
        request_timeout_s: a generation running longer is cancelled.
        queue_timeout_s: a request waiting longer in the queue gets 503.
        cancel_timeout_s: after a cancel, how long the model gets to emit its own final event
            before the server ends the stream itself.
        shutdown_deadline_s: on SIGTERM, running streams get this long to finish; the rest are
            cancelled.
    Admission:
        text_concurrency / image_concurrency / speech_concurrency: generations running at once per
            model, one setting per family (None: the model's engine capacity, ``model.capacity``: a
            text model's ``max_batch`` rows, an image model's interleaved requests, a speech
            model's streams taking turns by sentence).
        queue_size: requests waiting per model; beyond it, 429 with Retry-After.
    Per-request limits (a 4xx names the limit): max_new_tokens, default_max_new_tokens,
        max_prompt_chars, max_steps, max_image_side, max_images, max_body_bytes.
    Security:
        api_key: one key for everyone (None: open); keys_file: one key a line with its own priority
            ceiling and concurrency quota (see `ApiKey.parse_file`); either turns on stream
            ownership by key. max_priority / client_concurrency: the ceiling and quota of
            clients without a keys-file entry (per client address when no key is set).
        allowed_origins: extra browser origins allowed on the WebSocket (same origin and
            localhost always are); allowed_hosts: accepted ``Host`` headers (empty: any),
            against DNS rebinding.
    Scale-out:
        event_log: ``redis://HOST:PORT/DB`` writes every stream's events to Redis too, so a resume
            works from any process and across a restart (see `multistream.server.durable.event_log`);
            None or ``"memory"``: the in-memory log only (the default).
        image_checkpoint_every: with a Redis event log, an image stream's newest checkpoint is
            written to Redis every this many denoising steps, so a restarted server (or a Ray
            replica taking over) continues it from there (see `multistream.server.durable.continuation`).
        blocklist_file: words or phrases (one a line, case-insensitive) the content filter
            redacts from prompts and outputs; filter_holdback_chars: how much output the content
            filter holds back so a word split across tokens is still caught.
    Connections:
        max_connections: HTTP requests and WebSockets at once (503 + Retry-After beyond);
            header_timeout_s / body_timeout_s: a client must send its request head / body within
            these (slowloris); max_followers: SSE/WebSocket readers per stream;
        ws_max_streams: streams a WebSocket may follow or have in flight at once.
    Request defaults:
        speculate: the text requests' lookahead when a request does not say (its own
            ``speculate`` wins): "auto", 0 (off) or an integer (drafts per step at most), checked as
            `TextOptions.speculate` is.
    Start-up:
        allow_partial: when a model fails to load, serve the models that did (``/readyz`` says
            ``"degraded"`` and names the failed model and why) instead of exiting with status 1.
    """

    grace_period_s: float = 30.0
    retention_s: float = 300.0
    max_retained_streams: int = 256
    max_retained_bytes: int = 256 * 1024 * 1024
    heartbeat_s: float = 15.0
    send_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    queue_timeout_s: float = 120.0
    cancel_timeout_s: float = 10.0
    shutdown_deadline_s: float = 20.0
    text_concurrency: int | None = None
    image_concurrency: int | None = None
    speech_concurrency: int | None = None
    queue_size: int = 64
    max_new_tokens: int = 4096
    default_max_new_tokens: int = 256
    max_prompt_chars: int = 100_000
    max_steps: int = 150
    max_image_side: int = 2048
    max_images: int = 4
    max_body_bytes: int = 1024 * 1024
    api_key: str | None = None
    keys_file: str | None = None
    max_priority: int = 10
    client_concurrency: int = 16
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    blocklist_file: str | None = None
    filter_holdback_chars: int = 32
    max_connections: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_followers: int = 16
    ws_max_streams: int = 16
    enable_test_hooks: bool = False
    allow_partial: bool = False
    event_log: str | None = None
    image_checkpoint_every: int = 1
    speculate: str | int = "auto"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("api_key", "keys_file", "blocklist_file", "event_log"):
                if value is not None and (not isinstance(value, str) or not value):
                    raise InvalidArgumentError(f"ServerSettings.{f.name} must be a non-empty string or None")
                continue
            if f.name == "speculate":  # the text family's own check: the same values as a request's
                from .._spec import parse_options
                from ..text._options import TextOptions

                try:
                    checked = parse_options(TextOptions, "ServerSettings", {"speculate": value}).speculate
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"ServerSettings.{exc}", param="speculate") from None
                object.__setattr__(self, f.name, checked)
                continue
            if f.name in ("allowed_origins", "allowed_hosts"):
                if isinstance(value, str):
                    value = tuple(v.strip() for v in value.split(",") if v.strip())
                if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
                    raise InvalidArgumentError(f"ServerSettings.{f.name} must be a list of strings, got {value!r}")
                object.__setattr__(self, f.name, tuple(value))
                continue
            if f.name.endswith("_concurrency") and f.name != "client_concurrency" and value is None:
                continue
            if f.name in ("max_priority", "filter_holdback_chars"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgumentError(f"ServerSettings.{f.name} must be an integer >= 0, got {value!r}")
                continue
            if f.name in ("enable_test_hooks", "allow_partial"):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"ServerSettings.{f.name} must be a bool")
                continue
            if f.type in ("float",) or f.name.endswith("_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise InvalidArgumentError(f"ServerSettings.{f.name} must be a number >= 0 (seconds), got {value!r}")
                object.__setattr__(self, f.name, float(value))
            else:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidArgumentError(f"ServerSettings.{f.name} must be an integer >= 1, got {value!r}")
        if self.default_max_new_tokens > self.max_new_tokens:
            object.__setattr__(self, "default_max_new_tokens", self.max_new_tokens)

    def replace(self, **changes: Any) -> ServerSettings:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InvalidArgumentError(f"unknown ServerSettings field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, **overrides: Any) -> ServerSettings:
        """Defaults, then ``MULTISTREAM_<FIELD>`` environment variables, then ``overrides``.

        Example: ``MULTISTREAM_GRACE_PERIOD_S=5 MULTISTREAM_API_KEY=secret multistream serve``.
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"MULTISTREAM_{f.name.upper()}")
            if raw is None:
                continue
            if f.name in ("api_key", "keys_file", "blocklist_file", "event_log"):
                values[f.name] = raw or None
            elif f.name == "speculate":
                values[f.name] = raw  # "auto" or digits: the check reads them
            elif f.name in ("allowed_origins", "allowed_hosts"):
                values[f.name] = raw
            elif f.name in ("enable_test_hooks", "allow_partial"):
                values[f.name] = raw.lower() in ("1", "true", "yes")
            else:
                try:
                    values[f.name] = float(raw) if f.name.endswith("_s") else int(raw)
                except ValueError:
                    raise InvalidArgumentError(f"MULTISTREAM_{f.name.upper()}={raw!r} is not a number") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
