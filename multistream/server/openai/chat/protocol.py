"""The OpenAI request bodies (pydantic models ``/openapi.json`` publishes) and their conversion into
the families' options, as vLLM's ``ChatCompletionRequest.to_sampling_params()`` does: the routes
stay thin, and every option the Python API has is spelled once, in `TextOptions` / `ImageOptions`.

What would change the answer and is not built is refused in OpenAI's error shape; what does not
(``user``, ``metadata``, empty ``tools``) is accepted and ignored with a log line.

Example:
    >>> from multistream.server import ServerSettings
    >>> kwargs, priority, stream, usage = chat_kwargs({"messages": [{"role": "user", "content": "hi"}],
    ...                                               "max_tokens": 8, "top_k": 5}, ServerSettings())
    >>> kwargs["max_new_tokens"], kwargs["top_k"], stream
    (8, 5, False)
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from pydantic import BaseModel, Field, create_model

from ....text import TextOptions
from ...bodies import check_prompt_limit
from ...http.bodies import LAX_BODY, validate_body
from ...http.problems import Problem
from ...settings import ServerSettings
from .._protocol import StreamOptions, chat_messages, check_options, given_options, max_tokens, option_fields

logger = logging.getLogger("multistream.server")


# (``model`` is not among them: it names the served model, or the request is a 404 `model_not_found`.)
_IGNORED_CHAT = ("user", "metadata", "store", "service_tier")


class _ChatCompletionBase(BaseModel):
    """``POST /v1/chat/completions`` (OpenAI). Fields that would change the answer and that this
    server does not support (``n > 8``) are refused; harmless ones (``user``, ``metadata``, empty
    ``tools``) are accepted and ignored. ``response_format`` (``json_object``, ``json_schema``) and
    ``tools`` run under the grammar engine (docs/constrained.md)."""

    model_config = LAX_BODY  # SDKs add fields over time; unknown ones are logged and ignored
    model: Optional[str] = Field(default=None, description="the served text model: its name (GET /v1/models), \"default\" or \"text\"; another name is 404 model_not_found")
    messages: list[dict[str, Any]] = Field(description="a non-empty list of chat messages", min_length=1)
    max_tokens: Optional[int] = Field(default=None, description="an integer >= 1")
    max_completion_tokens: Optional[int] = Field(default=None, description="an integer >= 1 (wins over max_tokens)")
    stream: Optional[bool] = Field(default=None, description="true: server-sent chunks")
    stream_options: Optional[StreamOptions] = Field(default=None, description="{'include_usage': true}")
    n: Optional[int] = Field(default=None, description="1..8 answers (choices), the prompt prefilled once")
    user: Optional[str] = Field(default=None, description="accepted and ignored")
    metadata: Optional[dict[str, Any]] = Field(default=None, description="accepted and ignored")
    store: Optional[bool] = Field(default=None, description="accepted and ignored")
    service_tier: Optional[str] = Field(default=None, description="accepted and ignored")
    response_format: Optional[dict[str, Any]] = Field(
        default=None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}')

    def to_text_options(self, settings: ServerSettings) -> dict[str, Any]:
        """``TextModel.stream`` keyword arguments (the prompt and `TextOptions`): OpenAI's names
        mapped onto ours, and every field that has a `TextOptions` namesake passed as it is, so an
        option added there is one field here. The model checks the values."""
        messages = chat_messages(self.messages)
        check_prompt_limit(messages, settings)
        kwargs: dict[str, Any] = {"prompt": messages}
        if self.max_completion_tokens is not None:
            kwargs["max_new_tokens"] = max_tokens(self.max_completion_tokens, "max_completion_tokens", settings)
        else:
            kwargs["max_new_tokens"] = max_tokens(self.max_tokens, "max_tokens", settings)
        schema = _response_schema(self.response_format)
        if schema is not None:
            kwargs["json_schema"] = schema
        kwargs.update(given_options(self, tuple(n for n in CHAT_OPTION_FIELDS if n != "priority")))
        if not self.logprobs:  # OpenAI: top_logprobs only counts with logprobs true
            kwargs.pop("logprobs", None)
            kwargs.pop("top_logprobs", None)
        return kwargs


# The OpenAI fields that have a `TextOptions` namesake, with its type and description (vLLM's
# extensions marked as such): declared once, in the spec. Each defaults to null (the model's own
# default), except priority, whose default is the spec's.
CHAT_OPTION_FIELDS = ("temperature", "top_p", "stop", "seed", "frequency_penalty", "presence_penalty", "logprobs",
                      "top_logprobs", "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "top_k",
                      "repetition_penalty", "min_p", "num_beams", "length_penalty", "early_stopping", "priority",
                      "stop_on_repetition", "speculate", "cache_salt")


_EXTENSIONS = ("top_k", "repetition_penalty", "min_p", "num_beams", "length_penalty", "early_stopping", "priority",
               "stop_on_repetition", "speculate", "cache_salt")


ChatCompletionRequest = create_model(
    "ChatCompletionRequest", __base__=_ChatCompletionBase, __doc__=_ChatCompletionBase.__doc__,
    **option_fields(TextOptions, CHAT_OPTION_FIELDS, _EXTENSIONS))


def _response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` asks for (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise Problem(400, "invalid_argument", 'response_format json_schema needs {"json_schema": {"name": ..., '
                          '"schema": {...}}}', param="response_format")
        return schema
    raise Problem(400, "invalid_argument", f"response_format type must be 'text', 'json_object' or 'json_schema', "
                  f"got {str(kind)[:40]!r}", param="response_format")


def chat_choices(body: Any) -> tuple[int, bool]:
    """``(n, continuous_usage_stats)`` of a chat body that `chat_kwargs` accepted."""
    n = body.get("n") if isinstance(body, dict) else None
    options = body.get("stream_options") if isinstance(body, dict) else None
    continuous = bool(isinstance(options, dict) and options.get("continuous_usage_stats"))
    return (n if isinstance(n, int) and not isinstance(n, bool) else 1), continuous


def chat_kwargs(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int, bool, bool]:
    """OpenAI chat body -> (TextModel.stream kwargs, priority, stream?, include_usage?).

    Refuses what would change the answer and is not built (``n > 8``);
    accepts and ignores (with a log line) what does not (``user``, ``metadata``, empty ``tools``)."""
    req = validate_body(ChatCompletionRequest, body, "POST /v1/chat/completions")
    assert isinstance(req, ChatCompletionRequest)
    if req.n is not None and not 1 <= req.n <= 8:
        raise Problem(400, "invalid_argument", f"n must be from 1 to 8 (answers to generate), got {req.n}", param="n")
    if req.top_logprobs and not req.logprobs:
        raise Problem(400, "invalid_argument", "top_logprobs needs logprobs: true", param="top_logprobs")
    extra = sorted(set(body) - set(ChatCompletionRequest.model_fields))
    ignored = [n for n in _IGNORED_CHAT if body.get(n) not in (None, "", {}, [])] + extra
    if ignored or req.tools == []:
        logger.info("chat completion: ignoring field(s) %s", ignored or ["tools (empty)"])
    kwargs = req.to_text_options(settings)
    check_options(kwargs, "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)
    return kwargs, req.priority, bool(req.stream), include_usage
