"""The arguments of ``TextModel.stream()``, checked once, without torch.

Shared by the real text model, the scripted fake in `multistream.testing` and the server's request
parsing, so every entry point rejects the same mistakes with the same message.

Example:
    >>> opts = parse_text_options(max_new_tokens=16, stop="\\n\\n")
    >>> opts.max_new_tokens, opts.stop
    (16, ('\\n\\n',))
    >>> parse_text_options(max_new_tokens=0)
    Traceback (most recent call last):
    ...
    multistream.errors.InvalidArgumentError: max_new_tokens must be an integer >= 1, got 0
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

from .._checks import is_int, is_number
from ..errors import InvalidArgumentError

__all__ = ["TEXT_STREAM_ARGS", "TextOptions", "check_messages", "check_prompt", "parse_text_options"]

TEXT_STREAM_ARGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "stop",
    "chunk_tokens",
    "chunk_ms",
    "chat",
    "allowed",
)


@dataclass(frozen=True)
class TextOptions:
    """Checked generation options (see ``TextModel.stream`` for their meaning)."""

    max_new_tokens: int = 256
    # None: the model's generation_config decides (as transformers' generate does); see
    # `multistream.text._sampling.SamplingPlan`. temperature None there means greedy unless the
    # config says do_sample.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chunk_tokens: int | None = None
    chunk_ms: float | None = None
    chat: bool | None = None
    allowed: str | None = None  # a regular expression the whole answer must match (choices joined)


def _reject_unknown(unknown: dict[str, Any]) -> None:
    if not unknown:
        return
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, TEXT_STREAM_ARGS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise InvalidArgumentError(
        f"unknown argument {name!r} for TextModel.stream().{hint} Known arguments: {', '.join(TEXT_STREAM_ARGS)}."
    )


def parse_text_options(
    *,
    max_new_tokens: Any = 256,
    temperature: Any = None,
    top_p: Any = None,
    top_k: Any = None,
    repetition_penalty: Any = None,
    seed: Any = None,
    stop: Any = None,
    chunk_tokens: Any = None,
    chunk_ms: Any = None,
    chat: Any = None,
    allowed: Any = None,
    **unknown: Any,
) -> TextOptions:
    """Check every option; raise `InvalidArgumentError` naming the first bad one and the fix."""
    _reject_unknown(unknown)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if temperature is not None and (not is_number(temperature) or temperature < 0):
        raise InvalidArgumentError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise InvalidArgumentError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if repetition_penalty is not None and (not is_number(repetition_penalty) or repetition_penalty <= 0):
        raise InvalidArgumentError(f"repetition_penalty must be a number > 0 (1 disables it), got {repetition_penalty!r}")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stops):
        raise InvalidArgumentError("stop strings must not be empty")
    if chunk_tokens is not None and (not is_int(chunk_tokens) or chunk_tokens < 1):
        raise InvalidArgumentError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    if chunk_ms is not None and (not is_number(chunk_ms) or chunk_ms <= 0):
        raise InvalidArgumentError(f"chunk_ms must be a number of milliseconds > 0, got {chunk_ms!r}")
    if chat is not None and not isinstance(chat, bool):
        raise InvalidArgumentError(f"chat must be True, False or None (automatic), got {chat!r}")
    from ._constraints import compile_allowed

    pattern = compile_allowed(allowed)
    return TextOptions(
        allowed=pattern,
        max_new_tokens=int(max_new_tokens),
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=None if top_k is None else int(top_k),
        repetition_penalty=None if repetition_penalty is None else float(repetition_penalty),
        seed=None if seed is None else int(seed),
        stop=stops,
        chunk_tokens=None if chunk_tokens is None else int(chunk_tokens),
        chunk_ms=None if chunk_ms is None else float(chunk_ms),
        chat=chat,
    )


def check_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Chat messages as plain ``{"role", "content"}`` dicts, or a clear error."""
    if not messages:
        raise InvalidArgumentError("messages is empty; pass at least one {'role': 'user', 'content': '...'}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgumentError(
                f"messages[{i}] must be a dict with 'role' and 'content' strings, got {message!r}"
            )
        if not isinstance(message.get("content"), str):
            raise InvalidArgumentError(f"messages[{i}]['content'] must be a string, got {message.get('content')!r}")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def check_prompt(prompt: Any) -> str | list[dict[str, str]]:
    """A prompt string, or a checked list of chat messages."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return check_messages(list(prompt))
    raise InvalidArgumentError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
