"""Request and response bodies as pydantic models, and a JSON reader that never fails with a 500.

The models are what ``/openapi.json`` publishes; the routes read the body themselves (size cap
while reading, depth and big-integer guards, lone surrogates) and then validate it with the model,
so every refusal is a 4xx naming the field, the problem and the fix, in the server's error shape.

What the model itself checks (ranges such as ``top_p`` in (0, 1]) is left to its ``.stream()``,
whose `InvalidArgumentError` becomes a 400 with the same message; the server's own limits
(``max_new_tokens``, ``max_steps``, ...) give ``limit_exceeded``.

Example:
    >>> from multistream.server import ServerSettings
    >>> kwargs, priority = parse_text_body({"prompt": "hi", "max_new_tokens": 8, "priority": 2}, ServerSettings())
    >>> kwargs["max_new_tokens"], priority
    (8, 2)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model

from .._spec import body_fields
from ..errors import InvalidArgumentError
from ..image import IMAGE_STREAM_ARGS, ImageOptions, parse_image_options
from ..speech import MAX_INPUT_CHARACTERS, SpeechOptions, parse_speech_options
from ..text import REWIND_OPTIONS, TEXT_STREAM_ARGS, TextOptions, parse_text_options
from ..video import VIDEO_STREAM_ARGS, VideoOptions, parse_video_options
from .http.bodies import STRICT_BODY, validate_body
from .http.problems import Problem
from .settings import ServerSettings

__all__ = [
    "ChatMessage", "EditResult", "ImageBody", "OPENAI_VOICES", "RewindBody", "SpeechBody",
    "SteerBody", "TextBody", "ToolCall", "ToolCallFunction", "VideoBody",
    "check_video_limits", "parse_image_body", "parse_rewind_body", "parse_speech_body", "parse_steer_body",
    "parse_text_body", "parse_video_body", "speech_voice",
]



# -- request bodies ------------------------------------------------------------------------------


class ToolCallFunction(BaseModel):
    model_config = STRICT_BODY
    name: str = Field(description="the function called")
    arguments: Union[str, dict[str, Any]] = Field(default="", description="its arguments: JSON text or an object")


class ToolCall(BaseModel):
    """One call an assistant turn made: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    model_config = STRICT_BODY
    id: Optional[str] = Field(default=None, description="the call's id, which the tool turn's tool_call_id names")
    type: str = Field(default="function", description="'function'")
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat turn: ``{"role": "user", "content": "hi"}``; what `check_messages` accepts, so a
    tool conversation works natively: an assistant turn with ``tool_calls`` (``content`` may then be
    null) and the ``tool`` turn answering it with ``tool_call_id``."""

    model_config = STRICT_BODY
    role: str = Field(description="who speaks: 'system', 'developer' (read as 'system'), 'user', 'assistant' or "
                      "'tool'")
    content: Optional[str] = Field(default=None, description="the text of the turn (null only beside tool_calls)")
    name: Optional[str] = Field(default=None, description="optional speaker name (ignored by most templates)")
    tool_calls: Optional[list[ToolCall]] = Field(default=None, description="an assistant turn's function calls")
    tool_call_id: Optional[str] = Field(default=None, description="a tool turn: the id of the call it answers")


class _StrictBody(BaseModel):
    model_config = STRICT_BODY


# The native bodies are built from the families' one definition of their options (`TextOptions`,
# `ImageOptions`): the same names, defaults and descriptions as ``TextModel.stream()`` and
# ``ImageModel.stream()``, so ``/openapi.json`` describes exactly the Python options.
TextBody = create_model(
    "TextBody",
    __base__=_StrictBody,
    __doc__="``POST /v1/text`` (and a WebSocket ``{\"type\": \"text\", ...}`` message): `TextModel.stream` arguments.",
    prompt=(Union[str, list[ChatMessage]], Field(description="a string, or a non-empty list of chat messages")),
    **body_fields(TextOptions),
)

ImageBody = create_model(
    "ImageBody",
    __base__=_StrictBody,
    __doc__="``POST /v1/image`` (and a WebSocket ``{\"type\": \"image\", ...}`` message): `ImageModel.stream` arguments.",
    prompt=(str, Field(description="a string describing the image")),
    **body_fields(ImageOptions),
)

SpeechBody = create_model(
    "SpeechBody",
    __base__=_StrictBody,
    __doc__="``POST /v1/speech`` (and a WebSocket ``{\"type\": \"speech\", ...}`` message): `SpeechModel.stream` "
    "arguments.",
    text=(str, Field(description=f"the text to speak (at most {MAX_INPUT_CHARACTERS} characters)")),
    **body_fields(SpeechOptions),
)

VideoBody = create_model(
    "VideoBody",
    __base__=_StrictBody,
    __doc__="``POST /v1/video`` (and a WebSocket ``{\"type\": \"video\", ...}`` message): `VideoModel.stream` "
    "arguments.",
    prompt=(str, Field(description="a string describing the clip")),
    **body_fields(VideoOptions),
)



def _limit(name: str, value: int, limit: int, setting: str) -> None:
    if value > limit:
        raise Problem(400, "limit_exceeded",
                      f"'{name}' is {value} but this server allows at most {limit} ({setting}); lower it", param=name)


def prompt_chars(prompt: str | list[dict[str, Any]]) -> int:
    """Characters a prompt holds: its text, and in chat messages the tool calls' arguments too."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m.get("content") or "") + sum(len(str(c.get("function", {}).get("arguments", "")))
                                                 for c in m.get("tool_calls") or ()) for m in prompt)


