"""The event types of the multistream protocol and their JSON wire form.

Every stream (text, image, audio or video) is a sequence of events. Each event has ``type``, ``stream_id``,
``seq`` (0, 1, 2, ... with no gaps), ``t`` (seconds since the stream started) and ``is_final``.
Each stream ends with exactly one event whose ``is_final`` is true, and it is the last one.

Pure Python: importable without torch, so thin clients can parse the protocol.

Example:
    >>> import multistream as ms
    >>> ev = ms.TextEvent(stream_id="s1", seq=0, t=0.01, delta="Hi", token_ids=[123], index=0)
    >>> wire = ev.to_dict()
    >>> wire["type"], wire["delta"]
    ('text', 'Hi')
    >>> ms.event_from_dict(wire) == ev
    True
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Union

from ._atomic import atomic_write
from ._checks import is_int
from ._event_wire import codec_of
from .errors import EventFormatError, InvalidArgumentError

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = [
    "AudioEvent",
    "ErrorEvent",
    "Event",
    "ImageEvent",
    "TextEvent",
    "VideoEvent",
    "event_from_dict",
    "event_from_json",
    "event_json_schema",
]

TEXT_FINISH_REASONS = ("stop", "length", "stop_sequence", "cancelled", "content_filter", "finished_early",
                       "repetition")
IMAGE_FINISH_REASONS = ("stop", "cancelled", "content_filter", "finished_early")
AUDIO_FINISH_REASONS = ("stop", "cancelled")
VIDEO_FINISH_REASONS = IMAGE_FINISH_REASONS
_BYTES_FIELDS = ("data", "audio")  # carried as base64 in the wire form


@dataclass(frozen=True, kw_only=True)
class _BaseEvent:
    """Fields every event shares. Use the concrete classes below."""

    type: ClassVar[str] = ""
    stream_id: str
    seq: int
    t: float
    is_final: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready wire form: plain dicts, lists, str, int, float, bool (bytes as base64).

        Optional fields that are ``None`` are left out, so non-final events stay small.
        """
        return codec_of(type(self)).to_dict(self)

    def to_json(self) -> str:
        """The wire form as one line of compact JSON (no newline), e.g. for NDJSON or SSE."""
        return codec_of(type(self)).to_json(self)


@dataclass(frozen=True, kw_only=True)
class TextEvent(_BaseEvent):
    """Newly generated text.

    ``delta`` is the text since the previous event; ``token_ids`` are the tokens it came from
    (a token that completes no character yet rides along with the next event); ``index`` is the
    position of the first of them in the output. ``offset`` is the character position in the
    answer where ``delta`` begins: a client keeps ``text = text[:offset] + delta`` (without edits
    it is the length of the text so far; after a rewind it is smaller: "replace from here").
    ``revision`` is 0 until the first steer or rewind, then +1 per edit. The final event also
    carries ``finish_reason``, ``text`` (the whole output, after all edits), ``usage``,
    ``metrics`` and, if the stream was edited, ``revisions`` (one dict per edit: ``kind``,
    ``step``, ``offset``, ``instruction``); a stream given ``tools`` has ``tool_calls`` on its
    final event (``[{"id", "name", "arguments"}]``, ``arguments`` the call's JSON text; empty
    when the model answered without a call). A text stream in which a repetition loop was
    detected has ``repetition_loops`` (1), ``repetition_period`` (tokens per repeated unit) and
    ``repetition_start`` (the answer token where the loop began) in its final ``metrics``.

    ``logprobs`` (when the stream asked, ``logprobs=True`` / ``top_logprobs=k``): one entry per
    token of ``token_ids``, in order, ``{"token_id", "token", "bytes", "logprob",
    "top_logprobs": [k entries of the same shape without "top_logprobs", most likely first]}``:
    the log-softmax of the model's raw logits in fp32, before temperature, penalties and masks.
    ``bytes`` are the token's UTF-8 bytes (joined over an answer they spell its text, also where
    a token holds part of a character).

    ``step``, ``offset``, ``instruction``). ``committed`` is how many characters of the answer can
    no longer change: with beam search (``num_beams``), the text every live hypothesis shares (the
    rest, after it, shows the best hypothesis now and may be replaced by a later event's
    ``offset``, never below ``committed``); without beams, the text's length after the event; on
    the final event, the whole text. It never decreases (an explicit steer or rewind aside).

    Example:
        >>> TextEvent(stream_id="s", seq=3, t=0.2, delta=" world", token_ids=[1917], index=1).delta
        ' world'
    """

    type: ClassVar[str] = "text"
    delta: str
    token_ids: list[int] = field(default_factory=list)
    index: int = 0
    offset: int = 0
    revision: int = 0
    finish_reason: str | None = None
    text: str | None = None
    usage: dict[str, int] | None = None
    metrics: dict[str, float] | None = None
    revisions: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    committed: int = 0


