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
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .errors import InvalidArgumentError

__all__ = ["OptionInfo", "add_cli_options", "body_fields", "cli_values", "option", "option_fields", "option_names",
           "parse_options"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """What `option()` records about one option."""

    doc: str
    check: Callable[[Any], Any] | None
    wire: Any  # the type a JSON body declares (pydantic annotation)
    body: bool  # part of the server's request bodies (False: Python-only, e.g. objects)
    body_default: Any = dataclasses.MISSING  # a JSON body's default when it differs from Python's
    bounds: tuple[tuple[str, float], ...] = ()  # JSON Schema's minimum/maximum/exclusive*: what the check enforces

    @property
    def schema_bounds(self) -> dict[str, float]:
        """The bounds as JSON Schema keywords (``{"minimum": 0, "maximum": 1}``)."""
        return dict(self.bounds)


def option(default: Any, doc: str, check: Callable[[Any], Any] | None = None, *, wire: Any = Any,
           body: bool = True, body_default: Any = dataclasses.MISSING, default_factory: Any = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> Any:
    """A dataclass field that is a user-facing option: its default, description, check and JSON type.

    ``ge``/``gt``/``le``/``lt`` declare the range the check enforces (the check keeps the message
    with the fix): the server's bodies publish them in ``/openapi.json``, and a test holds every
    check to them (tests/server/openai/test_options_openapi.py)."""
    bounds = tuple((key, value) for key, value in (("minimum", ge), ("exclusiveMinimum", gt), ("maximum", le),
                                                   ("exclusiveMaximum", lt)) if value is not None)
    info = OptionInfo(doc=doc, check=check, wire=wire, body=body, body_default=body_default, bounds=bounds)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"option": info}, hash=False)
    return dataclasses.field(default=default, metadata={"option": info})


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` declared with `option()`, in order."""
    return list(_option_fields(cls))


@functools.lru_cache(maxsize=None)
def _option_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    # Cached: every request parses its options through this (a class's fields never change).
    return tuple(f for f in dataclasses.fields(cls) if "option" in f.metadata)


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
        try:
            values[name] = check(value) if check is not None else value
        except InvalidArgumentError as exc:
            if exc.param is None:
                exc.param = name  # the option's own check: the fault is this option's, whatever the message says
            raise
    if unknown:
        if extra is None:
            reject_unknown(unknown, tuple(fields), owner)
        values[extra] = unknown
    return cls(**values)


def reject_unknown(unknown: Mapping[str, Any], known: tuple[str, ...], owner: str, *, note: str = "") -> None:
    """Raise `InvalidArgumentError` for the first of ``unknown`` (if any), naming the closest of
    ``known``; ``note`` ends the message (e.g. where other names would have gone)."""
    if not unknown:
        return
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise InvalidArgumentError(f"unknown argument {name!r} for {owner}.{hint} Known arguments: {', '.join(known)}."
                               + (f" {note}" if note else ""), param=name)


def refuse_unknown_keyword(name: str, pipeline: str | None, known: tuple[str, ...], owner: str) -> None:
    """Raise for a keyword of a diffusion model's ``stream`` that is no option (``known``) and no
    argument of its pipeline (``pipeline``: the class name; None where there is none, as in the
    scripted fakes), naming the closest option: a typo (``stepz=2``) must say ``steps``, not only
    that the pipeline lacks it.

    Example:
        >>> refuse_unknown_keyword("stepz", "AnimateDiffPipeline", ("steps", "seed"), "VideoModel.stream()")
        Traceback (most recent call last):
        ...
        multistream.errors.InvalidArgumentError: unknown argument 'stepz' for VideoModel.stream(). Did you mean 'steps'? Known arguments: steps, seed. Other names go to the pipeline, and AnimateDiffPipeline takes no 'stepz' argument.
    """
    where = f"the pipeline, and {pipeline}" if pipeline else "a pipeline, and this model has none: it"
    reject_unknown({name: None}, known, owner, note=f"Other names go to {where} takes no {name!r} argument.")


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
        out[field.name] = (meta.wire, Field(default=default, description=meta.doc,
                                            json_schema_extra=meta.schema_bounds or None))
    return out


def _cli_type(wire: Any) -> tuple[Any, bool] | None:
    """``(argparse type, repeatable)`` for an option's wire type; None: no flag (dicts, objects)."""
    args = [a for a in getattr(wire, "__args__", (wire,)) if a is not type(None)]
    if wire in (int, float, str) or (len(args) == 1 and args[0] in (int, float, str)):
        return (wire if wire in (int, float, str) else args[0]), False
    if str in args and any(getattr(a, "__origin__", None) is list for a in args):
        return str, True  # a string or a list of strings: a repeatable flag
    if set(args) == {str, int}:
        return str, False  # a word or a number ("auto" or 4): the option's check reads the digits
    return None


def add_cli_options(parser: Any, cls: type, *, names: tuple[str, ...] | None = None,
                    flags: Mapping[str, tuple[str, ...]] | None = None, exclude: tuple[str, ...] = ()) -> list[str]:
    """One ``--flag`` per option of ``cls`` (as vLLM's ``add_cli_args`` does), from its declaration:
    the help is the option's description and its Python default, so the command line can never
    disagree with the Python call. Every flag defaults to None, meaning "not given": `cli_values`
    passes only the given ones, and the Python defaults (the model's own, where they say so) apply.

    ``flags`` gives extra spellings (kept for older command lines); bool options become
    ``--name/--no-name``; dict and object options get no flag. Returns the option names added.
    """
    import argparse

    added = []
    for field in option_fields(cls):
        if (names is not None and field.name not in names) or field.name in exclude:
            continue
        meta = info(field)
        spellings = ["--" + field.name.replace("_", "-"), *(flags or {}).get(field.name, ())]
        default = field.default if field.default is not dataclasses.MISSING else None
        doc = meta.doc
        if default is None or default == ():
            shown = "" if "null" in doc else " (default: not set)"  # the doc says what null means
        else:
            shown = f" (default: {default!r})"
            # Leaving the flag out gives this default, not null (no flag value means null): the doc's
            # "; null: full size" would read "unset: full size (default: 256)".
            doc = re.sub(r"; null: [^;]*", "", doc)
        help_text = f"{doc}{shown}".replace("%", "%%").replace("null", "unset")
        wire_args = [a for a in getattr(meta.wire, "__args__", (meta.wire,)) if a is not type(None)]
        if meta.wire is bool or wire_args == [bool]:
            parser.add_argument(*spellings, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            kind = _cli_type(meta.wire)
            if kind is None:
                continue
            number, repeatable = kind
            parser.add_argument(*spellings, dest=field.name, type=number, default=None,
                                action="append" if repeatable else "store",
                                help=help_text + ("; repeatable" if repeatable else ""))
        added.append(field.name)
    return added


def cli_values(args: Any, names: list[str]) -> dict[str, Any]:
    """The options the command line was given (``add_cli_options``' flags that are not None); a
    repeatable flag given once is that string (``--allowed REGEX``, ``--stop STR``)."""
    out = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    return {k: (v[0] if isinstance(v, list) and len(v) == 1 else v) for k, v in out.items()}