def check_prompt_limit(prompt: str | list[dict[str, str]], settings: ServerSettings) -> None:
    n = prompt_chars(prompt)
    if n > settings.max_prompt_chars:
        raise Problem(400, "limit_exceeded", f"the prompt has {n} characters but this server allows at most "
                      f"{settings.max_prompt_chars} (max_prompt_chars); shorten it", param="prompt")


def _given(model: BaseModel) -> dict[str, Any]:
    """The fields the client sent (defaults stay the model's own)."""
    return {name: getattr(model, name) for name in model.model_fields_set}


def check_family_options(kind: str, body: Any) -> None:
    """The family's own checks of the options in a body, first: a bad value gets the very message
    ``TextModel.stream()`` / ``ImageModel.stream()`` / ``VideoModel.stream()`` would raise, as a 400
    naming the option."""
    if not isinstance(body, dict):
        return
    names, check, body_model = _OPTION_CHECKS[kind]
    given = {k: v for k, v in body.items() if k in names}
    try:
        check(body, given)
    except InvalidArgumentError as exc:
        param = exc.param  # set where it was raised: the option's own check, or the cross-option check
        kind_of = "invalid_argument"
        if param in given and not _json_type_fits(body_model, param, given[param]):
            kind_of = "invalid_type"  # e.g. a string where a number goes; the message is still the model's
        raise Problem(400, kind_of, str(exc), param=param) from None


def _check_image_options(body: dict[str, Any], given: dict[str, Any]) -> None:
    if isinstance(body.get("prompt"), str):
        parse_image_options(body["prompt"], **given)


def _check_video_options(body: dict[str, Any], given: dict[str, Any]) -> None:
    if isinstance(body.get("prompt"), str):
        parse_video_options(body["prompt"], **given)


# Per family: its option names, the family's own check of them and the body they belong to.
_OPTION_CHECKS: dict[str, tuple[tuple[str, ...], Any, type[BaseModel]]] = {
    "text": (TEXT_STREAM_ARGS, lambda body, given: parse_text_options(**given), TextBody),
    "image": (IMAGE_STREAM_ARGS, _check_image_options, ImageBody),
    "video": (VIDEO_STREAM_ARGS, _check_video_options, VideoBody),
}


