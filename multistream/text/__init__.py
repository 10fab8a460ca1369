"""The text family: transformers causal language models that stream tokens.

One public face over private modules: `TextModel` and `load_text_model` (the model), `TextOptions`
and `parse_text_options` (the one definition of every ``TextModel.stream()`` option, shared by the
server, the Ray ingress and the scripted fakes), and the pieces other layers build on.

Example:
    >>> from multistream.text import parse_text_options
    >>> parse_text_options(max_new_tokens=8).max_new_tokens
    8
    >>> from multistream.text import load_text_model
    >>> llm = load_text_model()                                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from ._options import (
    CHAT_ROLES,
    REWIND_OPTIONS,
    TEXT_STREAM_ARGS,
    TextOptions,
    check_messages,
    check_prompt,
    check_role,
    parse_text_options,
)
from ._seeds import choice_seed
from ._stop_strings import StopMatcher
from ._tools import TOOLS_SYSTEM_PROMPT, ToolCallParser, parse_tool_calls

# The model modules import torch and transformers; they load when first asked for, so the options
# (used by the server and the fakes) stay torch-free.
_LAZY = {
    "DEFAULT_MAX_BATCH": "._batcher",
    "TextModel": "._model",
    "load_text_model": "._loading",
    "EMBEDDED_TEXT_MODEL": "._loading",
}

if TYPE_CHECKING:
    from ._batcher import DEFAULT_MAX_BATCH
    from ._loading import EMBEDDED_TEXT_MODEL, load_text_model
    from ._model import TextModel


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "CHAT_ROLES",
    "DEFAULT_MAX_BATCH",
    "EMBEDDED_TEXT_MODEL",
    "REWIND_OPTIONS",
    "StopMatcher",
    "TEXT_STREAM_ARGS",
    "TextModel",
    "TOOLS_SYSTEM_PROMPT",
    "TextOptions",
    "ToolCallParser",
    "check_messages",
    "choice_seed",
    "check_prompt",
    "check_role",
    "load_text_model",
    "parse_text_options",
    "parse_tool_calls",
]