@dataclass(frozen=True, kw_only=True)
class ImageEvent(_BaseEvent):
    """One encoded frame: a denoising preview, or (when ``is_final``) the finished image.

    ``data`` holds the encoded bytes (``mime`` says which format); ``image`` decodes them to a PIL
    image on first use. ``eta_s`` is the estimated seconds left until the final image (from this
    request's measured step times; None while unknown, e.g. before the second step; 0 on the
    final).

    Example:
        >>> ev = ImageEvent(stream_id="s", seq=0, t=0.1, step=2, total_steps=20,
        ...                 width=2, height=2, mime="image/png", data=b"...", eta_s=1.8)
        >>> ev.step, ev.total_steps, ev.eta_s
        (2, 20, 1.8)
    """

    type: ClassVar[str] = "image"
    step: int
    total_steps: int
    width: int
    height: int
    mime: str
    data: bytes = field(repr=False)
    index: int = 0
    finish_reason: str | None = None
    metrics: dict[str, float] | None = None
    eta_s: float | None = None

    @functools.cached_property
    def image(self) -> PILImage.Image:
        """The frame decoded to a PIL image (decoded once, then cached)."""
        from PIL import Image

        img = Image.open(io.BytesIO(self.data))
        img.load()
        return img

    def save(self, path: Any) -> Any:
        """Write ``data`` (the finished image on the final event, the preview otherwise) to ``path``
        as it is, whole (missing folders are made); returns the path.

        The suffix must name the bytes' format (``.png`` for the default final, ``.jpg`` or
        ``.webp`` for a preview); for another format convert the decoded image:
        ``ev.image.save("x.gif")``.

        Example:
            >>> sd.generate("a red circle on a blue background").save("circle.png")   # doctest: +SKIP
        """
        return _save_as_is(self.data, self.mime, path, " (or convert it: ev.image.save(path))")


@dataclass(frozen=True, kw_only=True)
class AudioEvent(_BaseEvent):
    """A chunk of synthesized speech, or (when ``is_final``) the whole utterance.

    ``data`` is this chunk as 16-bit little-endian mono PCM at ``sample_rate`` (``mime`` says so:
    ``audio/pcm;rate=22050;bits=16;channels=1``); ``sample_offset`` is how many samples came before
    it and ``num_samples`` how many it holds, so chunks laid end to end at their offsets are the
    utterance. ``text_span`` is ``(start, end)``: the characters of the input this chunk speaks.

    The final event has no samples of its own (``data`` empty, ``sample_offset`` the total) and
    carries ``audio`` (the whole utterance as WAV bytes: exactly the chunks put together),
    ``duration_s``, ``finish_reason`` ("stop" | "cancelled"), ``usage`` (``input_characters``,
    ``audio_seconds``), ``metrics`` (``ttfa_ms``: time to the first audio, ``rtf``: synthesis
    time over audio duration, and more) and ``text``: the input as it was spoken (on a server,
    after its content filter), so captions match the audio; ``text_span`` indexes into it.

    Example:
        >>> ev = AudioEvent(stream_id="s", seq=0, t=0.05, data=b"\\x00\\x00" * 4, sample_rate=22050,
        ...                 sample_offset=0, num_samples=4, text_span=(0, 6))
        >>> ev.num_samples, ev.text_span, ev.samples.tolist()
        (4, (0, 6), [0, 0, 0, 0])
    """

    type: ClassVar[str] = "audio"
    data: bytes = field(repr=False)
    sample_rate: int
    sample_offset: int
    num_samples: int
    text_span: tuple[int, int]
    mime: str = "audio/pcm;rate=22050;bits=16;channels=1"
    audio: bytes | None = field(default=None, repr=False)
    duration_s: float | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    metrics: dict[str, float] | None = None
    text: str | None = None

    @property
    def samples(self) -> Any:
        """This chunk as a numpy ``int16`` array (needs numpy)."""
        import numpy as np

        return np.frombuffer(self.data, dtype="<i2")

    def save(self, path: Any) -> Any:
        """Write the whole utterance (the final event's ``audio``, WAV) to ``path`` (missing folders
        are made); returns the path.
        The suffix must be ``.wav``: other formats are encoded by ``multistream speak --out x.mp3``
        or the server's ``response_format``. A chunk is raw PCM (``data``), not a file.

        Example:
            >>> tts.generate("Hello there.").save("hello.wav")   # doctest: +SKIP
        """
        from pathlib import Path

        out = Path(path)
        if self.audio is None:
            raise InvalidArgumentError("this event is a chunk of raw PCM (its data); save the final event, which "
                                       "carries the whole utterance as WAV (stream.final, or tts.generate(...))")
        if out.suffix.lower() != ".wav":
            raise InvalidArgumentError(
                f"cannot save speech as {out.name!r}: save writes WAV, so the file name must end in .wav "
                "(for MP3, Opus, FLAC or AAC use `multistream speak TEXT --out x.mp3` or the server's "
                "response_format)")
        atomic_write(str(out), self.audio)  # whole: a Ctrl-C or a full disk leaves the old file
        return out