@functools.lru_cache(maxsize=None)
def _adapter(body_model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    return TypeAdapter(body_model.model_fields[name].annotation)


def _json_type_fits(body_model: type[BaseModel], name: str, value: Any) -> bool:
    try:
        _adapter(body_model, name).validate_python(value, strict=True)
    except ValidationError:
        return False
    return True


def parse_text_body(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int]:
    """``POST /v1/text`` body -> (keyword arguments for ``TextModel.stream``, priority)."""
    check_family_options("text", body)
    req = validate_body(TextBody, body, "POST /v1/text")
    kwargs = _given(req)
    priority = kwargs.pop("priority", 0)
    if isinstance(req.prompt, list):
        if not req.prompt:
            raise Problem(400, "invalid_type", "'prompt' must be a string or a non-empty list of chat messages",
                          param="prompt")
        kwargs["prompt"] = [m.model_dump(exclude_none=True) for m in req.prompt]
    check_prompt_limit(kwargs["prompt"], settings)
    if kwargs.get("max_new_tokens") is None:
        kwargs["max_new_tokens"] = settings.default_max_new_tokens
    _limit("max_new_tokens", kwargs["max_new_tokens"], settings.max_new_tokens, "max_new_tokens")
    stops = [kwargs["stop"]] if isinstance(kwargs.get("stop"), str) else (kwargs.get("stop") or [])
    if len(stops) > 16 or any(len(s) > 256 for s in stops):
        raise Problem(400, "limit_exceeded", "'stop' allows at most 16 strings of at most 256 characters", param="stop")
    return kwargs, priority


#: OpenAI's voice names: each means the served speech model's default voice.
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


def speech_voice(model: Any, voice: str | None) -> str | None:
    """A voice a client named: one of the model's own (``model.voices``), or an OpenAI voice name
    (None: the model's default voice); anything else is a 400 listing both."""
    voices = tuple(getattr(model, "voices", ()))
    if voice is None or voice in voices:
        return voice
    if voice.lower() in OPENAI_VOICES:
        return None
    raise Problem(400, "invalid_argument", f"unknown voice {voice!r}; use an OpenAI voice name ({', '.join(OPENAI_VOICES)}: "
                  f"the default voice) or one of this model's: {list(voices)}", param="voice")


def check_speech_options(text: str, *, text_param: str = "text", **options: Any) -> None:
    """The speech family's own checks, first: a bad value gets the very message ``tts.stream()``
    would raise, as a 400 naming the option (``text_param``, the body's name for the text, when
    the text itself is at fault)."""
    try:
        parse_speech_options(text, **options)
    except InvalidArgumentError as exc:
        raise Problem(400, "invalid_argument", str(exc), param=exc.param or text_param) from None


def parse_speech_body(body: Any, settings: ServerSettings | None = None) -> tuple[dict[str, Any], int]:
    """``POST /v1/speech`` body (and a WebSocket ``{"type": "speech", ...}`` message) ->
    (``SpeechModel.stream`` keyword arguments, priority)."""
    if isinstance(body, dict) and isinstance(body.get("text"), str):
        check_speech_options(body["text"], **{k: body[k] for k in ("voice", "speed", "priority") if k in body})
    req = validate_body(SpeechBody, body, "POST /v1/speech")
    return {"text": req.text, "voice": req.voice, "speed": req.speed}, req.priority


def _parse_denoising_body(kind: str, model: type[BaseModel], body: Any, settings: ServerSettings,
                          check_limits: Any) -> tuple[dict[str, Any], int]:
    """An image or video body -> (the ``.stream`` keyword arguments the client sent, priority):
    the family's own checks first, then the body's, then the server's limits."""
    check_family_options(kind, body)
    req = validate_body(model, body, f"POST /v1/{kind}")
    kwargs = _given(req)
    priority = kwargs.pop("priority", 0)
    check_limits(kwargs, settings)
    return kwargs, priority


def _check_denoising_limits(kwargs: dict[str, Any], settings: ServerSettings) -> None:
    """What images and video share: the prompt, the steps and a picture's sides (``max_image_side``)."""
    check_prompt_limit(kwargs["prompt"], settings)
    if kwargs.get("steps") is not None:
        _limit("steps", kwargs["steps"], settings.max_steps, "max_steps")
    for side in ("height", "width", "preview_max_side"):
        if kwargs.get(side) is not None:
            _limit(side, kwargs[side], settings.max_image_side, "max_image_side")


def parse_image_body(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int]:
    """``POST /v1/image`` body -> (keyword arguments for ``ImageModel.stream``, priority)."""
    return _parse_denoising_body("image", ImageBody, body, settings, check_image_limits)


def check_image_limits(kwargs: dict[str, Any], settings: ServerSettings) -> None:
    _check_denoising_limits(kwargs, settings)
    if "num_images" in kwargs:
        _limit("num_images", kwargs["num_images"], settings.max_images, "max_images")


def parse_video_body(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int]:
    """``POST /v1/video`` body -> (keyword arguments for ``VideoModel.stream``, priority).

    Example:
        >>> kwargs, priority = parse_video_body({"prompt": "a red circle moving right", "steps": 8, "priority": 1},
        ...                                     ServerSettings())
        >>> sorted(kwargs.items()), priority
        ([('prompt', 'a red circle moving right'), ('steps', 8)], 1)
    """
    return _parse_denoising_body("video", VideoBody, body, settings, check_video_limits)


def check_video_limits(kwargs: dict[str, Any], settings: ServerSettings) -> None:
    """The server's own limits on a video request, native or OpenAI (a 400 ``limit_exceeded``
    names the setting): the prompt, steps, a frame's sides (``max_image_side``) and the frames."""
    _check_denoising_limits(kwargs, settings)
    if kwargs.get("num_frames") is not None:
        _limit("num_frames", kwargs["num_frames"], settings.max_video_frames, "max_video_frames")


# -- edits of a running stream ------------------------------------------------------------------


class SteerBody(BaseModel):
    """``POST /v1/streams/{id}/steer`` (and a WebSocket ``{"type": "steer", ...}`` message).

    Text streams take ``instruction``; image streams take ``prompt``, ``negative_prompt`` and
    ``guidance_scale`` (at least one). The model checks the combination: a field its kind does not
    take is a 400 naming it.
    """

    model_config = STRICT_BODY
    instruction: Optional[str] = Field(default=None, description="text streams: the new instruction")
    prompt: Optional[str] = Field(default=None, description="image streams: the new prompt")
    negative_prompt: Optional[str] = Field(default=None, description="image streams: the new negative prompt")
    guidance_scale: Optional[float] = Field(default=None, description="image streams: a finite number >= 0")


RewindBody = create_model(
    "RewindBody",
    __base__=_StrictBody,
    __doc__="``POST /v1/streams/{id}/rewind`` (and a WebSocket ``{\"type\": \"rewind\", ...}`` message): text "
    "streams only. The answer from character ``offset`` on (a code point index, as Python counts) is dropped and "
    "regenerated, optionally under a new instruction and the sampling options `REWIND_OPTIONS` (declared once, "
    "described by `TextOptions`), and optionally starting with ``token_id`` (branch from an alternative token).",
    offset=(int, Field(description="an integer >= 0: the character where regeneration starts")),
    instruction=(Optional[str], Field(default=None, description="a new instruction for the rest, or null")),
    **{name: spec for name, spec in body_fields(TextOptions).items() if name in REWIND_OPTIONS},
    token_id=(Optional[int], Field(default=None, description="the first regenerated token (a branch from an "
                                   "alternative in the events' logprobs), or null")),
)


class EditResult(BaseModel):
    """What ``finish``, ``steer`` and ``rewind`` answer: the command is queued for the model's
    next step; its effect shows in the stream's events (``revision``, ``offset``, ``finish_reason``)."""

    stream_id: str
    command: str = Field(description="'finish', 'steer' or 'rewind'")
    accepted: bool = Field(description="false only for finish on a stream that had already ended")


def parse_steer_body(body: Any, settings: ServerSettings) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A steer body -> (args, kwargs) for `Stream.steer` (only the fields the client sent)."""
    req = validate_body(SteerBody, body, "steer")
    kwargs = {k: v for k, v in _given(req).items() if v is not None}
    for name in ("instruction", "prompt", "negative_prompt"):
        if name in kwargs:
            check_prompt_limit(kwargs[name], settings)
    gs = kwargs.get("guidance_scale")
    if gs is not None and not math.isfinite(gs):
        raise Problem(400, "invalid_argument", f"'guidance_scale' must be a finite number, got {gs}",
                      param="guidance_scale")
    instruction = kwargs.pop("instruction", None)
    return ((instruction,) if instruction is not None else ()), kwargs


def parse_rewind_body(body: Any, settings: ServerSettings) -> tuple[int, dict[str, Any]]:
    """A rewind body -> (offset, keyword arguments for `Stream.rewind`)."""
    req = validate_body(RewindBody, body, "rewind")
    kwargs = {k: v for k, v in _given(req).items() if v is not None}
    offset = kwargs.pop("offset")
    if offset < 0:
        raise Problem(400, "invalid_argument", f"'offset' must be >= 0 (a character position), got {offset}",
                      param="offset")
    if kwargs.get("instruction") is not None:
        check_prompt_limit(kwargs["instruction"], settings)
    return offset, kwargs


_ = Literal  # keep the import for annotations in subclasses
