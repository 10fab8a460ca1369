"""The video family's pieces for the server table (`families.FAMILIES`): the native body
(``POST /v1/video``, a WebSocket ``{"type": "video", ...}`` message) built from the family's one
definition of its options (`VideoOptions`), its parser, the server's limits on it, the final the
server writes when it ends a video stream itself, and the model-independent check.

Example:
    >>> from multistream.server import ServerSettings
    >>> kwargs, priority = parse_video_body({"prompt": "a red circle moving right", "steps": 8, "priority": 1},
    ...                                     ServerSettings())
    >>> kwargs, priority
    ({'prompt': 'a red circle moving right', 'steps': 8}, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pydantic import Field, create_model

from .._spec import body_fields
from ..errors import InvalidArgumentError
from ..events import ErrorEvent, Event, VideoEvent
from ..video import VIDEO_STREAM_ARGS, VideoOptions, parse_video_options
from .bodies import _given, _json_type_fits, _limit, _StrictBody, check_prompt_limit, validate_body
from .problems import Problem
from .settings import ServerSettings

__all__ = ["VideoBody", "check_video", "check_video_limits", "newest_preview_final", "parse_video_body",
           "video_final"]

VideoBody = create_model(
    "VideoBody",
    __base__=_StrictBody,
    __doc__="``POST /v1/video`` (and a WebSocket ``{\"type\": \"video\", ...}`` message): `VideoModel.stream` "
    "arguments.",
    prompt=(str, Field(description="a string describing the clip")),
    **body_fields(VideoOptions),
)


def _check_options(body: dict[str, Any]) -> None:
    """The family's own checks first: a bad value gets the very message ``VideoModel.stream()``
    would raise, as a 400 naming the option."""
    given = {k: v for k, v in body.items() if k in VIDEO_STREAM_ARGS}
    if not isinstance(body.get("prompt"), str):
        return  # the body's validation names that
    try:
        parse_video_options(body["prompt"], **given)
    except InvalidArgumentError as exc:
        message = str(exc)
        param = next((n for n in given if message.startswith(n) or f" {n}" in message[:40]), None)
        kind = "invalid_argument"
        if param is not None and not _json_type_fits(VideoBody, param, given[param]):
            kind = "invalid_type"  # e.g. a string where a number goes; the message is still the model's
        raise Problem(400, kind, message, param=param) from None


def check_video_limits(kwargs: dict[str, Any], settings: ServerSettings) -> None:
    """The server's own limits on a video request (a 400 ``limit_exceeded`` names the setting)."""
    check_prompt_limit(kwargs["prompt"], settings)
    if kwargs.get("steps") is not None:
        _limit("steps", kwargs["steps"], settings.max_steps, "max_steps")
    for side in ("height", "width", "preview_max_side"):
        if kwargs.get(side) is not None:
            _limit(side, kwargs[side], settings.max_image_side, "max_image_side")
    if kwargs.get("num_frames") is not None:
        _limit("num_frames", kwargs["num_frames"], settings.max_video_frames, "max_video_frames")


def parse_video_body(body: Any, settings: ServerSettings) -> tuple[dict[str, Any], int]:
    """``POST /v1/video`` body -> (keyword arguments for ``VideoModel.stream``, priority)."""
    if isinstance(body, dict):
        _check_options(body)
    req = validate_body(VideoBody, body, "POST /v1/video")
    kwargs = _given(req)
    priority = kwargs.pop("priority", 0)
    check_video_limits(kwargs, settings)
    return kwargs, priority


def check_video(kwargs: dict[str, Any]) -> None:
    """The model-independent checks of a request's arguments (where the model is not: a Ray ingress)."""
    parse_video_options(**kwargs)


def newest_preview_final(kind: type[Event]) -> Callable[[Any, str, int, float], Event]:
    """The final the server writes for a stream of previews (``kind``: `ImageEvent`, `VideoEvent`)
    when it ends it itself: on a cancel or the content filter, the newest preview, marked as cut
    short (its ``mime`` says it is a preview, not a finished clip); otherwise an error."""

    def final(record: Any, reason: str, seq: int, t: float) -> Event:
        frame = next((e for e in reversed(record.events) if isinstance(e, kind)), None)
        if frame is not None and reason in ("cancelled", "content_filter"):
            return dataclasses.replace(frame, seq=seq, t=t, is_final=True, finish_reason=reason,
                                       metrics={"duration_ms": round(t * 1000, 3)}, eta_s=0.0)
        return ErrorEvent(stream_id=record.stream_id, seq=seq, t=t,
                          error={"type": "Cancelled", "message": f"the stream was ended by the server ({reason})"})

    final.__doc__ = f"The newest {kind.__name__} preview as a cut-short final, else an error."
    return final


video_final = newest_preview_final(VideoEvent)
