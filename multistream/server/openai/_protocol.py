"""What the OpenAI bodies share: `StreamOptions`, the namesake fields built from a family's options
(`option_fields`), the chat messages' conversion (`chat_messages`) and the text options' checks
(`check_options`).

Example:
    >>> chat_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    [{'role': 'user', 'content': 'hi'}]
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field

from ..._spec import body_fields
from ...errors import InvalidArgumentError
from ...text import check_role
from ..bodies import check_family_options
from ..http.bodies import STRICT_BODY
from ..http.problems import Problem
from ..settings import ServerSettings


class StreamOptions(BaseModel):
    model_config = STRICT_BODY
    include_usage: Optional[bool] = Field(default=None, description="true: a last chunk carries the usage")
    include_obfuscation: Optional[bool] = Field(default=None, description="accepted and ignored")
    continuous_usage_stats: Optional[bool] = Field(default=None, description="vLLM's: every chunk carries the "
                                                   "usage so far")


def option_fields(options: type, names: tuple[str, ...], extensions: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{name: (annotation, Field)}`` for `pydantic.create_model`: the ``names`` of the options
    class ``options`` as an OpenAI body's fields, each with the spec's type, default, bounds and
    description (``extensions``, fields OpenAI's own body lacks, marked as such). Each takes null
    too (OpenAI clients send it for "not given"), except priority (an integer). Read the values a
    client gave with `given_options`, so an option left out keeps the model's (or the server's)
    default.

    Example:
        >>> from multistream.speech import SpeechOptions
        >>> option_fields(SpeechOptions, ("speed",))["speed"][1].default
        1.0
    """
    out: dict[str, Any] = {}
    for name, (wire, field) in body_fields(options).items():
        if name not in names:
            continue
        doc = ("extension: " if name in extensions else "") + (field.description or "")
        out[name] = (wire if name == "priority" else Optional[wire],
                     Field(default=field.default, description=doc, json_schema_extra=field.json_schema_extra))
    missing = set(names) - set(out)
    assert not missing, f"{options.__name__} has no {sorted(missing)}"
    return out


def given_options(body: BaseModel, names: tuple[str, ...]) -> dict[str, Any]:
    """The ``names`` a client gave in ``body`` (not null): the family's keyword arguments. An
    option left out (or null) is not passed, so the spec's default, or the server's
    (``--speculate``), applies."""
    return {name: getattr(body, name) for name in names
            if name in body.model_fields_set and getattr(body, name) is not None}


def max_tokens(value: int | None, name: str, settings: ServerSettings, default: int | None = None) -> int:
    """A body's max-tokens field (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``)
    -> ``max_new_tokens``: the server's default when left out, a 400 ``limit_exceeded`` over its cap."""
    if value is None:
        value = settings.default_max_new_tokens if default is None else default
    if value > settings.max_new_tokens:
        raise Problem(400, "limit_exceeded", f"{name} is {value} but this server allows at most "
                      f"{settings.max_new_tokens}", param=name)
    return value


def unsupported(name: str, message: str) -> Problem:
    return Problem(400, "unsupported", message, param=name)


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m.get("role"), str):
            raise Problem(400, "invalid_type", f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise Problem(400, "invalid_type", f"messages[{i}].content parts must be text parts "
                              '({"type": "text", "text": ...}); this server has a text-only model', param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise Problem(400, "invalid_type", f"messages[{i}].content must be a string or text parts", param="messages")
        try:
            role = check_role(m["role"], f"messages[{i}].role")
        except InvalidArgumentError as exc:
            raise Problem(400, "invalid_argument", str(exc), param="messages") from None
        entry: dict[str, Any] = {"role": role, "content": content}
        # An assistant turn's calls and a tool turn's answer to one: the model renders them.
        if m.get("tool_calls"):
            entry["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id") is not None:
            entry["tool_call_id"] = m["tool_call_id"]
        out.append(entry)
    return out


def chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the text family's (text content parts joined; tool calls and
    tool answers kept); a 400 naming ``messages`` otherwise. The Responses route uses it too."""
    return _messages(raw)


def check_options(kwargs: dict[str, Any], max_tokens_field: str = "max_tokens") -> None:
    """The `TextOptions` values checked here, together (some depend on each other, e.g.
    ``tool_choice`` on ``tools``), so a bad one is a 400 naming its ``param`` (OpenAI's error
    shape) with the message ``TextModel.stream()`` gives; ``max_new_tokens`` is named by the
    body's own field for it (``max_tokens_field``)."""
    try:
        check_family_options("text", kwargs)
    except Problem as problem:
        raise in_openai_names(problem, {"max_new_tokens": max_tokens_field}) from None


def in_openai_names(problem: Problem, names: dict[str, str]) -> Problem:
    """``problem`` with an option of ours that an OpenAI body spells otherwise (``max_new_tokens``:
    ``max_tokens``; ``num_images``: ``n``) named as the client sent it, in ``param`` and at the
    start of the message, which the family's check words with its own name.

    Example:
        >>> in_openai_names(Problem(400, "invalid_argument", "num_images must be an integer >= 1, got 0",
        ...                         param="num_images"), {"num_images": "n"}).message
        'n must be an integer >= 1, got 0'
    """
    ours = problem.param or ""
    theirs = names.get(ours)
    if theirs is not None:
        for spelled in (f"{ours} ", f"'{ours}' "):  # the option's check, or the server's limit
            if problem.message.startswith(spelled):
                problem.message = spelled.replace(ours, theirs) + problem.message[len(spelled):]
        problem.param = theirs
    return problem
