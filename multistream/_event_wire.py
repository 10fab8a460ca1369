"""An event class's wire form, compiled once per class: ``to_dict`` and ``to_json`` without a loop.

A server sends every event as JSON, so this is on the hot path of every stream: the plain way (a
loop of ``getattr`` over the dataclass fields, then ``JSONEncoder.encode``, which builds a new C
encoder for every call) cost a text event 5-15 µs, more than everything else the server does for
it but the socket write. `codec_of` writes one straight-line function per event class instead
(the way `dataclasses` writes ``__init__``): each field read once, a ``None`` left out, a value
of a plain type encoded by the one function for its type, anything else through the general
encoder. The output is byte for byte what ``json.dumps(ev.to_dict(), ensure_ascii=False,
separators=(",", ":"))`` gives.

Example:
    >>> from multistream.events import TextEvent
    >>> codec_of(TextEvent).to_json(TextEvent(stream_id="s", seq=0, t=0.5, delta="Hi"))[:40]
    '{"type":"text","stream_id":"s","seq":0,"'
"""

from __future__ import annotations

import base64
import json
import json.encoder
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["EventCodec", "codec_of"]

# The encoder the wire form is defined by (compact, non-ASCII kept): the reference for the rest.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# One C encoder for lists and dicts, made once. Without circular-reference markers it keeps no
# state between calls, so one serves every thread (`JSONEncoder.iterencode` makes a new one per call).
_C_ENCODER = (json.encoder.c_make_encoder(None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",",
                                          False, False, True)
              if json.encoder.c_make_encoder is not None else None)


def _wire_value(value: Any) -> Any:
    """A field's value as the wire dict holds it: bytes as base64, lists and dicts copied."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _json_any(value: Any) -> str:
    return _ENCODER.encode(_wire_value(value))


def _json_container(value: list[Any] | dict[str, Any]) -> str:
    if _C_ENCODER is None:  # pragma: no cover - CPython always has the C encoder
        return _ENCODER.encode(value)
    return "".join(_C_ENCODER(value, 0))


def _json_float(value: float) -> str:
    return float.__repr__(value) if math.isfinite(value) else _ENCODER.encode(value)


# Exact types only: a bool is not encoded as an int, an int subclass (an enum) takes the general path.
_JSON_OF: dict[type, Callable[[Any], str]] = {
    str: json.encoder.encode_basestring,
    int: int.__repr__,
    float: _json_float,
    bool: lambda value: "true" if value else "false",
    list: _json_container,
    dict: _json_container,
}
_PLAIN = frozenset({str, int, float, bool})  # values the wire dict holds as they are


@dataclass(frozen=True)
class EventCodec:
    """One event class's compiled ``to_dict`` and ``to_json`` (see the module docstring)."""

    to_dict: Callable[[Any], dict[str, Any]]
    to_json: Callable[[Any], str]


_CODECS: dict[type, EventCodec] = {}
_LOCK = threading.Lock()


def codec_of(cls: type) -> EventCodec:
    """The compiled wire form of the event dataclass ``cls`` (made on first use, then cached)."""
    codec = _CODECS.get(cls)
    if codec is None:
        with _LOCK:
            codec = _CODECS.get(cls)
            if codec is None:
                codec = _CODECS[cls] = _compile(cls)
    return codec


def _compile(cls: type) -> EventCodec:
    names = [f.name for f in fields(cls)]
    if any(not name.isidentifier() for name in names):  # pragma: no cover - dataclass fields always are
        raise ValueError(f"{cls.__name__} has a field that is not an identifier")
    kind = cls.type  # type: ignore[attr-defined]
    opening = '{"type":' + json.encoder.encode_basestring(kind)
    to_dict = ["def to_dict(self):", f"    wire = {{'type': {kind!r}}}"]
    to_json = ["def to_json(self):", f"    out = [{opening!r}]"]
    for name in names:
        key = "," + json.encoder.encode_basestring(name) + ":"
        to_dict += [f"    value = self.{name}",
                    "    if value is not None:",
                    f"        wire[{name!r}] = value if value.__class__ in _PLAIN else _wire_value(value)"]
        to_json += [f"    value = self.{name}",
                    "    if value is not None:",
                    f"        out.append({key!r} + _JSON_OF.get(value.__class__, _json_any)(value))"]
    to_dict.append("    return wire")
    to_json += ["    out.append('}')", "    return ''.join(out)"]
    namespace: dict[str, Any] = {"_PLAIN": _PLAIN, "_wire_value": _wire_value, "_JSON_OF": _JSON_OF,
                                 "_json_any": _json_any}
    exec("\n".join(to_dict) + "\n\n" + "\n".join(to_json), namespace)  # noqa: S102 - our own field names only
    return EventCodec(to_dict=namespace["to_dict"], to_json=namespace["to_json"])