@dataclass(frozen=True, kw_only=True)
class VideoEvent(_BaseEvent):
    """Every frame of a clip at one denoising step, or (when ``is_final``) the finished clip.

    While denoising, ``data`` holds the current estimate of **all** ``num_frames`` frames as one
    animated image (``image/webp``, plays in any ``<img>``) or as a contact sheet (``image/jpeg``:
    the frames left to right, top to bottom, ``ceil(sqrt(num_frames))`` per row); ``width`` and
    ``height`` are one frame's size in ``data``. The final event's ``data`` is the clip itself
    (``video/webm`` VP9 by default, ``video/mp4`` H.264 when asked) at the model's full size, with
    ``finish_reason`` and ``metrics``. ``frames`` decodes any of them to PIL images (lazily, once);
    ``save(path)`` writes the bytes. ``eta_s`` is the estimated seconds left (0 on the final).

    Example:
        >>> ev = VideoEvent(stream_id="s", seq=3, t=0.4, step=3, total_steps=20, num_frames=16, fps=8,
        ...                 width=64, height=64, mime="image/webp", data=b"...")
        >>> ev.type, ev.num_frames / ev.fps
        ('video', 2.0)
    """

    type: ClassVar[str] = "video"
    step: int
    total_steps: int
    num_frames: int
    fps: float
    width: int
    height: int
    mime: str
    data: bytes = field(repr=False)
    index: int = 0
    finish_reason: str | None = None
    metrics: dict[str, float] | None = None
    eta_s: float | None = None

    @functools.cached_property
    def frames(self) -> list[PILImage.Image]:
        """The frames as RGB PIL images (decoded on first use, then cached).

        Animated images and contact sheets need Pillow; ``video/*`` clips need PyAV (``av``).
        """
        return _decode_frames(self)

    def save(self, path: Any) -> Any:
        """Write ``data`` to ``path`` (a clip on the final event, the preview otherwise; missing folders
        are made); returns the path.

        The bytes are written as they are, so the suffix must name their format (``.webm`` for the
        default clip, ``.mp4`` for ``video_format="mp4"``, ``.webp`` or ``.jpg`` for a preview):
        ``clip.mp4`` holding VP9 in WebM was a file that players and editors refuse or misread, so
        a suffix of another format is an `InvalidArgumentError` that names the one to use.

        Example:
            >>> ev.save("clip.webm")  # doctest: +SKIP
        """
        hint = " (or ask for an MP4 with video_format='mp4')" if self.mime == "video/webm" else ""
        return _save_as_is(self.data, self.mime, path, hint)


def _save_as_is(data: bytes, mime: str, path: Any, hint: str = "") -> Any:
    """``data`` written to ``path`` as it is (whole, folders made), once the suffix names ``mime``'s
    format: bytes of one format under another's suffix make a file that viewers refuse or misread."""
    from pathlib import Path

    out = Path(path)
    suffixes = _SUFFIXES_OF_MIME.get(mime, ())
    if suffixes and out.suffix.lower() not in suffixes:
        raise InvalidArgumentError(
            f"cannot save {mime} as {out.name!r}: the bytes are written as they are, so the file "
            f"name must end in {' or '.join(suffixes)}{hint}")
    atomic_write(str(out), data)  # whole: a Ctrl-C or a full disk leaves the old file; folders made
    return out


