"""Options declared once: dataclass fields whose metadata says what each option means.

A family declares its options as one frozen dataclass (`multistream.text.TextOptions`,
`multistream.image.ImageOptions`); each field is made with `option()`, which records the
description, the check (raw value in, normalised value out, `InvalidArgumentError` with the fix
otherwise) and the JSON type a server body declares. Everything else derives from that one
declaration: the Python entry point's checks (`parse_options`), the server's pydantic request
bodies (`body_fields`), the OpenAI conversion, the WebSocket, the Ray ingress and the fakes.
Adding an option is one field plus its implementation.

Example:
    >>> from dataclasses import dataclass
    >>> def positive(v):
    ...     if not isinstance(v, int) or v < 1:
    ...         raise InvalidArgumentError(f"n must be an integer >= 1, got {v!r}")
    ...     return v
    >>> @dataclass(frozen=True)
    ... class Demo:
    ...     n: int = option(1, "how many", positive, wire=int)
    >>> parse_options(Demo, "demo()", {"n": 3}).n
    3
    >>> parse_options(Demo, "demo()", {"nn": 3})
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: unknown argument 'nn' for demo(). Did you mean 'n'? Known arguments: n.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .errors import InvalidArgumentError

__all__ = ["OptionInfo", "body_fields", "option", "option_fields", "option_names", "parse_options"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """What `option()` records about one option."""

    doc: str
    check: Callable[[Any], Any] | None
    wire: Any  # the type a JSON body declares (pydantic annotation)
    body: bool  # part of the server's request bodies (False: Python-only, e.g. objects)
    body_default: Any = dataclasses.MISSING  # a JSON body's default when it differs from Python's


def option(default: Any, doc: str, check: Callable[[Any], Any] | None = None, *, wire: Any = Any,
           body: bool = True, body_default: Any = dataclasses.MISSING, default_factory: Any = None) -> Any:
    """A dataclass field that is a user-facing option: its default, description, check and JSON type."""
    info = OptionInfo(doc=doc, check=check, wire=wire, body=body, body_default=body_default)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"option": info}, hash=False)
    return dataclasses.field(default=default, metadata={"option": info})


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` declared with `option()`, in order."""
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata]


def option_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in option_fields(cls))


def info(field: dataclasses.Field[Any]) -> OptionInfo:
    return field.metadata["option"]  # type: ignore[no-any-return]


def parse_options(cls: type[T], owner: str, given: Mapping[str, Any], *, extra: str | None = None,
                  **fixed: Any) -> T:
    """``cls`` built from the options in ``given``, each checked by its own check.

    Unknown names raise `InvalidArgumentError` naming the closest known one, unless ``extra``
    names a field of ``cls`` that collects them (a dict: e.g. an image pipeline's own arguments).
    ``fixed`` are fields set as they are (already checked), e.g. a required prompt.
    """
    fields = {f.name: f for f in option_fields(cls)}
    values: dict[str, Any] = dict(fixed)
    unknown: dict[str, Any] = {}
    for name, value in given.items():
        field = fields.get(name)
        if field is None:
            unknown[name] = value
            continue
        check = info(field).check
        values[name] = check(value) if check is not None else value
    if unknown:
        if extra is None:
            reject_unknown(unknown, tuple(fields), owner)
        values[extra] = unknown
    return cls(**values)


def reject_unknown(unknown: Mapping[str, Any], known: tuple[str, ...], owner: str) -> None:
    if not unknown:
        return
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise InvalidArgumentError(f"unknown argument {name!r} for {owner}.{hint} Known arguments: {', '.join(known)}.")


def body_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """``{name: (annotation, pydantic Field)}`` for `pydantic.create_model`: the options a server
    body carries, with their descriptions. Defaults of None mean "the model's own default"."""
    from pydantic import Field

    out: dict[str, tuple[Any, Any]] = {}
    for field in option_fields(cls):
        meta = info(field)
        if not meta.body:
            continue
        if meta.body_default is not dataclasses.MISSING:
            default = meta.body_default
        elif field.default is not dataclasses.MISSING:
            default = field.default
        else:
            default = None
        if isinstance(default, tuple):
            default = list(default) or None
        out[field.name] = (meta.wire, Field(default=default, description=meta.doc))
    return out
