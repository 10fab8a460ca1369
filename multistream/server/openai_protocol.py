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

from .._spec import body_fields
from ..image import IMAGE_STREAM_ARGS, ImageOptions
from ..text import TEXT_STREAM_ARGS, TextOptions
from .bodies import check_family_options, check_image_limits, check_prompt_limit
from .http.bodies import LAX_BODY, STRICT_BODY, validate_body
from .http.problems import Problem
from .settings import ServerSettings

__all__ = ["CHAT_OPTION_FIELDS", "ChatCompletionRequest", "IMAGE_OPTION_FIELDS", "ImageGenerationRequest",
           "StreamOptions", "chat_choices", "chat_kwargs", "chat_messages", "check_options", "image_kwargs"]

logger = logging.getLogger("multistream.server")

_IGNORED_CHAT = ("user", "metadata", "store", "service_tier", "model")


class StreamOptions(BaseModel):
    model_config = STRICT_BODY
    include_usage: Optional[bool] = Field(default=None, description="true: a last chunk carries the usage")
    include_obfuscation: Optional[bool] = Field(default=None, description="accepted and ignored")
    continuous_usage_stats: Optional[bool] = Field(default=None, description="vLLM's: every chunk carries the "
                                                   "usage so far")


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
        messages = _messages(self.messages)
        check_prompt_limit(messages, settings)
        kwargs: dict[str, Any] = {"prompt": messages}
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = settings.default_max_new_tokens
        if max_tokens > settings.max_new_tokens:
            raise Problem(400, "limit_exceeded", f"max_tokens is {max_tokens} but this server allows at most "
                          f"{settings.max_new_tokens}", param="max_tokens")
        kwargs["max_new_tokens"] = max_tokens
        schema = _response_schema(self.response_format)
        if schema is not None:
            kwargs["json_schema"] = schema
        for name in TEXT_STREAM_ARGS:
            if name in type(self).model_fields and name not in ("max_new_tokens", "priority"):
                value = getattr(self, name)
                if value is not None:
                    kwargs[name] = value
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
                      "stop_on_repetition", "speculate")
_EXTENSIONS = ("top_k", "repetition_penalty", "min_p", "num_beams", "length_penalty", "early_stopping", "priority",
               "stop_on_repetition", "speculate")


def _option_fields(options: type, names: tuple[str, ...], extensions: tuple[str, ...]) -> dict[str, Any]:
    """``{name: (annotation, Field)}`` of the ``names`` of the options class ``options``: its type
    and description (``extensions`` marked as such), a null default, except priority's."""
    out: dict[str, Any] = {}
    for name, (wire, field) in body_fields(options).items():
        if name not in names:
            continue
        doc = ("extension: " if name in extensions else "") + (field.description or "")
        if name == "priority":
            out[name] = (wire, Field(default=field.default, description=doc))
        else:
            out[name] = (Optional[wire], Field(default=None, description=doc))
    missing = set(names) - set(out)
    assert not missing, f"{options.__name__} has no {sorted(missing)}"
    return out


ChatCompletionRequest = create_model(
    "ChatCompletionRequest", __base__=_ChatCompletionBase, __doc__=_ChatCompletionBase.__doc__,
    **_option_fields(TextOptions, CHAT_OPTION_FIELDS, _EXTENSIONS))