# The file suffixes of each format an image or video event's data can have (first: the usual one).
_SUFFIXES_OF_MIME = {"video/webm": (".webm",), "video/mp4": (".mp4", ".m4v"), "image/webp": (".webp",),
                     "image/jpeg": (".jpg", ".jpeg"), "image/png": (".png",)}


def _decode_frames(ev: VideoEvent) -> list[PILImage.Image]:
    from PIL import Image, ImageSequence

    if ev.mime.startswith("video/"):
        try:
            import av
        except ImportError as exc:  # pragma: no cover - av ships with the video extra
            raise ImportError("decoding a video clip needs PyAV: pip install 'multistream[video]'") from exc
        with av.open(io.BytesIO(ev.data)) as container:
            return [frame.to_image().convert("RGB") for frame in container.decode(video=0)]
    img = Image.open(io.BytesIO(ev.data))
    if getattr(img, "n_frames", 1) > 1:
        # An animated encoder merges identical consecutive frames into one longer frame (a preview
        # whose frames repeat a latent frame in time); each is counted back by its duration.
        frames: list[PILImage.Image] = []
        period = 1000.0 / ev.fps if ev.fps else 0.0
        for frame in ImageSequence.Iterator(img):
            rgb = frame.convert("RGB")  # loads the frame, which is when its duration is read
            duration = float(frame.info.get("duration") or 0)
            repeat = max(1, round(duration / period)) if period and ev.num_frames > 1 else 1
            frames.extend([rgb] * repeat)
        return frames
    sheet = img.convert("RGB")
    if ev.num_frames <= 1:
        return [sheet]
    columns = math.ceil(math.sqrt(ev.num_frames))
    return [
        sheet.crop((c * ev.width, r * ev.height, (c + 1) * ev.width, (r + 1) * ev.height))
        for r, c in (divmod(i, columns) for i in range(ev.num_frames))
    ]


@dataclass(frozen=True, kw_only=True)
class ErrorEvent(_BaseEvent):
    """The stream failed; ``error`` is ``{"type": <exception class name>, "message": str}``.

    An error event is always final.

    Example:
        >>> ErrorEvent(stream_id="s", seq=5, t=1.0, error={"type": "ValueError", "message": "bad"}).is_final
        True
    """

    type: ClassVar[str] = "error"
    is_final: bool = True
    error: dict[str, str]


Event = Union[TextEvent, ImageEvent, AudioEvent, VideoEvent, ErrorEvent]

_EVENT_CLASSES: dict[str, type[_BaseEvent]] = {
    cls.type: cls for cls in (TextEvent, ImageEvent, AudioEvent, VideoEvent, ErrorEvent)
}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise EventFormatError(message)


def event_from_dict(wire: dict[str, Any]) -> Event:
    """Read an event back from its wire form (the inverse of ``to_dict``; the round trip is exact).

    Raises ``EventFormatError`` naming the first problem when the dict does not follow the protocol.

    Example:
        >>> ev = event_from_dict({"type": "error", "stream_id": "s", "seq": 0, "t": 0.0,
        ...                       "is_final": True, "error": {"type": "X", "message": "m"}})
        >>> ev.error["message"]
        'm'
    """
    _check(isinstance(wire, dict), f"an event must be a JSON object, got {type(wire).__name__}")
    kind = wire.get("type")
    cls = _EVENT_CLASSES.get(kind)  # type: ignore[arg-type]
    _check(cls is not None, f"unknown event type {kind!r}; expected one of {sorted(_EVENT_CLASSES)}")
    assert cls is not None
    known = {f.name: f for f in fields(cls)}
    unknown = set(wire) - set(known) - {"type"}
    _check(not unknown, f"unknown field(s) {sorted(unknown)} for a {kind!r} event")
    kwargs: dict[str, Any] = {}
    for name, value in wire.items():
        if name == "type":
            continue
        if name in _BYTES_FIELDS:
            _check(isinstance(value, str), f"{name!r} must be a base64 string")
            try:
                value = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise EventFormatError(f"{name!r} is not valid base64: {exc}") from exc
        elif name == "eta_s" and value is not None:
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                   "'eta_s' must be a number >= 0 (estimated seconds left) or null")
            value = float(value)
        elif name == "text_span" and cls is AudioEvent:
            _check(isinstance(value, (list, tuple)) and len(value) == 2 and all(is_int(v) for v in value),
                   "'text_span' must be a list of two integers [start, end]")
            value = (int(value[0]), int(value[1]))
        elif name == "fps" and cls is VideoEvent:
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                   "'fps' must be a number > 0 (frames per second)")
            value = float(value)
        elif name == "text" and cls is AudioEvent:
            _check(isinstance(value, str), "an audio event's 'text' must be a string")
        kwargs[name] = value
    _check(isinstance(kwargs.get("stream_id"), str), "'stream_id' must be a string")
    _check(is_int(kwargs.get("seq")) and kwargs["seq"] >= 0, "'seq' must be an integer >= 0")
    _check(isinstance(kwargs.get("t"), (int, float)) and not isinstance(kwargs.get("t"), bool), "'t' must be a number")
    kwargs["t"] = float(kwargs["t"])
    _check(isinstance(kwargs.get("is_final", False), bool), "'is_final' must be a boolean")
    missing = [
        n for n, f in known.items() if n not in kwargs and f.default is MISSING and f.default_factory is MISSING
    ]
    _check(not missing, f"missing field(s) {missing} for a {kind!r} event")
    try:
        return cls(**kwargs)  # type: ignore[return-value]
    except TypeError as exc:
        raise EventFormatError(f"bad {kind!r} event: {exc}") from exc


