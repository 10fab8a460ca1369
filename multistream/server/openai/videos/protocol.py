"""``POST /v1/videos`` (OpenAI's Videos API): the request body and its mapping onto
``VideoModel.stream`` arguments.

The official SDK sends the body as ``multipart/form-data`` (every value a string; a file for
``input_reference``), other clients send JSON; both are read here into one pydantic body. OpenAI's
fields map onto the served model's own: ``size`` ("WIDTHxHEIGHT") must be a size the model makes
(a 400 names the sizes it can: OpenAI's 720x1280 is not one a 64-pixel model draws), ``seconds``
becomes a frame count at the model's frame rate (the shortest count the model makes that lasts
that long: a causal VAE's ``1 + 4k``; left out: the model's own clip length), ``model``
must name the served model. ``input_reference`` (image-to-video) is refused: the served models
make video from text. The clip is an MP4 (H.264), as OpenAI's is, unless the extension
``video_format`` asks for ``"webm"``. The options with a `VideoOptions` namesake (``steps``,
``seed``, ``guidance_scale``, ``negative_prompt``, ``priority``, ``video_format``) are extensions,
declared by the spec.

Example:
    >>> from multistream.image import ImageSizes
    >>> fmt = VideoFormat(sizes=ImageSizes(multiple=16, min_side=32, max_side=128, native=(64, 64)),
    ...                   num_frames=16, fps=8.0)
    >>> req = VideoCreateBody.model_validate({"prompt": "a red circle moving right", "seconds": "4"})
    >>> kwargs = req.to_video_options(fmt)
    >>> kwargs["num_frames"], fmt.seconds_of(kwargs["num_frames"])
    (32, '4')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from pydantic import BaseModel, Field, create_model

from ....errors import InvalidArgumentError
from ....video import VideoOptions
from ...bodies import check_family_options
from ...http.bodies import LAX_BODY, validate_body
from ...http.problems import Problem
from .._common import openai_size
from .._protocol import given_options, option_fields

__all__ = ["VIDEO_OPTION_FIELDS", "OneSize", "VideoCreateBody", "VideoFormat", "form_body", "parse_video_create"]

#: The ``POST /v1/videos`` fields that have a `VideoOptions` namesake (extensions of OpenAI's body).
VIDEO_OPTION_FIELDS = ("steps", "seed", "guidance_scale", "negative_prompt", "priority", "video_format")

#: The longest clip a ``seconds`` may ask for (a bound before the model's own checks).
MAX_SECONDS = 600.0


@dataclass(frozen=True)
class VideoFormat:
    """What the served model makes, as the OpenAI route maps onto it: ``sizes`` (an
    `multistream.image.ImageSizes`: ``check(height, width)``, ``describe()``, ``native``), its
    default clip length ``num_frames`` and its frame rate ``fps``.

    Example:
        >>> from multistream.image import ImageSizes
        >>> VideoFormat(ImageSizes(multiple=16, min_side=32, max_side=128, native=(64, 64)), 16, 8.0).size_of(None, None)
        '64x64'
    """

    sizes: Any
    num_frames: int
    fps: float
    check_num_frames: Callable[[int], int] | None = None
    max_num_frames: int | None = None

    @classmethod
    def of(cls, model: Any) -> VideoFormat:
        """The format a loaded video model declares: its ``sizes`` (`VideoModel.sizes`; a model
        that declares none makes only its own ``width`` x ``height``), ``default_num_frames``,
        ``default_fps``, the frame counts it makes (`VideoModel.check_num_frames`, where it has one)
        and the most it takes (`VideoModel.max_num_frames`)."""
        sizes = getattr(model, "sizes", None)
        if sizes is None:
            sizes = OneSize(int(model.height), int(model.width))
        most = getattr(model, "max_num_frames", None)
        return cls(sizes=sizes, num_frames=int(model.default_num_frames), fps=float(model.default_fps),
                   check_num_frames=getattr(model, "check_num_frames", None),
                   max_num_frames=most if isinstance(most, int) else None)

    def size_of(self, width: int | None, height: int | None) -> str:
        """The ``size`` a job shows: the one asked for, else the model's native size."""
        native = getattr(self.sizes, "native", None)
        h = height if height is not None else (native[0] if native else None)
        w = width if width is not None else (native[1] if native else None)
        return f"{w}x{h}" if w is not None and h is not None else "auto"

    def seconds_of(self, num_frames: int | None, asked: str | int | float | None = None) -> str:
        """The ``seconds`` a job shows: what the request asked for (its clip lasts at least that),
        else its frames at the model's rate (``"2"``, ``"2.125"``)."""
        if asked is not None:
            return f"{float(asked):.3f}".rstrip("0").rstrip(".")
        n = self.num_frames if num_frames is None else num_frames
        return f"{n / self.fps:.3f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class OneSize:
    """The sizes of a model that makes one size only (``check``, ``describe``, ``native`` as
    `multistream.image.ImageSizes` has them).

    Example:
        >>> OneSize(64, 96).describe()
        'one size only: 96x64 (width x height)'
    """

    height: int
    width: int

    @property
    def native(self) -> tuple[int, int]:
        return self.height, self.width

    def describe(self) -> str:
        return f"one size only: {self.width}x{self.height} (width x height)"

    def check(self, height: int | None, width: int | None) -> tuple[int | None, int | None]:
        if (height is None or height == self.height) and (width is None or width == self.width):
            return height, width
        raise InvalidArgumentError(f"this model makes {self.describe()}, not {width}x{height}")


