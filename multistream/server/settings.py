"""Server settings: limits, timeouts, queueing and retention, each declared once with `option()`.

Each field's declaration (default, description, check, type) is the one place that says what it
means: ``ServerSettings(...)`` checks the values with it, `from_env` reads ``MULTISTREAM_<FIELD>``
by its type, and ``multistream serve`` makes one ``--<field>`` flag per field from it
(`multistream._spec.add_cli_options`, with the description as the help).

Example:
    >>> from multistream.server import ServerSettings
    >>> s = ServerSettings(grace_period_s=5, max_new_tokens=512)
    >>> s.grace_period_s, s.max_new_tokens
    (5.0, 512)
    >>> ServerSettings(queue_size=0)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: ServerSettings.queue_size must be an integer >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from .._spec import info, option, option_fields
from ..errors import InvalidArgumentError
from ..text._options import MAX_SPECULATE

__all__ = ["ServerSettings"]


def _fail(name: str, what: str, value: Any) -> InvalidArgumentError:
    return InvalidArgumentError(f"ServerSettings.{name} must be {what}, got {value!r}", param=name)


def _seconds(name: str) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise _fail(name, "a number >= 0 (seconds)", v)
        return float(v)

    return check


def _count(name: str, minimum: int = 1, optional: bool = False) -> Callable[[Any], Optional[int]]:
    def check(v: Any) -> Optional[int]:
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise _fail(name, f"an integer >= {minimum}" + (" or None" if optional else ""), v)
        return v

    return check


def _text(name: str) -> Callable[[Any], Optional[str]]:
    def check(v: Any) -> Optional[str]:
        if v is not None and (not isinstance(v, str) or not v):
            raise _fail(name, "a non-empty string or None", v)
        return v  # type: ignore[no-any-return]

    return check


def _strings(name: str) -> Callable[[Any], tuple[str, ...]]:
    """A list of strings; a string is a comma-separated list (a flag or an environment variable)."""
    def check(v: Any) -> tuple[str, ...]:
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (tuple, list)) or not all(isinstance(i, str) for i in items):
            raise _fail(name, "a list of strings", v)
        out = tuple(part.strip() for item in items for part in item.split(",") if part.strip())
        return out

    return check


def _flag(name: str) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        if not isinstance(v, bool):
            raise _fail(name, "a bool", v)
        return v

    return check


def _speculate(v: Any) -> Union[str, int]:
    """The text family's own check (`TextOptions.speculate`): a request's values, no others."""
    from .._spec import parse_options
    from ..text._options import TextOptions

    try:
        return parse_options(TextOptions, "ServerSettings", {"speculate": v}).speculate  # type: ignore[no-any-return]
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"ServerSettings.{exc}", param="speculate") from None


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything operational about the server; every field has a production-safe default and
    says what it means in its declaration (``multistream serve --help`` prints them).

    Groups: streams (grace period, retention, timeouts), admission (concurrency per family,
    queue), per-request limits (a 4xx names the limit), security (keys, priorities, origins,
    hosts), scale-out (event log, checkpoints), the content filter, connections, request defaults
    (``speculate``) and start-up (``allow_partial``).
    """

    # Streams.
    grace_period_s: float = option(
        30.0, "how long a generation keeps running after its last client disconnected, so a reconnect can resume "
        "it; then it is cancelled (seconds)", _seconds("grace_period_s"), wire=float, body=False, ge=0)
    retention_s: float = option(300.0, "finished streams stay replayable for this long (seconds)",
                                _seconds("retention_s"), wire=float, body=False, ge=0)
    max_retained_streams: int = option(256, "finished streams kept replayable at most (oldest evicted first)",
                                       _count("max_retained_streams"), wire=int, body=False, ge=1)
    max_retained_bytes: int = option(256 * 1024 * 1024, "bytes of finished streams kept replayable at most (oldest "
                                     "evicted first)", _count("max_retained_bytes"), wire=int, body=False, ge=1)
    heartbeat_s: float = option(15.0, "SSE comment lines on idle connections every this many seconds (0 disables)",
                                _seconds("heartbeat_s"), wire=float, body=False, ge=0)
    send_timeout_s: float = option(30.0, "a client that does not take a message within this is dropped (seconds)",
                                   _seconds("send_timeout_s"), wire=float, body=False, ge=0)
    request_timeout_s: float = option(600.0, "a generation running longer is cancelled (seconds)",
                                      _seconds("request_timeout_s"), wire=float, body=False, ge=0)
    queue_timeout_s: float = option(120.0, "a request waiting longer in the queue gets 503 (seconds)",
                                    _seconds("queue_timeout_s"), wire=float, body=False, ge=0)
    cancel_timeout_s: float = option(
        10.0, "after a cancel, how long the model gets to emit its own final event before the server ends the "
        "stream itself (seconds)", _seconds("cancel_timeout_s"), wire=float, body=False, ge=0)
    shutdown_deadline_s: float = option(
        20.0, "on SIGTERM, running streams get this long to finish; the rest are cancelled (seconds)",
        _seconds("shutdown_deadline_s"), wire=float, body=False, ge=0)
    shutdown_stall_s: float = option(
        15.0, "`multistream serve`: once the streams are drained, the rest of the shutdown (connections, the "
        "event log's client, the process's threads) gets this long; then it prints where it is stuck and exits "
        "anyway (seconds; 0 waits forever)", _seconds("shutdown_stall_s"), wire=float, body=False, ge=0)
    # Admission: one concurrency setting per family (`Family.concurrency_setting`).
    text_concurrency: Optional[int] = option(
        None, "text generations running at once (unset: the model's engine capacity, its max_batch rows)",
        _count("text_concurrency", optional=True), wire=Optional[int], body=False, ge=1)
    image_concurrency: Optional[int] = option(
        None, "image generations running at once (unset: the model's engine capacity, its interleaved requests)",
        _count("image_concurrency", optional=True), wire=Optional[int], body=False, ge=1)
    speech_concurrency: Optional[int] = option(
        None, "speech streams running at once (unset: the model's capacity, streams taking turns by sentence)",
        _count("speech_concurrency", optional=True), wire=Optional[int], body=False, ge=1)
    video_concurrency: Optional[int] = option(
        None, "video generations running at once (unset: the model's engine capacity, its interleaved requests)",
        _count("video_concurrency", optional=True), wire=Optional[int], body=False, ge=1)
    queue_size: int = option(64, "requests waiting per model; beyond it, 429 with Retry-After",
                             _count("queue_size"), wire=int, body=False, ge=1)
    # Per-request limits (a 4xx names the limit).
    max_new_tokens: int = option(4096, "the most tokens a text request may ask for", _count("max_new_tokens"),
                                 wire=int, body=False, ge=1)
    default_max_new_tokens: int = option(256, "the tokens a text request gets when it does not say (at most "
                                         "max_new_tokens)", _count("default_max_new_tokens"), wire=int, body=False, ge=1)
    max_prompt_chars: int = option(100_000, "the most characters a prompt may have", _count("max_prompt_chars"),
                                   wire=int, body=False, ge=1)
    max_steps: int = option(150, "the most denoising steps an image request may ask for", _count("max_steps"),
                            wire=int, body=False, ge=1)
    max_image_side: int = option(2048, "the largest image side (or video frame side) a request may ask for (pixels)",
                                 _count("max_image_side"), wire=int, body=False, ge=1)
    max_images: int = option(4, "the most images one request may ask for", _count("max_images"), wire=int,
                             body=False, ge=1)
    max_video_frames: int = option(256, "the most frames one video request may ask for", _count("max_video_frames"),
                                   wire=int, body=False, ge=1)
    max_body_bytes: int = option(1024 * 1024, "the largest request body (bytes)", _count("max_body_bytes"), wire=int,
                                 body=False, ge=1)
    # Security.
    api_key: Optional[str] = option(
        None, "one key for everyone (unset: open); turns on stream ownership by key", _text("api_key"),
        wire=Optional[str], body=False)
    keys_file: Optional[str] = option(
        None, "a file of keys, one a line with its own priority ceiling and concurrency quota (see ApiKey.parse_file); "
        "turns on stream ownership by key", _text("keys_file"), wire=Optional[str], body=False)
    max_priority: int = option(10, "the priority ceiling of clients without a keys-file entry",
                               _count("max_priority", 0), wire=int, body=False, ge=0)
    client_concurrency: int = option(
        16, "the streams at once of a client without a keys-file entry (per client address when no key is set)",
        _count("client_concurrency"), wire=int, body=False, ge=1)
    allowed_origins: tuple[str, ...] = option(
        (), "extra browser origins allowed on the WebSocket (same origin and localhost always are); comma-separated",
        _strings("allowed_origins"), wire=Union[str, list[str]], body=False)
    allowed_hosts: tuple[str, ...] = option(
        (), "accepted Host headers (empty: any), against DNS rebinding; comma-separated", _strings("allowed_hosts"),
        wire=Union[str, list[str]], body=False)
    # The content filter.
    blocklist_file: Optional[str] = option(
        None, "words or phrases (one a line, case-insensitive) the content filter redacts from every family's input "
        "and the text output", _text("blocklist_file"), wire=Optional[str], body=False)
    filter_holdback_chars: int = option(
        32, "how much output the content filter holds back so a word split across tokens is still caught",
        _count("filter_holdback_chars", 0), wire=int, body=False, ge=0)
    # Connections.
    max_connections: int = option(512, "HTTP requests and WebSockets at once (503 + Retry-After beyond)",
                                  _count("max_connections"), wire=int, body=False, ge=1)
    header_timeout_s: float = option(10.0, "a client must send its request head within this (slowloris; seconds)",
                                     _seconds("header_timeout_s"), wire=float, body=False, ge=0)
    body_timeout_s: float = option(30.0, "a client must send its request body within this (seconds)",
                                   _seconds("body_timeout_s"), wire=float, body=False, ge=0)
    max_followers: int = option(16, "SSE/WebSocket readers per stream", _count("max_followers"), wire=int, body=False, ge=1)
    ws_max_streams: int = option(16, "streams a WebSocket may follow or have in flight at once",
                                 _count("ws_max_streams"), wire=int, body=False, ge=1)
    enable_test_hooks: bool = option(False, "test-only routes (never in production)", _flag("enable_test_hooks"),
                                     wire=bool, body=False)
    # Start-up.
    allow_partial: bool = option(
        False, "when a model fails to load, serve the models that did (/readyz says degraded and names the failed "
        "model and why) instead of exiting with status 1", _flag("allow_partial"), wire=bool, body=False)
    # Scale-out.
    event_log: Optional[str] = option(
        None, "redis://HOST:PORT/DB writes every stream's events to Redis too, so a resume works from any process and "
        "across a restart; unset or 'memory': the in-memory log only", _text("event_log"), wire=Optional[str],
        body=False)
    image_checkpoint_every: int = option(
        1, "with a Redis event log, an image stream's newest checkpoint is written every this many denoising steps, "
        "so a restarted server (or a Ray replica taking over) continues it from there",
        _count("image_checkpoint_every"), wire=int, body=False, ge=1)
    # Request defaults.
    speculate: Union[str, int] = option(
        "auto", "the lookahead of text requests that do not say (a request's own speculate wins): \"auto\", 0 (off) "
        "or an integer (drafts per step at most)", _speculate, wire=Union[str, int], body=False,
        ge=0, le=MAX_SPECULATE)

    def __post_init__(self) -> None:
        for field in option_fields(type(self)):
            check = info(field).check
            assert check is not None
            object.__setattr__(self, field.name, check(getattr(self, field.name)))
        if self.default_max_new_tokens > self.max_new_tokens:
            object.__setattr__(self, "default_max_new_tokens", self.max_new_tokens)

    def replace(self, **changes: Any) -> ServerSettings:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InvalidArgumentError(f"unknown ServerSettings field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ServerSettings:
        """Defaults, then ``MULTISTREAM_<FIELD>`` environment variables (``environ``, default
        ``os.environ``) read by each field's type, then ``overrides`` (those not None).

        Example: ``MULTISTREAM_GRACE_PERIOD_S=5 MULTISTREAM_API_KEY=secret multistream serve``.

            >>> ServerSettings.from_env({"MULTISTREAM_QUEUE_SIZE": "8"}).queue_size
            8
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in option_fields(cls):
            raw = environ.get(f"MULTISTREAM_{field.name.upper()}")
            if raw is not None:
                values[field.name] = _from_text(field.name, info(field).wire, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _from_text(name: str, wire: Any, raw: str) -> Any:
    """An environment variable's text as the field's type says (its check then reads the value)."""
    kinds = [a for a in getattr(wire, "__args__", (wire,)) if a is not type(None)]
    if kinds == [bool]:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if kinds in ([int], [float]):
        try:
            return kinds[0](raw)
        except ValueError:
            raise InvalidArgumentError(f"MULTISTREAM_{name.upper()}={raw!r} is not a number", param=name) from None
    if type(None) in getattr(wire, "__args__", ()) and not raw:
        return None  # an empty string: unset
    return raw  # a string, a comma-separated list, or "auto"/digits: the check reads them