def event_from_json(line: str | bytes) -> Event:
    """Parse one JSON-encoded event (an NDJSON line or an SSE ``data:`` payload)."""
    try:
        wire = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EventFormatError(f"event is not valid JSON: {exc}") from exc
    return event_from_dict(wire)


def _logprob_schema() -> dict[str, Any]:
    alternative = {
        "type": "object",
        "properties": {
            "token_id": {"type": "integer", "minimum": 0},
            "token": {"type": "string"},
            "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
            "logprob": {"type": "number"},
        },
        "required": ["token_id", "token", "bytes", "logprob"],
    }
    return {**alternative, "properties": {**alternative["properties"],
                                          "top_logprobs": {"type": "array", "items": alternative}},
            "required": [*alternative["required"], "top_logprobs"]}


def event_json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the wire form, for clients in other languages.

    Example:
        >>> schema = event_json_schema()
        >>> sorted(schema["$defs"])
        ['audio', 'error', 'image', 'logprob', 'text', 'video']
    """
    common = {
        "stream_id": {"type": "string"},
        "seq": {"type": "integer", "minimum": 0},
        "t": {"type": "number", "minimum": 0},
        "is_final": {"type": "boolean"},
    }
    metrics = {"type": "object", "additionalProperties": {"type": ["number", "null"]}}
    text = {
        "type": "object",
        "properties": {
            "type": {"const": "text"},
            **common,
            "delta": {"type": "string"},
            "token_ids": {"type": "array", "items": {"type": "integer"}},
            "index": {"type": "integer", "minimum": 0},
            "offset": {"type": "integer", "minimum": 0},
            "revision": {"type": "integer", "minimum": 0},
            "committed": {"type": "integer", "minimum": 0},
            "revisions": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "kind": {"enum": ["steer", "rewind"]},
                        "step": {"type": "integer", "minimum": 0},
                        "offset": {"type": "integer", "minimum": 0},
                        "instruction": {"type": ["string", "null"]},
                    },
                    "required": ["kind", "step", "offset"],
                },
            },
            "finish_reason": {"enum": list(TEXT_FINISH_REASONS)},
            "text": {"type": "string"},
            "usage": {
                "type": "object",
                "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "completion_tokens": {"type": "integer", "minimum": 0},
                },
                "required": ["prompt_tokens", "completion_tokens"],
            },
            "metrics": metrics,
            "logprobs": {"type": "array", "items": {"$ref": "#/$defs/logprob"}},
            "tool_calls": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "name": {"type": "string"},
                        "arguments": {"type": "string"},
                    },
                    "required": ["id", "name", "arguments"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["type", "stream_id", "seq", "t", "is_final", "delta"],
        "additionalProperties": False,
        "if": {"properties": {"is_final": {"const": True}}},
        "then": {"required": ["finish_reason", "text", "usage", "metrics"]},
    }
    image = {
        "type": "object",
        "properties": {
            "type": {"const": "image"},
            **common,
            "step": {"type": "integer", "minimum": 0},
            "total_steps": {"type": "integer", "minimum": 0},
            "width": {"type": "integer", "minimum": 1},
            "height": {"type": "integer", "minimum": 1},
            "mime": {"type": "string", "pattern": "^image/"},
            "data": {"type": "string", "contentEncoding": "base64"},
            "index": {"type": "integer", "minimum": 0},
            "finish_reason": {"enum": list(IMAGE_FINISH_REASONS)},
            "metrics": metrics,
            "eta_s": {"type": ["number", "null"], "minimum": 0,
                      "description": "estimated seconds left until the final image; 0 on the final"},
        },
        "required": ["type", "stream_id", "seq", "t", "is_final", "step", "total_steps", "width", "height", "mime", "data"],
        "additionalProperties": False,
        "if": {"properties": {"is_final": {"const": True}}},
        "then": {"required": ["finish_reason"]},
    }
    audio = {
        "type": "object",
        "properties": {
            "type": {"const": "audio"},
            **common,
            "data": {"type": "string", "contentEncoding": "base64"},
            "mime": {"type": "string", "pattern": "^audio/"},
            "sample_rate": {"type": "integer", "minimum": 1},
            "sample_offset": {"type": "integer", "minimum": 0},
            "num_samples": {"type": "integer", "minimum": 0},
            "text_span": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 2},
            "audio": {"type": "string", "contentEncoding": "base64", "contentMediaType": "audio/wav"},
            "duration_s": {"type": "number", "minimum": 0},
            "finish_reason": {"enum": list(AUDIO_FINISH_REASONS)},
            "usage": {
                "type": "object",
                "properties": {
                    "input_characters": {"type": "integer", "minimum": 0},
                    "audio_seconds": {"type": "number", "minimum": 0},
                },
                "required": ["input_characters", "audio_seconds"],
            },
            "metrics": metrics,
            "text": {"type": "string"},
        },
        "required": ["type", "stream_id", "seq", "t", "is_final", "data", "sample_rate", "sample_offset",
                     "num_samples", "text_span"],
        "additionalProperties": False,
        "if": {"properties": {"is_final": {"const": True}}},
        "then": {"required": ["audio", "duration_s", "finish_reason", "usage", "metrics"]},
    }
    video = {
        "type": "object",
        "properties": {
            "type": {"const": "video"},
            **common,
            "step": {"type": "integer", "minimum": 0},
            "total_steps": {"type": "integer", "minimum": 0},
            "num_frames": {"type": "integer", "minimum": 1},
            "fps": {"type": "number", "exclusiveMinimum": 0},
            "width": {"type": "integer", "minimum": 1, "description": "one frame's width in data"},
            "height": {"type": "integer", "minimum": 1, "description": "one frame's height in data"},
            "mime": {"type": "string", "pattern": "^(image|video)/",
                     "description": "image/webp (animated) or image/jpeg (contact sheet) while denoising; "
                                    "video/webm or video/mp4 on the final"},
            "data": {"type": "string", "contentEncoding": "base64"},
            "index": {"type": "integer", "minimum": 0},
            "finish_reason": {"enum": list(VIDEO_FINISH_REASONS)},
            "metrics": metrics,
            "eta_s": {"type": ["number", "null"], "minimum": 0,
                      "description": "estimated seconds left until the final clip; 0 on the final"},
        },
        "required": ["type", "stream_id", "seq", "t", "is_final", "step", "total_steps", "num_frames", "fps",
                     "width", "height", "mime", "data"],
        "additionalProperties": False,
        "if": {"properties": {"is_final": {"const": True}}},
        "then": {"required": ["finish_reason"]},
    }
    error = {
        "type": "object",
        "properties": {
            "type": {"const": "error"},
            **common,
            "is_final": {"const": True},
            "error": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                "required": ["type", "message"],
            },
        },
        "required": ["type", "stream_id", "seq", "t", "is_final", "error"],
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "multistream event",
        "oneOf": [{"$ref": "#/$defs/text"}, {"$ref": "#/$defs/image"}, {"$ref": "#/$defs/audio"},
                  {"$ref": "#/$defs/video"}, {"$ref": "#/$defs/error"}],
        "$defs": {"text": text, "image": image, "audio": audio, "video": video, "error": error, "logprob": _logprob_schema()},
    }