class _VideoCreateBase(BaseModel):
    """``POST /v1/videos`` (OpenAI): start a video job. JSON or ``multipart/form-data`` (what the
    official SDK sends)."""

    model_config = LAX_BODY
    prompt: str = Field(description="a string describing the clip")
    model: Optional[str] = Field(default=None, description="the served video model: its name, \"default\", "
                                 "\"video\" or an OpenAI name (sora-2, sora-2-pro); another name is 404 "
                                 "model_not_found")
    seconds: Optional[Union[str, int, float]] = Field(
        default=None, description="the clip's length in seconds (OpenAI's '4', '8', '12'; any number > 0): that "
        "many seconds of frames at the model's frame rate, which the model must be able to make (a 400 says "
        "what it makes); null: the model's own clip length")
    size: Optional[str] = Field(default=None, description="'WIDTHxHEIGHT', one the model can make (a 400 names "
                                "them); null or 'auto': the model's native size")
    input_reference: Optional[Any] = Field(default=None, description="not supported (a 400): the served models "
                                           "make video from text only")

    def to_video_options(self, fmt: VideoFormat) -> dict[str, Any]:
        """``VideoModel.stream`` keyword arguments: OpenAI's ``size`` and ``seconds`` mapped onto
        the model's sizes and frame rate (a 400 names what it makes), every field with a
        `VideoOptions` namesake passed as it is."""
        if self.input_reference not in (None, ""):
            raise Problem(400, "unsupported_parameter", "input_reference (image-to-video) is not supported: the "
                          "served video model makes clips from a text prompt only; leave it out",
                          param="input_reference")
        kwargs: dict[str, Any] = {"prompt": self.prompt, "video_format": "mp4"}
        if self.size not in (None, "auto"):
            width, height = openai_size(self.size, fmt.sizes, "video")
            if not isinstance(fmt.sizes, OneSize):  # a model of one size takes no size arguments
                kwargs["width"], kwargs["height"] = width, height
        if self.seconds is not None:
            kwargs["num_frames"] = _frames(self.seconds, fmt)
        kwargs.update(given_options(self, tuple(n for n in VIDEO_OPTION_FIELDS if n != "priority")))
        return kwargs


def _frames(seconds: str | int | float, fmt: VideoFormat) -> int:
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(seconds, bool) or not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise Problem(400, "invalid_argument", f"seconds must be a number of seconds > 0 and <= {MAX_SECONDS:g} "
                      f"(e.g. '4'), got {str(seconds)[:20]!r}", param="seconds")
    frames = max(1, round(value * fmt.fps))
    if fmt.max_num_frames is not None and frames > fmt.max_num_frames:
        # Said in seconds, the unit the client chose (the model's own message speaks of num_frames).
        longest = fmt.max_num_frames / fmt.fps
        raise Problem(400, "invalid_argument", f"seconds={str(seconds)[:20]!r} is {frames} frames at this model's "
                      f"{fmt.fps:g} fps, more than the {fmt.max_num_frames} it makes ({longest:g} seconds); ask for "
                      f"seconds <= {longest:g}", param="seconds")
    if fmt.check_num_frames is None:
        return frames
    # A causal video VAE makes 1 + t*k frames (Wan: 81 for "5 seconds" at 16 fps), which whole
    # seconds never are: the clip is the shortest count it makes that lasts the seconds asked for.
    error: InvalidArgumentError | None = None
    for count in range(frames, frames + 16):
        try:
            return int(fmt.check_num_frames(count))
        except InvalidArgumentError as exc:
            error = error or exc
    raise Problem(400, "invalid_argument", f"seconds={str(seconds)[:20]!r} is {frames} frames at this model's "
                  f"{fmt.fps:g} fps, which it cannot make: {error}; pick seconds that give such a count",
                  param="seconds")


def _openai_video_fields() -> dict[str, Any]:
    """The namesake fields, but ``video_format`` defaults to ``"mp4"`` here: OpenAI's clips are
    MP4 and its clients expect one (the spec's default, WebM, is the Python and native one)."""
    fields = option_fields(VideoOptions, VIDEO_OPTION_FIELDS, VIDEO_OPTION_FIELDS)
    wire, spec = fields["video_format"]
    fields["video_format"] = (wire, Field(default="mp4", description=spec.description,
                                          json_schema_extra=spec.json_schema_extra))
    return fields


VideoCreateBody = create_model(
    "VideoCreateBody", __base__=_VideoCreateBase, __doc__=_VideoCreateBase.__doc__, **_openai_video_fields())


def form_body(form: Any) -> dict[str, Any]:
    """A ``multipart/form-data`` (or url-encoded) form as a body dict: its text fields as they are
    (strings, which `parse_video_create` reads leniently), a file part as a marker that it was
    sent (``input_reference`` then gets its 400; the file is not read)."""
    body: dict[str, Any] = {}
    for key, value in form.multi_items():
        body[key] = value if isinstance(value, str) else {"file": getattr(value, "filename", None) or "upload"}
    return body


def parse_video_create(body: Any, fmt: VideoFormat, *, form: bool = False) -> tuple[VideoCreateBody, dict[str, Any]]:
    """A ``POST /v1/videos`` body -> (the validated body, ``VideoModel.stream`` keyword arguments).

    ``form``: the body came as a form, whose values are all strings: numbers are read from them
    (``"20"`` -> 20); a JSON body is checked strictly (a number must be a number)."""
    req = validate_body(VideoCreateBody, body, "POST /v1/videos", strict=False if form else None)
    kwargs: dict[str, Any] = req.to_video_options(fmt)  # type: ignore[attr-defined]
    # The family's own checks now, not when the model starts: a job that waits for a slot answers
    # before that, and a bad option (steps=0) would be a 200 whose job fails later instead of a 400.
    check_family_options("video", kwargs)
    return req, kwargs