class _ImageGenerationBase(BaseModel):
    """``POST /v1/images/generations`` (OpenAI)."""

    model_config = LAX_BODY
    prompt: str = Field(description="a string describing the image")
    model: Optional[str] = Field(default=None, description="the served image model: its name, \"default\", \"image\", gpt-image-1 or dall-e-2/3; another name is 404 model_not_found")
    n: Optional[int] = Field(default=None, description="an integer >= 1: images")
    size: Optional[str] = Field(default=None, description="'WIDTHxHEIGHT' (e.g. '64x64', one the model can make: "
                                "a 400 names them); null or 'auto': the model's native size")
    stream: Optional[bool] = Field(default=None, description="true: server-sent events")
    partial_images: Optional[int] = Field(default=None, description="0..3 previews when streaming")
    response_format: Optional[str] = Field(default=None, description="only 'b64_json'")
    output_format: Optional[str] = Field(default=None, description="'png', 'jpeg' or 'webp'")
    quality: Optional[str] = Field(default=None, description="accepted and ignored")
    background: Optional[str] = Field(default=None, description="accepted and ignored")
    output_compression: Optional[int] = Field(default=None, description="accepted and ignored")
    moderation: Optional[str] = Field(default=None, description="accepted and ignored")
    user: Optional[str] = Field(default=None, description="accepted and ignored")
    style: Optional[str] = Field(default=None, description="accepted and ignored")

    def to_image_options(self, fmt: str, previews: bool) -> dict[str, Any]:
        """``ImageModel.stream`` keyword arguments (the prompt and `ImageOptions`): OpenAI's names
        (``n``, ``size``, ``output_format``) mapped onto ours, and every field with an
        `ImageOptions` namesake passed as it is. ``previews``: stream partial images (as
        ``fmt``, full size) or none. The model checks the values."""
        kwargs: dict[str, Any] = {"prompt": self.prompt, "num_images": self.n if self.n is not None else 1,
                                  "final_format": fmt}
        if self.size not in (None, "auto"):
            w, sep, h = self.size.partition("x")
            ok = sep and all(v.isascii() and v.isdigit() and 0 < len(v) <= 5 for v in (w, h))
            if not ok:
                raise Problem(400, "invalid_argument", f"size must look like '64x64' (WIDTHxHEIGHT in ASCII digits) or "
                              f"'auto', got {self.size[:20]!r}", param="size")
            kwargs["width"], kwargs["height"] = int(w), int(h)
        for name in IMAGE_STREAM_ARGS:
            if name in type(self).model_fields and name != "priority" and getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if previews:
            kwargs["preview_format"] = fmt
            if "width" in kwargs:
                kwargs["preview_max_side"] = max(kwargs["width"], kwargs["height"])
        else:
            kwargs["preview"] = "none"
        return kwargs


# The OpenAI image fields that have an `ImageOptions` namesake (all extensions of OpenAI's body),
# with its type and description: declared once, in the spec. Each defaults to null (the model's own
# default), except priority, whose default is the spec's.
IMAGE_OPTION_FIELDS = ("steps", "seed", "guidance_scale", "negative_prompt", "priority")

ImageGenerationRequest = create_model(
    "ImageGenerationRequest", __base__=_ImageGenerationBase, __doc__=_ImageGenerationBase.__doc__,
    **_option_fields(ImageOptions, IMAGE_OPTION_FIELDS, IMAGE_OPTION_FIELDS))


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


def _unsupported(name: str, message: str) -> Problem:
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
        entry: dict[str, Any] = {"role": m["role"], "content": content}
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


def check_options(kwargs: dict[str, Any]) -> None:
    """The `TextOptions` values checked here, together (some depend on each other, e.g.
    ``tool_choice`` on ``tools``), so a bad one is a 400 naming its ``param`` (OpenAI's error
    shape) with the message ``TextModel.stream()`` gives."""
    check_family_options("text", kwargs)


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
    check_options(kwargs)
    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)
    return kwargs, req.priority, bool(req.stream), include_usage


def image_kwargs(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int, bool, int, str]:
    """OpenAI images body -> (ImageModel.stream kwargs, priority, stream?, partial_images, output_format)."""
    req = validate_body(ImageGenerationRequest, body, "POST /v1/images/generations")
    assert isinstance(req, ImageGenerationRequest)
    if req.response_format not in (None, "b64_json"):
        raise _unsupported("response_format", "only response_format 'b64_json' is supported (this server keeps no "
                           "files)")
    fmt = req.output_format or "png"
    if fmt not in ("png", "jpeg", "webp"):
        raise Problem(400, "invalid_argument", f"output_format must be png, jpeg or webp, got {fmt[:20]!r}",
                      param="output_format")
    partial = req.partial_images or 0
    if not 0 <= partial <= 3:
        raise Problem(400, "invalid_argument", f"partial_images must be 0..3, got {partial}", param="partial_images")
    stream = bool(req.stream)
    kwargs = req.to_image_options(fmt, stream and partial > 0)
    check_image_limits(kwargs, settings)
    return kwargs, req.priority, stream, partial, fmt
